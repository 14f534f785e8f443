"""Packing cost: build_archive + plan_for on a generated 50 MB tree vs `tar -czf` of the same files.

The tree (generated deterministically under a temp dir) mixes compressible Python-like text
(~70%) and incompressible binary blobs (~30%), as a project with a few small checkpoints or
tokenizer files would. Each repetition packs into an empty cache (a cold pack) and times
`tar -czf` (gzip level 6, its default; ours uses the same) over the same files right after.

Figures: pack_vs_tar_ratio (median cold pack + Kubernetes plan / median tar; goal <= 1.2),
repack_fraction (median re-plan of the unchanged tree / median cold pack; goal <= 0.05,
through the content-hash cache), pack_s, tar_s, repack_s, archive_mb, tar_mb.

The two headline figures are CPU-time ratios (our process's CPU; tar's and gzip's together,
from RUSAGE_CHILDREN): on a shared machine wall time swings with the load, CPU time does
not. The wall-clock ratios are reported too (`*_wall_*`). Repetitions alternate which side
runs first.
"""

from __future__ import annotations

import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prefect_nemo.packaging import build_archive, plan_for

Report = Callable[[str, object], None]

TREE_BYTES = 50 * 1024 * 1024
BINARY_FRACTION = 0.3
REPEATS = 5
SEED = 20261121
_WORDS = (
    "def class return import self model config torch tensor batch loss optimizer step "
    "for in if else with as yield lambda None True False data loader rank world size "
    "learning_rate = + - * / ( ) [ ] { } : , . 0 1 2 3 42 0.1 1e-4 # TODO"
).split()


def log(message: str) -> None:
    print(f"[pack] {message}", file=sys.stderr, flush=True)


def _text_file(rng: random.Random, size: int) -> bytes:
    lines: list[str] = []
    total = 0
    while total < size:
        indent = "    " * rng.randint(0, 3)
        line = indent + " ".join(rng.choices(_WORDS, k=rng.randint(3, 14))) + "\n"
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()[:size]


def generate_tree(root: Path, total: int = TREE_BYTES) -> int:
    """Write a deterministic project of about `total` bytes under root; return the bytes written."""
    rng = random.Random(SEED)
    (root / "proj").mkdir(parents=True)
    project = root / "proj"
    (project / "pyproject.toml").write_text("[project]\nname = 'bench'\n")
    written = 0
    binary_budget = int(total * BINARY_FRACTION)
    index = 0
    while written < binary_budget:
        size = rng.randint(256 * 1024, 3 * 1024 * 1024)
        path = project / "benchpkg" / "assets" / f"blob{index}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
        written += size
        index += 1
    index = 0
    while written < total:
        size = int(rng.lognormvariate(9.5, 1.0)) + 200  # median ~13 KB, a long tail
        path = project / "benchpkg" / f"mod{index % 40}" / f"file{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_text_file(rng, size))
        written += size
        index += 1
    for directory in [project / "benchpkg", *sorted((project / "benchpkg").glob("mod*"))]:
        (directory / "__init__.py").touch()
    return written


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall s, CPU s of this process and of the children it waited for, result)."""
    wall, cpu, children = time.perf_counter(), time.process_time(), _children_cpu()
    result = fn()
    cpu_used = time.process_time() - cpu + _children_cpu() - children
    return time.perf_counter() - wall, cpu_used, result


def run(report: Report) -> None:
    """Time cold packs, tar -czf and re-plans; report medians."""
    if shutil.which("tar") is None:
        raise RuntimeError("tar is not on PATH")
    with tempfile.TemporaryDirectory(prefix="prefect-nemo-bench-pack-") as tmp:
        base = Path(tmp)
        written = generate_tree(base)
        project = base / "proj"
        log(f"generated {written / 1e6:.1f} MB under {project}")
        max_bytes = 200 * 1024 * 1024  # the bench tree is far over the 8 MiB ConfigMap default

        def pack(cache: Path) -> object:
            archive = build_archive(project, cache_dir=cache)
            return plan_for("kubernetes", archive, name="bench", max_bytes=max_bytes), archive

        files = sorted(p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file())
        listing = base / "files.txt"
        listing.write_text("\n".join(files) + "\n")
        tar_out = base / "out.tar.gz"

        def tar() -> None:
            subprocess.run(
                ["tar", "-czf", str(tar_out), "-C", str(project), "-T", str(listing)], check=True
            )

        tar()  # warm the page cache for both sides
        samples: dict[str, list[tuple[float, float]]] = {"pack": [], "tar": [], "repack": []}
        archive_size = 0
        for rep in range(REPEATS):
            cache = base / f"cache{rep}"
            if rep % 2:
                samples["tar"].append(_time(tar)[:2])
            wall, cpu, (plan, archive) = _time(lambda cache=cache: pack(cache))  # type: ignore[misc]
            samples["pack"].append((wall, cpu))
            archive_size = archive.size
            if not rep % 2:
                samples["tar"].append(_time(tar)[:2])
            wall, cpu, (plan2, _) = _time(lambda cache=cache: pack(cache))  # type: ignore[misc]
            samples["repack"].append((wall, cpu))
            assert plan2.sha256 == plan.sha256 and plan2.chunks == plan.chunks
            log(
                f"rep {rep}: "
                + ", ".join(
                    f"{k} {v[-1][0]:.3f}s wall {v[-1][1]:.3f}s cpu" for k, v in samples.items()
                )
            )
        wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
        report("pack_vs_tar_ratio", cpu["pack"] / cpu["tar"])
        report("repack_fraction", cpu["repack"] / cpu["pack"])
        report("pack_vs_tar_wall_ratio", wall["pack"] / wall["tar"])
        report("repack_wall_fraction", wall["repack"] / wall["pack"])
        report("pack_s", wall["pack"])
        report("tar_s", wall["tar"])
        report("repack_s", wall["repack"])
        report("pack_cpu_s", cpu["pack"])
        report("tar_cpu_s", cpu["tar"])
        report("repack_cpu_s", cpu["repack"])
        report("archive_mb", archive_size / 1e6)
        report("tar_mb", tar_out.stat().st_size / 1e6)


if __name__ == "__main__":
    from bench.run_all import report as print_report

    run(print_report)
