"""A Ray client as Ray 2.53 had it: submit_job without entrypoint_label_selector.

Ray's JobSubmissionClient.submit_job gained `entrypoint_label_selector` in 2.54.0 (the 2.53.0 and
2.54.0 wheels' ray/dashboard/modules/job/sdk.py). The subclass below has 2.53.0's exact
signature and hands every call to the real client, so its requests reach the real cluster.
"""

from __future__ import annotations

from typing import Any

from prefect_nemo.backends.ray_jobs import RayJobsBackend, TimedJobClient
from prefect_nemo.blocks import RayJobsCluster


class Ray253Client(TimedJobClient):
    """The job client with Ray 2.53.0's submit_job signature (no entrypoint_label_selector)."""

    def submit_job(  # type: ignore[override]
        self,
        *,
        entrypoint: str,
        job_id: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        submission_id: str | None = None,
        entrypoint_num_cpus: int | float | None = None,
        entrypoint_num_gpus: int | float | None = None,
        entrypoint_memory: int | None = None,
        entrypoint_resources: dict[str, float] | None = None,
    ) -> str:
        return super().submit_job(
            entrypoint=entrypoint,
            job_id=job_id,
            runtime_env=runtime_env,
            metadata=metadata,
            submission_id=submission_id,
            entrypoint_num_cpus=entrypoint_num_cpus,
            entrypoint_num_gpus=entrypoint_num_gpus,
            entrypoint_memory=entrypoint_memory,
            entrypoint_resources=entrypoint_resources,
        )


class Ray253Cluster(RayJobsCluster):
    """A RayJobsCluster whose jobs are submitted with Ray 2.53.0's client."""

    # its own type: inheriting ray-jobs-cluster would replace RayJobsCluster in Prefect's
    # registry of block types for the rest of the session
    _block_type_name = "Ray 2.53 Jobs Cluster (tests)"
    _block_type_slug = "ray253-jobs-cluster-tests"

    def backend(self) -> RayJobsBackend:
        """The block's backend, on the old client."""
        backend = super().backend()
        backend.client_class = Ray253Client
        return backend
