"""What every Kubernetes job backend derives from a JobSpec the same way: checked labels, the
Secret that carries secret env values (never the job object itself), and API timestamps."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import SecretStr

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.jobs import JobSpec
from prefect_nemo.kube.apply import FLOW_RUN_LABEL, MANAGED_BY, managed_labels
from prefect_nemo.names import is_label_key

ENV_SECRET_SUFFIX = "-env"


def check_labels(labels: Mapping[str, str]) -> None:
    """Raise InvalidJobSpec for a JobSpec label key Kubernetes refuses or that we set."""
    for key in labels:
        if not is_label_key(key):
            raise InvalidJobSpec(
                f"JobSpec.labels: '{key}' is not a Kubernetes label key: use [prefix/]name, name "
                "at most 63 letters, digits, '-', '_', '.', starting and ending alphanumeric"
            )
        if key in (MANAGED_BY, FLOW_RUN_LABEL):
            raise InvalidJobSpec(f"JobSpec.labels: '{key}' is set by prefect-nemo: pick another")


def secret_name(job_id: str) -> str:
    """The Secret holding a job's secret env values (owned by the job's object)."""
    return f"{job_id}{ENV_SECRET_SUFFIX}"


def secret_manifest(
    spec: JobSpec, job_id: str, *, namespace: str, flow_run_id: str | None
) -> dict[str, Any] | None:
    """The Secret with the job's secret env values, or None when it has none."""
    secrets = {k: v.get_secret_value() for k, v in spec.env.items() if isinstance(v, SecretStr)}
    if not secrets:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(job_id),
            "namespace": namespace,
            "labels": managed_labels(flow_run_id),
        },
        "type": "Opaque",
        "stringData": secrets,
    }


def parse_time(value: Any) -> datetime | None:
    """An API timestamp ("2026-11-21T16:00:00Z"), or None when absent or malformed."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
