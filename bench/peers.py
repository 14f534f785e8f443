"""A peer at scale (issue 30, 5): dagster-ray beside ours and the raw client on the same Ray
(`make bench-peers`; optional, not part of `make bench`).

One local Ray head (token auth on, as `bench.scale` starts it) and one Prefect test server for
the whole bench; then ROUNDS interleaved rounds of N `sleep 5` jobs (the jobs and the window of
50 of `scale_ray_ratio_200`, `bench/_scale_engines.py`), each side in a fresh process, the order
rotated every round so a load that drifts over the bench hits every side alike (`_rounds`):

- raw: Ray's JobSubmissionClient submitting and polling `list_jobs` (`_scale_engines._raw_ray`).
- ours: run_jobs in one flow run on a RayJobsCluster block (`_scale_engines.ours`).
- dagster-ray: `PipesRayJobClient.run` per job, from one Dagster job executed in-process, 50
  threads at once (`_peer_dagster_ray`, in `.venv-peers`: dagster, dagster-ray and Ray at the
  cluster's version, apart from our environments; why threads, see that module).

Figures, each a ratio over raw as `median [min, max]` of the rounds: peer_dagster_ray_ratio_200
(dagster-ray's wall / raw's) and scale_ray_ratio_200 (ours / raw) from the same rounds, then
each side's wall seconds, peak RSS and threads, and the jobs' end states.

    make bench-peers                                   # installs .venv-peers, then this
    .venv/bin/python -m bench.peers                    # N = 200, 3 rounds
    PEERS_N=20 PEERS_ROUNDS=1 .venv/bin/python -m bench.peers   # a quick check
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = Path(os.environ.get("PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
N = int(os.environ.get("PEERS_N", "200"))
ROUNDS = int(os.environ.get("PEERS_ROUNDS", "3"))
WARMUP_N = 10  # one small run of each side first: Ray's first job supervisors start slower


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def main(n: int = N, rounds: int = ROUNDS) -> int:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from bench._rounds import rotated
    from bench.scale import engine_child
    from prefect_nemo.local_ray import start_local_ray

    if not PEERS_PYTHON.exists():
        log(f"{PEERS_PYTHON} is missing: `make bench-peers` installs it")
        return 1
    with prefect_test_harness(server_startup_timeout=180):
        api_url = str(PREFECT_API_URL.value())
        with start_local_ray(num_cpus=8) as cluster:
            config = {"address": cluster.dashboard_url, "token": cluster.token}
            runs = itertools.count()  # submission ids stay unique over every run on the head

            def side(name: str, size: int) -> Callable[[], dict[str, Any]]:
                python, module, api = sys.executable, "bench._scale_engines", None
                if name == "ours":
                    api = api_url
                elif name == "peer":
                    python, module = str(PEERS_PYTHON), "bench._peer_dagster_ray"

                def measure() -> dict[str, Any]:
                    tag = f"{name[0]}{next(runs)}"
                    cfg = {**config, "tag": tag}
                    out = engine_child(name, "ray", size, cfg, api, python, module=module)
                    log(f"{name} N={size}: {out['wall_s']:.1f}s {out['states']}")
                    return out

                return measure

            names = ("raw", "ours", "peer")
            log(f"warm-up: each side once at N={WARMUP_N}")
            rotated({s: side(s, WARMUP_N) for s in names}, rounds=1)
            log(f"{rounds} rounds of raw, ours and dagster-ray at N={n}")
            results = rotated({s: side(s, n) for s in names}, rounds=rounds)
    _report(results, n)
    return 0


def _report(results: list[dict[str, dict[str, Any]]], n: int) -> None:
    """The figures of the rounds, one `key=value` line each."""
    from bench._rounds import Spread
    from bench.run_all import report

    peer = Spread.of(r["peer"]["wall_s"] / r["raw"]["wall_s"] for r in results)
    ours = Spread.of(r["ours"]["wall_s"] / r["raw"]["wall_s"] for r in results)
    report(f"peer_dagster_ray_ratio_{n}", peer)
    report(f"scale_ray_ratio_{n}", ours)
    report(
        f"peer_dagster_ray_over_ours_{n}",
        Spread.of(r["peer"]["wall_s"] / r["ours"]["wall_s"] for r in results),
    )
    labels = {"raw": "peer_raw", "ours": "peer_ours", "peer": "peer_dagster_ray"}
    for name, label in labels.items():
        for figure, key in (("wall_s", "wall_s"), ("rss_mb", "peak_rss_mb")):
            report(f"{label}_{figure}_{n}", Spread.of(r[name][key] for r in results))
        report(f"{label}_threads_{n}", max(r[name]["peak_threads"] for r in results))
        states: dict[str, int] = {}
        for r in results:
            for state, count in r[name]["states"].items():
                states[state] = states.get(state, 0) + count
        report(f"{label}_states_{n}", ",".join(f"{k}:{v}" for k, v in sorted(states.items())))


if __name__ == "__main__":
    sys.exit(main())
