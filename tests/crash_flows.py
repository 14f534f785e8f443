"""Flows that crash-safety tests run in child processes (served, or killed with -9).

The cluster comes from the environment (TEST_RAY_URL, TEST_RAY_TOKEN) so no secret is on argv.
"""

from __future__ import annotations

import os
import sys

from prefect import flow

from prefect_nemo import JobSpec, RayJobsCluster, RecoveryPolicy, run_job, start_experiment


def cluster() -> RayJobsCluster:
    return RayJobsCluster(
        dashboard_url=os.environ["TEST_RAY_URL"], auth_token=os.environ["TEST_RAY_TOKEN"]
    )


@flow
def long_jobs(seconds: int = 120) -> None:
    """Two jobs waited on in worker threads and one in the main thread."""
    futures = [
        run_job.submit(JobSpec(entrypoint=f"sleep {seconds}", name=f"bg-{i}"), cluster())
        for i in range(2)
    ]
    run_job(JobSpec(entrypoint=f"sleep {seconds}", name="fg"), cluster())
    for future in futures:
        future.result()


@flow
def experiment_jobs(experiment: str, seconds: int = 10) -> list[bool]:
    """An experiment with two parallel jobs; a re-run of the same experiment re-attaches."""
    start_experiment(experiment)
    futures = [
        run_job.submit(JobSpec(entrypoint=f"sleep {seconds}", name=f"step-{i}"), cluster())
        for i in range(2)
    ]
    results = [f.result() for f in futures]
    print("ATTACHED=" + ",".join(str(r.attached) for r in results), flush=True)
    return [r.attached for r in results]


# fails at once on its first attempt, then runs `seconds` (argv[1]) and succeeds
RESUMING = (
    'python -c \'import os, sys, time; first = os.environ["PREFECT_NEMO_ATTEMPT"] == "0"; '
    "sys.exit(1) if first else time.sleep(int(sys.argv[1]))' {seconds}"
)


@flow
def recovering_job(experiment: str, seconds: int = 10) -> None:
    """One job of an experiment whose first attempt fails and is resubmitted (one restart on
    errors); a re-run of the experiment re-attaches to its newest attempt."""
    start_experiment(experiment)
    spec = JobSpec(
        entrypoint=RESUMING.format(seconds=seconds),
        name="resume",
        recovery=RecoveryPolicy(max_restarts_on_errors=1, backoff_s=0),
    )
    result = run_job(spec, cluster())
    attempts = ",".join(a.job_id for a in result.attempts)
    print(f"JOB={result.handle.job_id} ATTACHED={result.attached} ATTEMPTS={attempts}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        long_jobs.serve(name="long-jobs", limit=4)
    elif sys.argv[1] == "recovering":
        recovering_job(sys.argv[2], int(sys.argv[3]))
    else:
        experiment_jobs(sys.argv[2], int(sys.argv[3]))
