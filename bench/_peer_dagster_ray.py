"""The peer side of `bench.peers`: dagster-ray's `PipesRayJobClient` running N Ray jobs from one
Dagster job executed in-process. Runs in `.venv-peers` (dagster, dagster-ray, Ray at the
cluster's version), never in our environments: nothing here imports prefect or prefect_nemo.

How the peer runs many: `PipesRayJobClient.run` submits one Ray job and blocks until it ends
(polling `get_job_status` every `poll_interval`, 1 s by default, and tailing the job's log in a
thread of its message reader). Dagster's in-process executor runs steps one after another and
it has no threaded executor, so the jobs run concurrently the way a Dagster user gets them to
without a process per step: one op whose threads each call `run`, at most RAY_WINDOW at once
(the window raw and ours keep). Each job gets its own client: the client's message reader holds
the state of one job (its id, its log thread), so one client cannot serve two jobs at once.

    .venv-peers/bin/python -m bench._peer_dagster_ray peer ray N config.json
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The same jobs as bench._scale_engines (not imported: it is ours' environment's module).
RAY_JOB = "sleep 5"
RAY_WINDOW = 50


def peer(n: int, config: dict[str, Any]) -> dict[str, Any]:
    """N Ray jobs through PipesRayJobClient, from one Dagster job run in-process."""
    import dagster as dg
    from dagster_ray import PipesRayJobClient

    headers = {"Authorization": f"Bearer {config['token']}"}
    tag = config["tag"]
    states: dict[str, str] = {}

    def one(context: dg.OpExecutionContext, index: int) -> None:
        client = PipesRayJobClient(address=config["address"], headers=headers)
        job_id = f"dagster-{tag}-{index:04d}"
        try:
            client.run(
                context=context,
                submit_job_params={"entrypoint": RAY_JOB, "submission_id": job_id},
            )
            states[job_id] = "SUCCEEDED"
        except Exception as exc:  # the client raises on a failed or stopped job: count it
            context.log.error(f"{job_id}: {exc!r}")
            states[job_id] = "FAILED"

    # Dagster resolves an op's annotations at definition: this module's are strings (future
    # import) naming a local import, so the op's context goes unannotated (found by its name).
    @dg.op
    def ray_jobs(context) -> None:
        # the pool is this op's: `with` joins its threads before the op returns
        with ThreadPoolExecutor(max_workers=RAY_WINDOW, thread_name_prefix="peer-ray") as pool:
            list(pool.map(lambda i: one(context, i), range(n)))

    @dg.job
    def peer_bench() -> None:
        ray_jobs()

    t0 = time.monotonic()
    result = peer_bench.execute_in_process()
    wall_s = time.monotonic() - t0
    counts = list(states.values())
    return {
        "wall_s": wall_s,
        "success": result.success,
        "states": {s: counts.count(s) for s in set(counts)},
    }


def main(side: str, kind: str, n: int, config_path: str) -> None:
    """`python -m bench._peer_dagster_ray peer ray N config.json`: one measurement in this fresh
    process; its figures as one JSON line, as `bench._scale_engines` prints them."""
    from bench._scale_probe import Sampler, peak_rss_mb

    if (side, kind) != ("peer", "ray"):
        raise SystemExit(f"expected `peer ray`, got `{side} {kind}`")
    config = json.loads(Path(config_path).read_text())
    with Sampler() as sampler:
        out = peer(n, config)
    out.update(peak_threads=sampler.peak_threads, peak_rss_mb=peak_rss_mb())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
