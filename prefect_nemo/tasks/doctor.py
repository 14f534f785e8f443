"""The Prefect side of `prefect-nemo doctor`: load the saved blocks (the named ones, or every
one of prefect-nemo's types), build each one's backend, hand it to `prefect_nemo.doctor`, and
measure this machine's clock against the Prefect server's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.types import SecretDict
from pydantic import BaseModel, SecretStr, ValidationError

from prefect_nemo import doctor as checks
from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.doctor import THIS_MACHINE, Check, Status
from prefect_nemo.errors import InvalidJobSpec, PrefectNemoError
from prefect_nemo.tasks._blocks import cluster_block_types, resolve_block, saved_block_names
from prefect_nemo.tasks._run_watch import cancel_watch

EXAMPLE = "kube-ray-cluster/prod"


def doctor(blocks: Sequence[str] = (), *, clock: Callable[[], float] = time.time) -> list[Check]:
    """Every check of these saved blocks ('<block-type-slug>/<name>'; none: every saved block
    of prefect-nemo's types), after this machine's clock against the Prefect server's
    (`clock`: this machine's, in epoch seconds). A named block that cannot be loaded is bad
    input (InvalidJobSpec, before anything is checked); a saved one is a failed row."""
    named = list(blocks)
    for ref in named:  # a typo fails before minutes of checks
        with contextlib.suppress(ValidationError):  # it exists: a failed row says the rest
            resolve_block(ref, Block, "blocks", EXAMPLE, "saved block")
    rows = [prefect_clock(clock)]
    refs = named or saved_block_names([*cluster_block_types(), KubernetesCluster])
    if not refs:
        rows.append(
            Check(
                "blocks",
                Status.WARN,
                "no saved block of prefect-nemo's types to check",
                "save one (`prefect-nemo blocks apply`, the UI, or Block.save) and run again",
                THIS_MACHINE,
            )
        )
    for ref in refs:
        rows += block_checks(ref)
    return rows


def prefect_clock(clock: Callable[[], float] = time.time) -> Check:
    """This machine's clock against the Date of a Prefect API answer (its health endpoint)."""
    try:
        with get_client(sync_client=True) as client:
            sent = clock()
            response = client.request("GET", "/health")
            received = clock()
    except Exception as exc:  # any failure to reach it is the finding
        return Check(
            "clock vs Prefect",
            Status.FAIL,
            f"the Prefect API did not answer: {type(exc).__name__}: {exc}",
            "check PREFECT_API_URL (and PREFECT_API_KEY) on this machine",
            THIS_MACHINE,
        )
    return checks.clock_check(
        response.headers.get("date"), sent, received, heartbeat_s=cancel_watch.heartbeat_s
    )


def block_checks(ref: str) -> list[Check]:
    """Every check of one saved block; a block that cannot be loaded or built is a failed row
    (the backend's secrets and the block's secret fields masked in every row)."""
    try:
        block = resolve_block(ref, Block, "blocks", EXAMPLE, "saved block")
    except (InvalidJobSpec, ValidationError) as exc:  # a saved document the code outgrew
        return [
            Check(
                "load",
                Status.FAIL,
                _load_error(exc),
                "fix the block document (the UI, or `prefect-nemo blocks apply`) or delete it",
                ref,
            )
        ]
    secrets = secret_values(block)
    if isinstance(block, KubernetesCluster):
        try:
            rows = checks.cluster_checks(block.api(), block.namespace)
        except PrefectNemoError as exc:
            rows = [Check("kubernetes credentials", Status.FAIL, str(exc), "fix the block")]
        return checks.stamp(ref, rows, secrets)
    if not isinstance(block, ClusterBlock):
        return [
            Check(
                "load",
                Status.FAIL,
                f"a {type(block).__name__} is not a prefect-nemo block",
                "name a cluster or Kubernetes block",
                ref,
            )
        ]
    try:
        backend = block.backend()
    except ImportError as exc:
        return checks.stamp(
            ref,
            [
                Check(
                    "backend",
                    Status.FAIL,
                    f"{type(block).__name__} needs nemo-run here ({exc})",
                    "pip install 'prefect-nemo[nemo-run]' on this machine",
                )
            ],
            secrets,
        )
    except PrefectNemoError as exc:
        return checks.stamp(
            ref, [Check("backend", Status.FAIL, str(exc), "fix the block")], secrets
        )
    try:
        return checks.check_backend(ref, backend, secrets=secrets)
    finally:
        backend.close()


def _load_error(exc: Exception) -> str:
    """Why a block did not load, naming fields, never their values (they may be secrets)."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    return f"the saved {exc.title} document does not validate: " + "; ".join(
        f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
    )


def secret_values(value: Any) -> list[str]:
    """Every secret value a block holds (SecretStr and SecretDict fields, nested blocks
    included), to mask in what the doctor prints. Of a kubeconfig, only its users' credentials:
    the server address and names are what the rows are about."""
    if isinstance(value, SecretStr):
        return [value.get_secret_value()]
    if isinstance(value, SecretDict):
        secret = value.get_secret_value()
        if isinstance(secret, dict) and "clusters" in secret:
            return _strings([user.get("user") for user in secret.get("users") or []])
        return _strings(secret)
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        return [s for field in fields for s in secret_values(getattr(value, field))]
    if isinstance(value, list | tuple):
        return [s for item in value for s in secret_values(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in secret_values(item)]
    return []


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list | tuple):
        return [s for item in value for s in _strings(item)]
    return []
