"""Packing cost: build_archive + plan_for on a generated 50 MB tree vs `tar -czf` of the same files.

The tree (generated deterministically under a temp dir) mixes compressible Python-like text
(~70%) and incompressible binary blobs (~30%), as a project with a few small checkpoints or
tokenizer files would. Each repetition packs into an empty cache (a cold pack) and times
`tar -czf` (gzip level 6, its default; ours uses the same) over the same files right after.

Figures: pack_vs_tar_ratio (cold pack + Kubernetes plan / tar; goal <= 1.2), repack_fraction
(re-plan of the unchanged tree / cold pack; goal <= 0.05, through the content-hash cache),
each per round of ROUNDS interleaved rounds (bench._rounds), printed `median [min, max]`;
pack_s, tar_s, repack_s (medians), archive_mb, tar_mb.

The two headline figures are CPU-time ratios (our process's CPU; tar's and gzip's together,
from RUSAGE_CHILDREN): on a shared machine wall time swings with the load, CPU time does
not. The wall-clock ratios are reported too (`*_wall_*`).
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
from itertools import count
from pathlib import Path
from typing import NamedTuple, TypeVar

from bench._rounds import ROUNDS, Spread, interleaved
from prefect_nemo.packaging import SourceArchive, TransportPlan, build_archive, plan_for

Report = Callable[[str, object], None]
T = TypeVar("T")

TREE_BYTES = 50 * 1024 * 1024
BINARY_FRACTION = 0.3
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


def _time(fn: Callable[[], T]) -> tuple[float, float, T]:
    """(wall s, CPU s of this process and of the children it waited for, result)."""
    wall, cpu, children = time.perf_counter(), time.process_time(), _children_cpu()
    result = fn()
    cpu_used = time.process_time() - cpu + _children_cpu() - children
    return time.perf_counter() - wall, cpu_used, result


class Timed(NamedTuple):
    """Wall and CPU seconds of one step."""

    wall: float
    cpu: float


class Packed(NamedTuple):
    """One round of ours: a cold pack into an empty cache, then a re-plan through it."""

    pack: Timed
    repack: Timed
    archive_bytes: int


def run(report: Report) -> None:
    """Time cold packs and re-plans against tar -czf in interleaved rounds."""
    if shutil.which("tar") is None:
        raise RuntimeError("tar is not on PATH")
    with tempfile.TemporaryDirectory(prefix="prefect-nemo-bench-pack-") as tmp:
        base = Path(tmp)
        written = generate_tree(base)
        project = base / "proj"
        log(f"generated {written / 1e6:.1f} MB under {project}")
        max_bytes = 200 * 1024 * 1024  # the bench tree is far over the 8 MiB ConfigMap default

        def pack(cache: Path) -> tuple[TransportPlan, SourceArchive]:
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
        caches = count()

        def ours() -> Packed:
            cache = base / f"cache{next(caches)}"
            wall, cpu, (plan, archive) = _time(lambda: pack(cache))
            wall2, cpu2, (plan2, _) = _time(lambda: pack(cache))
            assert plan2.sha256 == plan.sha256 and plan2.chunks == plan.chunks
            log(f"pack {wall:.3f}s wall {cpu:.3f}s cpu, repack {wall2:.3f}s wall {cpu2:.3f}s cpu")
            return Packed(Timed(wall, cpu), Timed(wall2, cpu2), archive.size)

        def raw() -> Timed:
            wall, cpu, _ = _time(tar)
            log(f"tar {wall:.3f}s wall {cpu:.3f}s cpu")
            return Timed(wall, cpu)

        pairs = interleaved(ours, raw, ROUNDS)
        report("pack_vs_tar_ratio", Spread.of(o.pack.cpu / r.cpu for o, r in pairs))
        report("repack_fraction", Spread.of(o.repack.cpu / o.pack.cpu for o, _ in pairs))
        report("pack_vs_tar_wall_ratio", Spread.of(o.pack.wall / r.wall for o, r in pairs))
        report("repack_wall_fraction", Spread.of(o.repack.wall / o.pack.wall for o, _ in pairs))
        report("pack_s", statistics.median(o.pack.wall for o, _ in pairs))
        report("tar_s", statistics.median(r.wall for _, r in pairs))
        report("repack_s", statistics.median(o.repack.wall for o, _ in pairs))
        report("pack_cpu_s", statistics.median(o.pack.cpu for o, _ in pairs))
        report("tar_cpu_s", statistics.median(r.cpu for _, r in pairs))
        report("repack_cpu_s", statistics.median(o.repack.cpu for o, _ in pairs))
        report("archive_mb", pairs[-1][0].archive_bytes / 1e6)
        report("tar_mb", tar_out.stat().st_size / 1e6)


if __name__ == "__main__":
    from bench.run_all import report as print_report

    run(print_report)
