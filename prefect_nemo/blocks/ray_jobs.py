"""Block for a running Ray cluster reached through its Jobs API (dashboard address)."""

from __future__ import annotations

from typing import Any, Literal

from prefect.types import SecretDict
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from prefect_nemo.backends.ray_jobs import LABEL_SELECTOR_RAY, RayJobsBackend
from prefect_nemo.blocks.base import LOGOS_URL, ClusterBlock
from prefect_nemo.jobs import ENV_NAME
from prefect_nemo.redaction import Redactor


class RayJobsCluster(ClusterBlock):
    """A Ray cluster's Jobs API: where Ray jobs are submitted, with the credentials to do so."""

    _block_type_name = "Ray Jobs Cluster"
    _block_type_slug = "ray-jobs-cluster"
    _logo_url = f"{LOGOS_URL}/ray.png"  # type: ignore[assignment]
    _description = (
        "A Ray cluster reached through its Jobs API (the dashboard address), with its auth "
        "token, headers and TLS settings, the environment every job gets and the node labels "
        "its images map to, for running prefect-nemo jobs."
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
        description="Default Ray runtime_env for every job; a job's own runtime_env wins. "
        "Environment variables go in env / secret_env (an env_vars key here is read into env).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Cluster-wide environment variables (like a NeMo-Skills cluster config's "
        "env_vars), forwarded into every job's runtime_env.env_vars; a job's own env wins for "
        "the same name.",
    )
    secret_env: SecretDict | None = Field(
        default=None,
        description="Cluster-wide environment variables whose values are secrets (API keys, "
        "tokens): forwarded like env and masked in everything prefect-nemo writes (logs, "
        "events, artifacts, exceptions, job metadata, dry runs). Ray itself shows a job's "
        "env_vars to whoever can read the cluster's Jobs API.",
    )
    image_label_selectors: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Node labels per container image, as in NeMo-Skills: a glob pattern of the "
        "image (a job's runtime_env image_uri) → the labels of the nodes that run it, e.g. "
        "{'nvcr.io/nvidia/nemo-rl:*': {'nemo/workload': 'rl'}} ({'key': k, 'value': v} is "
        "read as {k: v}). They join the job's entrypoint label selector, filling only keys "
        "the job did not set (its label_selector or placement wins), and the image_uri is not "
        "sent: the job runs on those nodes as they are. Label selectors need ray >= "
        f"{LABEL_SELECTOR_RAY} on the machine that submits; with an older ray a job that gets "
        "a selector stops before it is submitted, because a job sent without its selector "
        "could land on any node (a GPU job on the CPU head), which is worse than a clear stop.",
    )
    image_label_key: str | None = Field(
        default=None,
        description="Label key set to the job's image name (made a label value, e.g. "
        "nvcr.io-nvidia-pytorch-25.02-py3) when no image_label_selectors pattern matches; "
        "empty for none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _runtime_env_vars_into_env(cls, data: Any) -> Any:
        """Older documents kept plain env vars in runtime_env['env_vars']: read them into env
        (one place for the cluster's environment)."""
        if isinstance(data, dict) and isinstance(data.get("runtime_env"), dict):
            runtime_env = dict(data["runtime_env"])
            env_vars = runtime_env.pop("env_vars", None)
            if env_vars:
                env = dict(data.get("env") or {})
                both = sorted(set(env) & set(env_vars))
                if both:
                    raise ValueError(
                        f"env and runtime_env['env_vars'] both set {', '.join(both)}: keep "
                        "them in env only"
                    )
                data = {**data, "runtime_env": runtime_env, "env": {**env_vars, **env}}
            elif env_vars is not None:
                data = {**data, "runtime_env": runtime_env}
        return data

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

    @field_validator("env")
    @classmethod
    def _env_names_ok(cls, value: dict[str, str]) -> dict[str, str]:
        _check_env_names(value)
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_env_ok(cls, value: SecretDict | None, info: ValidationInfo) -> SecretDict | None:
        if value is None:
            return None
        entries: dict[str, Any] = value.get_secret_value()
        _check_env_names(entries)
        both = sorted(set(entries) & set(info.data.get("env") or {}))
        if both:
            raise ValueError(f"{', '.join(both)} also in env: keep each variable in one of them")
        for name, secret in entries.items():
            # errors name the variable, never its value
            if not isinstance(secret, str):
                raise ValueError(f"value of '{name}' is not a string: quote it")
            if Redactor([secret])(secret) == secret:
                raise ValueError(
                    f"value of '{name}' is too short to be masked in logs without masking "
                    "ordinary text: if it is no secret, put it in env"
                )
        return value

    @field_validator("image_label_selectors", mode="before")
    @classmethod
    def _key_value_form(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {
                pattern: {labels["key"]: labels["value"]}
                if isinstance(labels, dict) and set(labels) == {"key", "value"}
                else labels
                for pattern, labels in value.items()
            }
        return value

    @field_validator("image_label_selectors")
    @classmethod
    def _image_labels_ok(cls, value: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for pattern, labels in value.items():
            if not pattern.strip():
                raise ValueError("an image pattern is empty: use a glob such as 'nvcr.io/*'")
            if not labels or not all(key.strip() for key in labels):
                raise ValueError(f"'{pattern}' maps to no label: give it {{label: value}}")
        return value

    @field_validator("image_label_key")
    @classmethod
    def _label_key_ok(cls, value: str | None) -> str | None:
        return (value or "").strip() or None

    def backend(self) -> RayJobsBackend:
        """The Ray Jobs backend for this cluster."""
        headers: dict[str, Any] = self.headers.get_secret_value() if self.headers else {}
        secret_env: dict[str, Any] = self.secret_env.get_secret_value() if self.secret_env else {}
        return RayJobsBackend(
            self.dashboard_url,
            token=self.auth_token.get_secret_value() if self.auth_token else None,
            token_header=self.token_header,
            headers={str(k): str(v) for k, v in headers.items()},
            verify=self.verify_tls,
            request_timeout_s=self.request_timeout_s,
            runtime_env=self.runtime_env,
            env=self.env,
            secret_env={str(k): str(v) for k, v in secret_env.items()},
            image_label_selectors=self.image_label_selectors,
            image_label_key=self.image_label_key,
        )


def _check_env_names(env: dict[str, Any]) -> None:
    for name in env:
        if not ENV_NAME.match(str(name)):
            raise ValueError(
                f"'{name}' is not a valid environment variable name: use letters, digits and "
                "'_', not starting with a digit"
            )
