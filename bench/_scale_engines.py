"""The real-engine part of the scale benchmark (`bench.scale`): a real local Ray and the real
local Slurm, each measured in a fresh process, ours beside a raw client in the same run.

- Ray: N `sleep 5` jobs. Ours: one flow calling run_jobs on a RayJobsCluster block. Raw: Ray's
  JobSubmissionClient submitting the same jobs and polling `list_jobs` every 0.5 s. Both keep
  at most RAY_WINDOW jobs submitted and not ended (every Ray job is a supervisor actor, a
  worker process of ~100 MB, and the node starts them one or two at a time on 2 cores: 200 at
  once is 20 GB and minutes of start-up for either side, which measures Ray, not us).
- Slurm: N `sleep 1` jobs. Ours: one flow calling run_jobs on a SlurmCluster block (NeMo-Run's
  SlurmExecutor over one SSH connection). Raw: one fabric SSH connection running `sbatch
  --parsable --wrap` N times, then `squeue` every 0.5 s until none is left. The Slurm side
  needs NeMo-Run: its processes run in .venv-nemo-run.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Pair = tuple[dict[str, Any], dict[str, Any]]  # one round's (ours, raw) figures

RAY_JOB = "sleep 5"
RAY_WINDOW = 50
SLURM_JOB = "sleep 1"
NR_PYTHON = Path(__file__).resolve().parent.parent / ".venv-nemo-run" / "bin" / "python"


def ours(kind: str, n: int, config: dict[str, Any]) -> dict[str, Any]:
    """run_jobs in one flow run on the engine `kind` (ray or slurm)."""
    from prefect import flow
    from pydantic import SecretStr

    from prefect_nemo import JobSpec, run_jobs

    tag = config["tag"]
    if kind == "ray":
        from prefect_nemo.blocks import RayJobsCluster

        block: Any = RayJobsCluster(
            dashboard_url=config["address"], auth_token=config["token"], max_poll_interval_s=2.0
        )
        window, entrypoint = RAY_WINDOW, RAY_JOB
    else:
        from prefect_nemo.blocks.slurm import SlurmCluster

        block = SlurmCluster(
            host=config["host"],
            port=config["port"],
            user=config["user"],
            identity_key=SecretStr(Path(config["identity"]).read_text()),
            known_hosts=Path(config["known_hosts"]).read_text(),
            job_dir=config["job_dir"],
            account=config["account"],
            partition=config["partition"],
            time="00:05:00",
            max_poll_interval_s=2.0,
        )
        window, entrypoint = n, SLURM_JOB
    specs = [JobSpec(entrypoint=entrypoint, name=f"{tag}-{i:04d}") for i in range(n)]

    @flow(name=f"scale-bench-{kind}")
    def scale_bench() -> dict[str, int]:
        results = run_jobs(specs, block, max_in_flight=window, raise_on_failure=False)
        states = [r.state.value for r in results]
        return {s: states.count(s) for s in set(states)}

    t0 = time.monotonic()
    states = scale_bench()
    return {"wall_s": time.monotonic() - t0, "states": states}


def raw(kind: str, n: int, config: dict[str, Any]) -> dict[str, Any]:
    """The same jobs through the engine's own client, no Prefect."""
    return _raw_ray(n, config) if kind == "ray" else _raw_slurm(n, config)


def _raw_ray(n: int, config: dict[str, Any]) -> dict[str, Any]:
    from ray.job_submission import JobSubmissionClient

    t0 = time.monotonic()
    client = JobSubmissionClient(
        config["address"], headers={"Authorization": f"Bearer {config['token']}"}
    )
    todo = [f"raw-{config['tag']}-{i:04d}" for i in range(n)]
    live: set[str] = set()
    states: dict[str, str] = {}
    while todo or live:
        while todo and len(live) < RAY_WINDOW:
            job_id = todo.pop(0)
            client.submit_job(entrypoint=RAY_JOB, submission_id=job_id)
            live.add(job_id)
        time.sleep(0.5)
        for job in client.list_jobs():
            if job.submission_id in live and job.status.is_terminal():
                live.discard(job.submission_id)
                states[job.submission_id] = job.status.value
    counts = list(states.values())
    return {"wall_s": time.monotonic() - t0, "states": {s: counts.count(s) for s in set(counts)}}


def _raw_slurm(n: int, config: dict[str, Any]) -> dict[str, Any]:
    import paramiko
    from fabric import Connection

    t0 = time.monotonic()
    conn = Connection(
        config["host"],
        user=config["user"],
        port=config["port"],
        connect_kwargs={"key_filename": config["identity"], "look_for_keys": False},
    )
    conn.client.load_host_keys(config["known_hosts"])
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    sbatch = (
        f"sbatch --parsable -A {config['account']} -p {config['partition']} -t 00:05:00 "
        f"-o /dev/null -J raw-{config['tag']} --wrap '{SLURM_JOB}'"
    )
    ids = [conn.run(sbatch, hide=True).stdout.strip().split(";")[0] for _ in range(n)]
    joined = ",".join(ids)
    while conn.run(f"squeue -h -o %i -j {joined} 2>/dev/null", hide=True, warn=True).stdout.strip():
        time.sleep(0.5)
    conn.close()
    return {"wall_s": time.monotonic() - t0, "states": {"submitted": len(ids)}}


# ---------------------------------------------------------------------------------------------
# The driver side (in bench.scale's process): the engines, one fresh process per measurement


def measure_ray(
    n: int, api_url: str, run_child: Callable[..., dict[str, Any]], rounds: int = 1
) -> list[Pair]:
    """`rounds` interleaved rounds of raw and ours on one fresh local Ray head."""
    from prefect_nemo.local_ray import start_local_ray

    with start_local_ray(num_cpus=8) as cluster:
        config = {"address": cluster.dashboard_url, "token": cluster.token, "tag": ""}
        return _rounds(run_child, "ray", n, config, api_url, sys.executable, rounds)


def measure_slurm(
    n: int, api_url: str, run_child: Callable[..., dict[str, Any]], job_dir: str, rounds: int = 1
) -> list[Pair]:
    """`rounds` interleaved rounds of raw and ours on the local Slurm (the running one, or one
    started and stopped)."""
    from prefect_nemo.testing.slurm import LocalSlurm

    if not NR_PYTHON.exists():
        raise RuntimeError(
            f"the Slurm backend needs NeMo-Run: {NR_PYTHON} is missing (make install)"
        )
    with LocalSlurm() as slurm:
        config = {
            "host": slurm.host,
            "port": slurm.port,
            "user": slurm.user,
            "identity": str(slurm.identity),
            "known_hosts": str(slurm.known_hosts),
            "account": slurm.account,
            "partition": slurm.partition,
            "job_dir": job_dir,
            "tag": f"{time.time_ns() % 10**8}",
        }
        return _rounds(run_child, "slurm", n, config, api_url, str(NR_PYTHON), rounds)


def _rounds(
    run_child: Callable[..., dict[str, Any]],
    kind: str,
    n: int,
    config: dict[str, Any],
    api_url: str,
    python: str,
    rounds: int,
) -> list[Pair]:
    """The (ours, raw) figures of `rounds` interleaved rounds (bench._rounds), each side a fresh
    process on the same engine; every run's jobs get a tag of their own (side and run number
    after the engine's `tag`), so no run attaches to another's jobs."""
    from bench._rounds import interleaved

    runs = itertools.count(1)

    def side(name: str, url: str | None) -> dict[str, Any]:
        tag = f"{name[0]}{config['tag']}-{next(runs)}"
        return run_child(name, kind, n, {**config, "tag": tag}, url, python)

    return interleaved(lambda: side("ours", api_url), lambda: side("raw", None), rounds)


def child_main(side: str, kind: str, n: int, config_path: str) -> None:
    """`python -m bench._scale_engines <ours|raw> <ray|slurm> N config.json`: one measurement
    in this fresh process; prints its figures (peaks of this process) as one JSON line."""
    from bench._scale_probe import Sampler, peak_rss_mb

    config = json.loads(Path(config_path).read_text())
    with Sampler() as sampler:
        out = (ours if side == "ours" else raw)(kind, n, config)
    out.update(peak_threads=sampler.peak_threads, peak_rss_mb=peak_rss_mb())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
