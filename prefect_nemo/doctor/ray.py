"""The Ray checks of `prefect-nemo doctor`, on the backend's own JobSubmissionClient: the
dashboard answers with our credentials, and the Ray versions here and on the cluster, with
what they mean for entrypoint label selectors (ray >= 2.54.0 on both sides). No Prefect."""

from __future__ import annotations

from typing import Any

import ray
from packaging.version import InvalidVersion, Version

from prefect_nemo.backends.ray_jobs import LABEL_SELECTOR_RAY
from prefect_nemo.doctor.checks import Check, Status, ok
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable

UPGRADE_HERE = f"pip install -U 'ray[default]>={LABEL_SELECTOR_RAY}'"


def ray_checks(
    backend: Any,
    *,
    token_field: str = "RayJobsCluster.auth_token",
    address_fix: str = "check RayJobsCluster.dashboard_url (http(s)://<head>:8265) and that the "
    "cluster is up and reachable from this machine",
) -> list[Check]:
    """The dashboard row, then (when it answers) the versions row."""
    name = "ray dashboard"
    try:
        backend.check_access()  # the client's version request checks the token too
        server = backend.cluster_ray_version()
    except AuthenticationFailed as exc:
        return [
            Check(
                name,
                Status.FAIL,
                str(exc),
                f"set {token_field} to the cluster's token (`ray get-auth-token` on the "
                "head prints it)",
            )
        ]
    except BackendUnavailable as exc:
        return [Check(name, Status.FAIL, str(exc), address_fix)]
    except (RuntimeError, ValueError) as exc:  # Ray's client: an unexpected answer
        return [Check(name, Status.FAIL, f"{backend.address}: {exc}", address_fix)]
    return [ok(name, f"Ray {server} answers at {backend.address}"), _versions(backend, server)]


def _versions(backend: Any, server: str) -> Check:
    """Ray here and on the cluster; label selectors need both at LABEL_SELECTOR_RAY or later.
    Jobs without a selector run either way, so an old Ray is a warning, unless the block
    itself gives jobs selectors (image_label_selectors): then its jobs cannot run."""
    name, here = "ray versions", ray.__version__
    client = f"{backend.client_class.__name__} of ray {here}"
    gaps, fixes = [], []
    if not backend.sends_label_selectors():
        gaps.append(f"the Ray client here ({client}) cannot send entrypoint_label_selector")
        fixes.append(f"upgrade ray on this machine to >= {LABEL_SELECTOR_RAY} ({UPGRADE_HERE})")
    if _older(server, LABEL_SELECTOR_RAY):
        gaps.append(f"the cluster's Ray {server} does not take entrypoint label selectors")
        fixes.append(f"upgrade Ray on the cluster to >= {LABEL_SELECTOR_RAY}")
    if gaps:
        source = "JobSpec.label_selector, placement node_labels or exclude_head"
        if backend.selects_by_image:
            source += ", and the block's own image_label_selectors / image_label_key"
        return Check(
            name,
            Status.FAIL if backend.selects_by_image else Status.WARN,
            f"ray {here} here, {server} on the cluster: label selectors are not supported "
            f"({'; '.join(gaps)}); a job that gets one ({source}) stops before it is sent",
            "; ".join(fixes),
        )
    if _minor(here) != _minor(server):
        return Check(
            name,
            Status.WARN,
            f"ray {here} here, {server} on the cluster; label selectors supported. The Jobs "
            "API works across releases, but the code a job ships is packed by this Ray",
            f"install the cluster's release here: pip install 'ray[default]=={server}'",
        )
    return ok(name, f"ray {here} here, {server} on the cluster; label selectors supported")


def _older(version: str, than: str) -> bool:
    try:
        return Version(version) < Version(than)
    except InvalidVersion:
        return False  # a dev build: it says nothing of its features


def _minor(version: str) -> tuple[int, ...]:
    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return ()
