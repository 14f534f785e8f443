"""The flow the chaos scenarios run as a plain script (`python -m prefect_nemo.testing.chaos_flows
'<entrypoint>' ...`): one Ray job per entrypoint, waited on in parallel.

The cluster comes from the environment (CHAOS_RAY_URL, CHAOS_RAY_TOKEN, CHAOS_BLOCK: extra
block fields as JSON) so no secret is on argv. With CHAOS_EVENTS_FILE, every
`prefect-nemo.job.*` event the run emits is also written there (id, name, job) as it is made:
what a scenario counts in the API afterwards.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from prefect import flow

from prefect_nemo import JobSpec, RayJobsCluster, run_job
from prefect_nemo.tasks._outbox import outbox


def cluster() -> RayJobsCluster:
    """The scenario's Ray cluster block."""
    extra = json.loads(os.environ.get("CHAOS_BLOCK") or "{}")
    return RayJobsCluster(
        dashboard_url=os.environ["CHAOS_RAY_URL"],
        auth_token=os.environ["CHAOS_RAY_TOKEN"],
        **extra,
    )


@flow
def chaos_jobs(entrypoints: list[str]) -> list[str]:
    """One job per entrypoint (named j0, j1, ...), all waited on; their final states."""
    block = cluster()
    specs = [JobSpec(entrypoint=e, name=f"j{i}") for i, e in enumerate(entrypoints)]
    futures = [run_job.submit(spec, block) for spec in specs]
    print("SUBMITTED", flush=True)
    return [f.result().state.value for f in futures]


def record_events(path: str) -> None:
    """Write down every job event the run puts into the outbox, as it is put."""
    put = outbox.event

    def event(value: Any, **kwargs: Any) -> None:
        if value.event.startswith("prefect-nemo.job."):
            record = {"id": str(value.id), "event": value.event,
                      "job": value.resource.get("prefect.resource.name")}  # fmt: skip
            with open(path, "a") as out:
                out.write(json.dumps(record) + "\n")
        put(value, **kwargs)

    outbox.event = event  # type: ignore[method-assign]


if __name__ == "__main__":
    if events_file := os.environ.get("CHAOS_EVENTS_FILE"):
        record_events(events_file)
    print("RESULT " + json.dumps(chaos_jobs(sys.argv[1:])), flush=True)
