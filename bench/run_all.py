"""Run every benchmark module in bench/ and print its figures, one `key=value` line each.

    .venv/bin/python -m bench.run_all

A benchmark module is any module of this package (other than this one and names starting with
'_') with a `run(report)` function; it calls `report(key, value)` once per figure. Figures go to
stdout; progress and diagnostics go to stderr.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import bench

Report = Callable[[str, object], None]


def format_value(value: object) -> str:
    """Floats to 3 decimals; everything else as str() (a ratio over rounds, bench._rounds'
    Spread, as `median [min, max]`)."""
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def report(key: str, value: object) -> None:
    """Print one figure on stdout, at once (a later crash must not lose it)."""
    print(f"{key}={format_value(value)}", flush=True)


def benchmark_modules() -> list[str]:
    """Names of the benchmark modules of this package, sorted."""
    return sorted(
        info.name
        for info in pkgutil.iter_modules(bench.__path__)
        if not info.name.startswith("_") and info.name != "run_all"
    )


def print_last_scale() -> None:
    """The figures of the last `make bench-scale` (too long to run here), with when it ran."""
    last = Path(bench.__path__[0]) / ".last-scale.txt"
    if not last.exists():
        print("[bench] scale: no results yet (make bench-scale)", file=sys.stderr, flush=True)
        return
    for line in last.read_text().splitlines():
        if line.startswith("#"):
            print(f"[bench] scale: last results {line[1:].strip()}", file=sys.stderr, flush=True)
        elif "=" in line:
            print(line, flush=True)


def main() -> int:
    """Run each benchmark module in turn; exit 1 if any of them raised."""
    failed: list[str] = []
    started = time.monotonic()
    for name in benchmark_modules():
        module = importlib.import_module(f"{bench.__name__}.{name}")
        run = getattr(module, "run", None)
        if not callable(run):
            continue
        print(f"[bench] {name}: running", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            run(report)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"[bench] {name}: {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    print_last_scale()
    print(
        f"[bench] all done in {time.monotonic() - started:.1f}s"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        file=sys.stderr,
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
