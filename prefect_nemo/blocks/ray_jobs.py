"""Block for a running Ray cluster reached through its Jobs API (dashboard address)."""

from __future__ import annotations

from typing import Any, Literal

from prefect.types import SecretDict
from pydantic import Field, SecretStr, field_validator

from prefect_nemo.backends.ray_jobs import RayJobsBackend
from prefect_nemo.blocks.base import ClusterBlock


class RayJobsCluster(ClusterBlock):
    """A Ray cluster's Jobs API: where Ray jobs are submitted, with the credentials to do so."""

    _block_type_name = "Ray Jobs Cluster"
    _block_type_slug = "ray-jobs-cluster"
    _logo_url = "https://docs.ray.io/en/latest/_static/favicon.ico"  # type: ignore[assignment]
    _description = (
        "A Ray cluster reached through its Jobs API (the dashboard address), with its auth "
        "token, headers and TLS settings, for running prefect-nemo jobs."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks import RayJobsCluster

cluster = RayJobsCluster.load("BLOCK_NAME")

@flow
def train():
    run_job(JobSpec(entrypoint="python train.py", working_dir="."), cluster=cluster)
```
"""

    dashboard_url: str = Field(
        description="Address of the Ray dashboard / Jobs API, e.g. http://ray-head:8265.",
    )
    auth_token: SecretStr | None = Field(
        default=None,
        description="Ray auth token (Ray >= 2.59 enables token auth by default; "
        "`ray get-auth-token` prints it).",
    )
    token_header: Literal["Authorization", "X-Ray-Authorization"] = Field(
        default="Authorization",
        description="Header that carries the token; X-Ray-Authorization behind a proxy that "
        "uses Authorization itself.",
    )
    headers: SecretDict | None = Field(
        default=None,
        description="Extra HTTP headers for every request (e.g. a proxy's credentials).",
    )
    verify_tls: bool | str = Field(
        default=True,
        description="Verify the dashboard's TLS certificate: true, false, or a CA bundle path.",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="Timeout of each HTTP request to the dashboard, seconds."
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Default Ray runtime_env for every job; a job's own runtime_env wins.",
    )

    @field_validator("dashboard_url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"'{value}' is not an http(s) URL: use the dashboard address, e.g. "
                "http://127.0.0.1:8265 (not a ray:// or GCS address)"
            )
        return value.rstrip("/")

    @field_validator("auth_token")
    @classmethod
    def _token_ok(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            return None
        return value

    def backend(self) -> RayJobsBackend:
        """The Ray Jobs backend for this cluster."""
        headers: dict[str, Any] = self.headers.get_secret_value() if self.headers else {}
        return RayJobsBackend(
            self.dashboard_url,
            token=self.auth_token.get_secret_value() if self.auth_token else None,
            token_header=self.token_header,
            headers={str(k): str(v) for k, v in headers.items()},
            verify=self.verify_tls,
            request_timeout_s=self.request_timeout_s,
            runtime_env=self.runtime_env,
        )
