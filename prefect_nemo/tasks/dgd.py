"""The Prefect side of Dynamo inference graphs: deploy_dgd, wait_dgd_ready,
own_dgds_by_raycluster and teardown_dgds.

Each DGD a flow run brings up is recorded for that run, so that teardown deletes exactly what
the run created and never a DGD it only attached to. Whenever the run ends another way than
its own teardown (failure, crash, cancellation by a runner or through the API), the run
context's teardown (flow hooks plus the one cancel watch) deletes the run's DGDs; the
readiness wait is watched for cancellation too, so a cancelled run stops waiting at once. Logs
go to the run logger, every DGD gets a row in the run's DGD table artifact, and
`prefect-nemo.dgd.<what>` events are emitted for ready, failed and deleted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from prefect_nemo import kube
from prefect_nemo.backends import dynamo
from prefect_nemo.names import label_value
from prefect_nemo.redaction import Redactor
from prefect_nemo.tasks._blocks import KubeLike, resolve_kube
from prefect_nemo.tasks._live import fallback_logger, live_work
from prefect_nemo.tasks._run import RunContext, current_run
from prefect_nemo.tasks.artifacts import RunTable
from prefect_nemo.tasks.reporting import emit

EVENT_PREFIX = "prefect-nemo.dgd"
EXPERIMENT_LABEL = "prefect-nemo.io/experiment"


class DeployedDgd(BaseModel):
    """A DGD as deploy_dgd left it: where it is, how we got it, and where its frontend is."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str
    version: str = "v1alpha1"
    outcome: str = Field(description="created, recreated, attached or drifted")
    created_by_this_run: bool = Field(
        description="True when this flow run brought it up (so its teardown deletes it)."
    )
    frontend_service: str
    frontend_url: str
    frontend_port: int = Field(
        default=dynamo.FRONTEND_PORT, description="The port the frontend serves on (probed)."
    )
    drift: str | None = None

    @property
    def resource_id(self) -> str:
        """The Prefect event resource id of this DGD."""
        return f"{EVENT_PREFIX}.{self.namespace}.{self.name}"


# ---------------------------------------------------------------------------------------------
# What each flow run created (for teardown and hooks)


@dataclass
class _Owned:
    api: kube.KubeApi
    dgd: DeployedDgd


class _RunDgds:
    """DGDs created by each flow run in this process and not yet deleted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, dict[tuple[str, str], _Owned]] = {}

    def add(self, run: str, owned: _Owned) -> None:
        with self._lock:
            self._by_run.setdefault(run, {})[(owned.dgd.namespace, owned.dgd.name)] = owned

    def get(self, run: str) -> list[_Owned]:
        with self._lock:
            return list(self._by_run.get(run, {}).values())

    def take(self, run: str, only: set[tuple[str, str]] | None = None) -> list[_Owned]:
        with self._lock:
            mine = self._by_run.get(run, {})
            keys = [k for k in mine if only is None or k in only]
            return [mine.pop(k) for k in keys]


run_dgds = _RunDgds()


def _teardown_key(run: str) -> str:
    return f"DGDs of {run}"


def _teardown_run_quietly(run: str) -> str:
    """What the run's teardown calls when the run is cancelled, crashes or fails."""
    deleted = _delete_owned(run, "flow run ended", fallback_logger())
    return f"deleted DGD(s) {', '.join(deleted)}" if deleted else "no DGD left to delete"


def _delete_owned(
    run: str, why: str, logger: Any, only: set[tuple[str, str]] | None = None
) -> list[str]:
    owned = run_dgds.take(run, only)
    if not run_dgds.get(run):
        live_work.discard(run, _teardown_key(run))
    if owned:
        logger.warning(f"{why}: deleting {len(owned)} DGD(s) this run created")
    deleted = []
    for item in owned:
        dgd = item.dgd
        try:
            gone = dynamo.delete_dgd(item.api, dgd.name, dgd.namespace, version=dgd.version)
        except Exception as exc:
            logger.error(Redactor(item.api.secrets)(f"could not delete DGD {dgd.name}: {exc}"))
            continue
        deleted.append(dgd.name)
        logger.info(
            f"deleted DGD {dgd.namespace}/{dgd.name}"
            if gone
            else f"DGD {dgd.namespace}/{dgd.name} was already gone"
        )
        _emit("deleted", dgd, {"already_gone": not gone})
        _row(run, dgd, state="deleted")
    return deleted


# ---------------------------------------------------------------------------------------------
# Reporting: the run's DGD table, events


_table = RunTable("Dynamo inference graphs of this flow run (prefect-nemo).")


def _row(run: str | None, dgd: DeployedDgd, **fields: Any) -> None:
    _table.update(
        run,
        {f"{dgd.namespace}/{dgd.name}": fields},
        defaults=lambda: {
            "name": dgd.name,
            "namespace": dgd.namespace,
            "outcome": dgd.outcome,
            "state": "",
            "queue": "",  # why it waited for capacity, if it did
            "frontend_url": dgd.frontend_url,
        },
    )


def dgd_rows(flow_run_id: str) -> list[dict[str, Any]]:
    """The DGD table rows recorded in this process for a flow run (for summaries and tests)."""
    return _table.rows(flow_run_id)


def _emit(what: str, dgd: DeployedDgd, payload: dict[str, Any] | None = None) -> None:
    emit(
        f"{EVENT_PREFIX}.{what}",
        {
            "prefect.resource.id": dgd.resource_id,
            "prefect.resource.name": dgd.name,
            "prefect-nemo.namespace": dgd.namespace,
        },
        {
            "name": dgd.name,
            "namespace": dgd.namespace,
            "frontend_url": dgd.frontend_url,
            **(payload or {}),
        },
    )


# ---------------------------------------------------------------------------------------------
# Rendering (no API call; also what dry runs show)


def render_dgd(
    manifest: str | Mapping[str, Any],
    *,
    namespace: str,
    name: str | None = None,
    pick: str | None = None,
    labels: Mapping[str, str] | None = None,
    image: str | None = None,
    image_pull_secrets: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
    version: str = "v1alpha1",
    flow_run_id: str | None = None,
    experiment: str | None = None,
) -> dict[str, Any]:
    """The DGD manifest deploy_dgd would apply, from a file path or a manifest mapping.

    `pick` chooses a DGD by name in a file that holds several.
    """
    doc = dynamo.load_dgd(manifest, name=pick) if isinstance(manifest, str) else manifest
    extra = {**dict(labels or {})}
    if experiment:
        extra[EXPERIMENT_LABEL] = label_value(experiment)
    return dynamo.render_dgd(
        doc,
        namespace=namespace,
        name=name,
        labels=extra,
        flow_run_id=flow_run_id,
        image=image,
        image_pull_secrets=image_pull_secrets,
        overrides=overrides,
        version=version,
    )


def deployed_from(
    doc: Mapping[str, Any],
    version: str,
    *,
    outcome: str = "rendered",
    created: bool = False,
    frontend_url: str | None = None,
    frontend_port: int = dynamo.FRONTEND_PORT,
    drift: str | None = None,
) -> DeployedDgd:
    """A DeployedDgd describing a rendered manifest (InvalidJobSpec for a frontend URL or port
    that disagrees with it)."""
    meta = doc["metadata"]
    return DeployedDgd(
        name=meta["name"],
        namespace=meta["namespace"],
        version=version,
        outcome=outcome,
        created_by_this_run=created,
        frontend_service=dynamo.frontend_service(doc, version),
        frontend_url=dynamo.resolve_frontend_url(doc, frontend_url, version, port=frontend_port),
        frontend_port=frontend_port,
        drift=drift,
    )


# ---------------------------------------------------------------------------------------------
# The tasks


@task(name="deploy_dgd", cache_policy=NO_CACHE)
def deploy_dgd(
    manifest: str | dict[str, Any],
    kube_block: KubeLike,
    *,
    name: str | None = None,
    pick: str | None = None,
    namespace: str | None = None,
    labels: dict[str, str] | None = None,
    image: str | None = None,
    image_pull_secrets: Sequence[str] = (),
    overrides: dict[str, Any] | None = None,
    version: str = "v1alpha1",
    frontend_url: str | None = None,
    frontend_port: int = dynamo.FRONTEND_PORT,
    recreate: bool = False,
    dry_run: bool = False,
) -> DeployedDgd | dict[str, Any]:
    """Render, check the CRD, and create the DGD (or attach to the one already there).

    Everything is validated before the first API call. A DGD this flow run creates is recorded
    so that teardown_dgds (and the flow's failure/crash/cancel hooks) delete it; one it only
    attached to is left alone. A DGD being deleted is waited out, then created anew.
    `frontend_port`: where the frontend serves (Dynamo's default 8000; the readiness probe and
    the URL use it). `dry_run`: return the manifest that would be applied (without any owner
    reference: that is added once training's RayCluster exists), secrets masked; nothing is
    sent.
    """
    ctx = current_run()
    block = resolve_kube(kube_block)
    api = block.api()
    ns = namespace or api.namespace
    doc = render_dgd(
        manifest,
        namespace=ns,
        name=name,
        pick=pick,
        labels=labels,
        image=image,
        image_pull_secrets=image_pull_secrets,
        overrides=overrides,
        version=version,
        flow_run_id=ctx.flow_run_id,
        experiment=ctx.experiment,
    )
    # validates the URL and the port
    described = deployed_from(doc, version, frontend_url=frontend_url, frontend_port=frontend_port)
    redact = Redactor(api.secrets)
    if dry_run:
        text = yaml.safe_dump(doc, sort_keys=False)
        ctx.logger.info(f"dry run: DGD {ns}/{described.name} would be applied:\n{text}")
        redacted: dict[str, Any] = redact.deep(doc)
        return redacted
    dynamo.check_crd_installed(api, version, ns)
    existing = api.get(dynamo.dgd_kind(version), described.name, ns)
    if existing is not None:
        _keep_creator_label(doc, existing, ctx)
    applied = dynamo.apply_dgd(api, doc, recreate=recreate)
    creator = (applied.obj.get("metadata", {}).get("labels") or {}).get(kube.FLOW_RUN_LABEL)
    mine = applied.created or (ctx.flow_run_id is not None and creator == ctx.flow_run_id)
    dgd = described.model_copy(
        update={"outcome": applied.outcome, "created_by_this_run": mine, "drift": applied.drift}
    )
    if mine and ctx.flow_run_id is not None:
        run_dgds.add(ctx.flow_run_id, _Owned(api, dgd))
        # deleted with the run if it is cancelled (runner or API), crashes or fails
        ctx.track(_teardown_key(ctx.flow_run_id), partial(_teardown_run_quietly, ctx.flow_run_id))
    verb = {"created": "created", "recreated": "recreated"}.get(applied.outcome, "attached to")
    ctx.logger.info(f"{verb} DGD {ns}/{dgd.name}; frontend {dgd.frontend_url}")
    if applied.drift:
        ctx.logger.warning(redact(f"{applied.drift}: reusing it as is (recreate=True replaces it)"))
    if not mine:
        ctx.logger.info(
            f"DGD {dgd.name} was not created by this flow run: it is left running when the run ends"
        )
    _row(ctx.flow_run_id, dgd, state=(applied.obj.get("status") or {}).get("state", ""))
    return dgd


def _keep_creator_label(doc: dict[str, Any], existing: Mapping[str, Any], ctx: RunContext) -> None:
    """Attach to a DGD an earlier run of the same experiment created as if we had created it:
    the flow-run label is the only difference, and it must not read as drift."""
    labels = (existing.get("metadata") or {}).get("labels") or {}
    ours = doc["metadata"]["labels"]
    creator = labels.get(kube.FLOW_RUN_LABEL)
    if creator and ctx.experiment and labels.get(EXPERIMENT_LABEL) == ours.get(EXPERIMENT_LABEL):
        ours[kube.FLOW_RUN_LABEL] = creator


@task(name="wait_dgd_ready", cache_policy=NO_CACHE)
def wait_dgd_ready(
    dgd: DeployedDgd,
    kube_block: KubeLike,
    *,
    timeout_s: float = 1800.0,
    queue_timeout_s: float | None = None,
) -> DeployedDgd:
    """Wait until the DGD serves (state successful, all its pods Ready, the frontend answers
    HTTP through the service proxy). Raises DgdFailed at once if the operator reports failure
    and DgdNotReady (naming the unmet gates) on timeout or cancellation. A DGD waiting for
    capacity (Unschedulable pods, insufficient_capacity) is QUEUED, with the reason: that wait
    does not count against `timeout_s`; `queue_timeout_s` (None: wait) bounds it
    (DgdQueueTimedOut)."""
    ctx = current_run()
    api = resolve_kube(kube_block).api()
    redact = Redactor(api.secrets)

    queued: list[str] = []  # the last queue reason reported ("" once admitted)

    def changed(seen: dynamo.DgdReadiness) -> None:
        if seen.queued:
            if queued[-1:] != [seen.queued]:
                ctx.logger.info(f"DGD {dgd.name} is QUEUED: {seen.queued}")
                _emit("queued", dgd, {"reason": seen.queued[:300]})
            queued.append(seen.queued)
            _row(ctx.flow_run_id, dgd, state="queued", queue=seen.queued[:200])
            return
        if queued and queued[-1]:
            _emit("admitted", dgd)
            queued.append("")
        front = "-" if seen.frontend_status is None else str(seen.frontend_status or "refused")
        ctx.logger.info(
            f"DGD {dgd.name}: state={seen.state or 'unset'} pods "
            f"{seen.pods_ready}/{seen.pods_total} Ready, frontend HTTP {front}"
        )
        _row(ctx.flow_run_id, dgd, state=seen.state or "")

    start = time.monotonic()
    try:
        with ctx.cancellation_watched():
            dynamo.wait_dgd_ready(
                api,
                dgd.name,
                dgd.namespace,
                timeout_s,
                version=dgd.version,
                service=dgd.frontend_service,
                port=dgd.frontend_port,
                on_change=changed,
                interrupted=ctx.interrupted,
                queue_timeout_s=queue_timeout_s,
            )
    except Exception as exc:
        if isinstance(exc, dynamo.DgdFailed) and ctx.interrupted(ask_now=True):
            # the run's teardown deleted it: report the cancellation, not a vanished DGD
            exc = dynamo.DgdNotReady(
                f"waiting for DGD {dgd.name} was interrupted: the flow run is being cancelled"
            )
        message = redact(str(exc))
        ctx.logger.error(message)
        _emit("failed", dgd, {"message": message[:300]})
        state = "failed" if isinstance(exc, dynamo.DgdFailed) else "not ready"
        if isinstance(exc, dynamo.DgdQueueTimedOut):
            state = "queue timed out"
        _row(ctx.flow_run_id, dgd, state=state)
        raise exc from None
    took = round(time.monotonic() - start, 2)
    ctx.logger.info(f"DGD {dgd.name} is ready ({took}s): {dgd.frontend_url}")
    _emit("ready", dgd, {"seconds": took})
    _row(ctx.flow_run_id, dgd, state="ready")
    return dgd


@task(name="own_dgds_by_raycluster", cache_policy=NO_CACHE)
def own_dgds_by_raycluster(
    dgds: Sequence[DeployedDgd],
    kube_block: KubeLike,
    ray_cluster_name: str,
    namespace: str | None = None,
    *,
    rayjob_name: str | None = None,
    wait_s: float = 120.0,
) -> list[str]:
    """Make the training RayCluster an owner (controller=false) of each DGD this run created,
    so deleting the RayCluster garbage-collects them. DGDs we only attached to are left alone.

    KubeRay names the cluster in the RayJob's status before it creates it: wait (on a watch)
    for it to exist. If the RayJob `rayjob_name` has already finished and its cluster is gone,
    there is nothing to own. Returns the names patched.
    """
    ctx = current_run()
    api = resolve_kube(kube_block).api()
    ns = namespace or api.namespace
    for dgd in dgds:  # before any request: an owner elsewhere would get the DGD deleted
        if dgd.created_by_this_run:
            kube.check_same_namespace(
                dynamo.dgd_kind(dgd.version), dgd.name, dgd.namespace,
                {"kind": "RayCluster", "metadata": {"name": ray_cluster_name, "namespace": ns}},
            )  # fmt: skip
    owner = api.get(kube.RAY_CLUSTER, ray_cluster_name, ns)
    if owner is None and rayjob_name is not None:
        rayjob = api.get(kube.RAY_JOB, rayjob_name, ns) or {}
        if (rayjob.get("status") or {}).get("jobDeploymentStatus") in ("Complete", "Failed"):
            ctx.logger.info(
                f"RayJob {rayjob_name} already ended and its RayCluster is gone: "
                "no owner reference to add"
            )
            return []
    if owner is None:
        owner = kube.wait_for(
            api,
            kube.RAY_CLUSTER,
            ray_cluster_name,
            lambda o: o is not None,
            namespace=ns,
            timeout_s=wait_s,
            what=f"RayCluster {ray_cluster_name} to exist",
        )
    assert owner is not None
    patched = []
    for dgd in dgds:
        if not dgd.created_by_this_run:
            continue
        dynamo.own_by(api, dgd.name, dgd.namespace, owner, version=dgd.version)
        patched.append(dgd.name)
        ctx.logger.info(
            f"DGD {dgd.name} is now owned by RayCluster {ray_cluster_name}: it goes "
            "when the RayCluster goes"
        )
        _row(ctx.flow_run_id, dgd, owner=f"RayCluster/{ray_cluster_name}")
    return patched


@task(name="teardown_dgds", cache_policy=NO_CACHE)
def teardown_dgds(dgds: Sequence[DeployedDgd] | None = None) -> list[str]:
    """Delete the DGDs this flow run created (all of them, or those of `dgds` it created).
    DGDs it attached to are never deleted. Returns the names deleted."""
    ctx = current_run()
    if ctx.flow_run_id is None:
        return []
    only = None if dgds is None else {(d.namespace, d.name) for d in dgds}
    return _delete_owned(ctx.flow_run_id, "teardown", ctx.logger, only)


def teardown_now(flow_run_id: str | None, why: str) -> list[str]:
    """Delete this run's DGDs outside any task (while the flow is being torn down)."""
    if flow_run_id is None:
        return []
    return _delete_owned(flow_run_id, why, fallback_logger())


__all__ = [
    "DeployedDgd",
    "deploy_dgd",
    "dgd_rows",
    "own_dgds_by_raycluster",
    "render_dgd",
    "resolve_kube",
    "teardown_dgds",
    "teardown_now",
    "wait_dgd_ready",
]
