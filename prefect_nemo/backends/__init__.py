"""One module per engine, each implementing `prefect_nemo.jobs.Backend` on the engine's client."""

from prefect_nemo.backends.ray_jobs import RayJobsBackend

__all__ = ["RayJobsBackend"]
