"""DynamoGraphDeployments on the cluster: probe that the CRD is installed, apply-or-attach, tie
a DGD's lifetime to a RayCluster with a non-controller owner reference, wait until it really
serves (operator state, pod readiness and an HTTP answer from the frontend), and delete it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefect_nemo import kube
from prefect_nemo.backends.dynamo.manifests import DGD_GROUP, DGD_KIND, FRONTEND_PORT, dgd_kind
from prefect_nemo.errors import PrefectNemoError

GRAPH_LABEL = "nvidia.com/dynamo-graph-deployment-name"
FRONTEND_PROBE_PATH = "/v1/models"
STATE_READY = "successful"
STATE_FAILED = "failed"
#: Reasons that mean a DGD waits for capacity (queued), not that it fails to come up: a pod's
#: PodScheduled=False with reason Unschedulable (Kubernetes: "the scheduler cannot schedule the
#: Pod right now, for example due to lack of resources or other constraints"), or a condition
#: of the DGD with Dynamo's insufficient_capacity reason.
QUEUED_REASONS = ("Unschedulable", "insufficient_capacity")

log = logging.getLogger("prefect_nemo.dynamo")


class DgdFailed(PrefectNemoError):
    """The Dynamo operator reported the DGD as failed (its message is in ours)."""


class DgdNotReady(PrefectNemoError, TimeoutError):
    """The DGD did not pass every readiness gate in time; the message names the gates."""


class DgdQueueTimedOut(DgdNotReady):
    """The DGD waited queued for capacity past `queue_timeout_s`; the message names why."""


class DgdCrdMissing(PrefectNemoError):
    """The DynamoGraphDeployment CRD is not installed on the cluster."""


# ---------------------------------------------------------------------------------------------
# API calls


def dgd_access(version: str = "v1alpha1") -> tuple[kube.Access, ...]:
    """What deploy_dgd uses in the graphs' namespace, for RBAC: the DGDs (applied, owned by a
    RayCluster, watched, deleted), their pods (watched for readiness) and the frontend's
    Service proxy (the HTTP probe)."""
    return (
        kube.Access(dgd_kind(version), ("get", "list", "watch", "create", "patch", "delete")),
        kube.Access(kube.POD, ("list", "watch")),
        kube.Access(kube.SERVICE, ("get",), subresource="proxy"),
    )


def check_crd_installed(
    api: kube.KubeApi, version: str = "v1alpha1", namespace: str | None = None
) -> bool:
    """Raise DgdCrdMissing unless the DGD CRD serves `version`; False = unknown (no list right).

    Probes with a namespaced list of at most one DGD (cluster-scoped CRD reads need rights
    most users lack). 403 means the CRD is there but we may not list: go on, and let the apply
    report any remaining permission problem.
    """
    kind = dgd_kind(version)
    try:
        api.list(kind, namespace, limit=1)
    except kube.NotFound:
        raise DgdCrdMissing(
            f"{DGD_KIND} CRD ({DGD_GROUP}/{version}) is not installed on {api.host}: install "
            "the Dynamo platform Helm chart (dynamo-crds and dynamo-platform, see "
            "https://docs.nvidia.com/dynamo/latest/kubernetes/installation_guide.html), or "
            "pass the version your operator serves"
        ) from None
    except kube.Forbidden as exc:  # a 401 (wrong credentials) is raised as it is
        log.info(
            f"cannot list {kind.plural} in {namespace or api.namespace} ({exc}); assuming the "
            "CRD is installed and going on"
        )
        return False
    return True


def apply_dgd(
    api: kube.KubeApi, manifest: Mapping[str, Any], *, recreate: bool = False
) -> kube.Applied:
    """Create the DGD, or attach to the one already there (drift is reported, not fixed,
    unless `recreate`)."""
    return kube.apply_or_attach(
        api, dict(manifest), namespace=_namespace_of(manifest), recreate=recreate
    )


def delete_dgd(
    api: kube.KubeApi,
    name: str,
    namespace: str,
    *,
    version: str = "v1alpha1",
    wait_s: float | None = kube.GONE_TIMEOUT_S,
) -> bool:
    """Delete a DGD (its pods and Services go with it) and wait until it is gone (unless
    `wait_s` is None), as nrl-k8s does; False if it was already gone."""
    deleted = api.delete(dgd_kind(version), name, namespace)
    if wait_s is not None:
        wait_for_dgd_gone(api, name, namespace, version=version, timeout_s=wait_s)
    return deleted


def wait_for_dgd_gone(
    api: kube.KubeApi,
    name: str,
    namespace: str,
    *,
    version: str = "v1alpha1",
    timeout_s: float = kube.GONE_TIMEOUT_S,
) -> None:
    """Wait (on a watch) until the DGD no longer exists: the operator's finalizer has run and
    its pods, Services and frontend are gone with it. KubeTimeout if it stays."""
    kube.wait_gone(api, dgd_kind(version), name, namespace, timeout_s=timeout_s)


def own_by(
    api: kube.KubeApi,
    dgd_name: str,
    namespace: str,
    owner: Mapping[str, Any],
    *,
    version: str = "v1alpha1",
) -> dict[str, Any]:
    """Make `owner` (e.g. the training RayCluster) an owner of the DGD, so deleting it cascades.

    `controller: false`: the Dynamo operator is the DGD's controller; we only want GC.
    """
    return kube.add_owner_reference(
        api, dgd_kind(version), dgd_name, dict(owner), namespace, controller=False
    )


def _namespace_of(manifest: Mapping[str, Any]) -> str | None:
    meta = manifest.get("metadata") or {}
    return meta.get("namespace")


# ---------------------------------------------------------------------------------------------
# Readiness


@dataclass
class DgdReadiness:
    """One look at the three readiness gates of a DGD."""

    name: str
    namespace: str
    state: str | None = None
    message: str = ""
    pods_total: int = 0
    pods_ready: int = 0
    frontend_status: int | None = None  # HTTP status through the service proxy; 0 = refused
    exists: bool = True
    queued: str = ""  # why it waits for capacity (QUEUED_REASONS), "" when it does not
    errors: list[str] = field(default_factory=list)

    @property
    def state_ok(self) -> bool:
        """The operator reports the graph as deployed."""
        return self.state == STATE_READY

    @property
    def pods_ok(self) -> bool:
        """At least one pod, and every pod Ready."""
        return self.pods_total > 0 and self.pods_ready == self.pods_total

    @property
    def frontend_ok(self) -> bool:
        """The frontend answered HTTP (404 included: the listener is up)."""
        return self.frontend_status is not None and 0 < self.frontend_status < 500

    @property
    def ready(self) -> bool:
        """All three gates are met."""
        return self.state_ok and self.pods_ok and self.frontend_ok

    def unmet(self) -> list[str]:
        """Each gate not yet met, described for an error message."""
        gates = []
        if not self.exists:
            return [f"DGD {self.name} does not exist"]
        if self.queued:
            gates.append(f"queued for capacity ({self.queued})")
        if not self.state_ok:
            gates.append(f"status.state is {self.state or 'unset'!r}, not {STATE_READY!r}")
        if not self.pods_ok:
            gates.append(
                f"{self.pods_ready}/{self.pods_total} pods Ready"
                if self.pods_total
                else f"no pods labelled {GRAPH_LABEL}={self.name}"
            )
        if not self.frontend_ok:
            if self.frontend_status is None:
                gates.append("frontend not probed yet (waits for the gates above)")
            elif self.frontend_status == 0:
                gates.append("frontend refused the connection")
            else:
                gates.append(f"frontend answered HTTP {self.frontend_status}")
        return gates + self.errors


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """A pod is Ready by its Ready condition (or, without conditions, all containers ready)."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    containers = status.get("containerStatuses") or []
    return bool(containers) and all(c.get("ready") for c in containers)


def _failure_message(dgd: Mapping[str, Any]) -> str:
    status = dgd.get("status") or {}
    parts = [str(status["message"])] if status.get("message") else []
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True" and (cond.get("message") or cond.get("reason")):
            parts.append(
                f"{cond.get('type')}: {cond.get('reason', '')} {cond.get('message', '')}".strip()
            )
    return "; ".join(parts) or "no message from the operator"


def wait_dgd_ready(
    api: kube.KubeApi,
    name: str,
    namespace: str,
    timeout_s: float,
    *,
    version: str = "v1alpha1",
    service: str | None = None,
    port: int = FRONTEND_PORT,
    probe_interval_s: float = 1.0,
    on_change: Callable[[DgdReadiness], None] | None = None,
    interrupted: Callable[[], str | bool | None] | None = None,
    queue_timeout_s: float | None = None,
) -> DgdReadiness:
    """Wait until the DGD serves: state successful, every DGD pod Ready, frontend answers.

    The DGD and its pods are followed by watch (one Informer each); only the HTTP probe of the
    frontend (`service`:`port`, through the API server's service proxy) is polled, and only
    once the first two gates hold. Any HTTP answer below 500 counts (404: the listener is up;
    403: the proxy verb is not ours, so the other gates decide, as in the source PR); 502, 503
    and refused do not.
    State `failed` raises DgdFailed at once; the timeout (or `interrupted()`) raises DgdNotReady
    listing the gates still unmet. `on_change` sees each new combination of gate values.
    While the DGD waits for capacity (`DgdReadiness.queued`) it is queued, not slow: that time
    does not count against `timeout_s`, and `queue_timeout_s` (None: wait) bounds each such
    wait with DgdQueueTimedOut.
    """
    kind = dgd_kind(version)
    service = service or f"{name}-frontend"
    changed = threading.Event()

    def wake(*_: object) -> None:  # on every change and every watch error
        changed.set()

    dgds = kube.Informer(api, kind, namespace, on_change=wake, on_error=wake)
    pods = kube.Informer(
        api, kube.POD, namespace, label_selector=f"{GRAPH_LABEL}={name}",
        on_change=wake, on_error=wake,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    queued_since: float | None = None  # while queued, the deadline moves with the clock
    last_key: tuple[Any, ...] | None = None
    seen = DgdReadiness(name, namespace)
    dgds.start()
    pods.start()
    try:
        for informer in (dgds, pods):  # the first list; an error shows as .error meanwhile
            while not informer.synced.wait(0.1) and time.monotonic() < deadline:
                dgds.raise_rejected()  # waiting cannot heal rejected credentials
                pods.raise_rejected()
        while True:
            changed.clear()
            dgds.raise_rejected()
            pods.raise_rejected()
            seen = _look(dgds, pods, name, namespace)
            if not seen.exists:
                raise DgdFailed(
                    f"DGD {name} in {namespace} does not exist (deleted while we waited for it?)"
                )
            if seen.state == STATE_FAILED:
                raise DgdFailed(f"DGD {name} in {namespace} failed: {seen.message}")
            if seen.state_ok and seen.pods_ok:
                status, _ = api.proxy(namespace, service, port, FRONTEND_PROBE_PATH)
                seen.frontend_status = status
            now = time.monotonic()
            if seen.queued and queued_since is None:
                queued_since = now
            elif not seen.queued and queued_since is not None:
                deadline, queued_since = deadline + now - queued_since, None
            key = (
                seen.exists,
                seen.queued,
                seen.state,
                seen.pods_total,
                seen.pods_ready,
                seen.frontend_ok,
                seen.frontend_status,
            )
            if key != last_key and on_change is not None:
                on_change(seen)
            last_key = key
            if seen.ready:
                return seen
            if queued_since is not None:
                waited = now - queued_since
                if queue_timeout_s is not None and waited >= queue_timeout_s:
                    raise DgdQueueTimedOut(
                        f"DGD {name} in {namespace} waited queued for capacity {waited:.0f}s, "
                        f"past its queue_timeout_s of {queue_timeout_s:g}s: {seen.queued}"
                    )
            remaining = deadline + (now - queued_since if queued_since else 0) - time.monotonic()
            if queued_since is not None and queue_timeout_s is not None:
                remaining = min(remaining, queued_since + queue_timeout_s - now)
            if remaining <= 0 and queued_since is None:
                raise DgdNotReady(
                    f"DGD {name} in {namespace} not ready after {timeout_s:g}s: "
                    + "; ".join(seen.unmet())
                )
            if interrupted is not None and interrupted():
                raise DgdNotReady(
                    f"waiting for DGD {name} was interrupted: " + "; ".join(seen.unmet())
                )
            # Watch events wake us at once; the frontend probe needs a poll.
            pause = probe_interval_s if seen.state_ok and seen.pods_ok else 5.0
            changed.wait(max(0.05, min(pause, remaining)))
    finally:
        dgds.stop(wait_s=5.0)
        pods.stop(wait_s=5.0)


def _look(dgds: kube.Informer, pods: kube.Informer, name: str, namespace: str) -> DgdReadiness:
    seen = DgdReadiness(name, namespace)
    for informer, what in ((dgds, "DGD"), (pods, "pod")):
        if informer.error is not None:
            seen.errors.append(f"{what} watch failing: {informer.error}")
    obj = dgds.get(name)
    if obj is None:
        seen.exists = not dgds.synced.is_set()
        return seen
    status = obj.get("status") or {}
    seen.state = status.get("state")
    if seen.state == STATE_FAILED:
        seen.message = _failure_message(obj)
    items = pods.items()
    seen.pods_total = len(items)
    seen.pods_ready = sum(1 for p in items if pod_ready(p))
    if seen.state not in (STATE_READY, STATE_FAILED):
        seen.queued = queued_reason(obj, items)
    return seen


def queued_reason(dgd: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> str:
    """Why the DGD waits for capacity (a condition of it, or of one of its pods, with a reason
    in QUEUED_REASONS), or "" when nothing says so."""
    for cond in (dgd.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True" and cond.get("reason") in QUEUED_REASONS:
            return f"{cond['reason']}: {cond.get('message') or ''}".rstrip(": ")
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") in QUEUED_REASONS
            ):
                pod_name = (pod.get("metadata") or {}).get("name", "?")
                return f"pod {pod_name} {cond['reason']}: {cond.get('message') or ''}".rstrip(": ")
    return ""
