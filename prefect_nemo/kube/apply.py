"""Create-or-attach for Kubernetes objects, with drift detection, plus labels and owner refs."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.kube.api import AlreadyExists, Conflict, KubeApi, NotFound
from prefect_nemo.kube.kinds import Kind, kind_for
from prefect_nemo.names import stable_hash

log = logging.getLogger(__name__)

MANAGED_BY = "app.kubernetes.io/managed-by"
FLOW_RUN_LABEL = "prefect.io/flow-run-id"
SPEC_HASH = "prefect-nemo.io/spec-hash"
LAST_USED = "prefect-nemo.io/last-used"  # when a shared object was last taken for a job
GONE_TIMEOUT_S = 300.0  # how long we wait for an object being deleted to go (nrl-k8s: 300 s)
OWNER_PATCH_ATTEMPTS = 5  # client-go's retry.DefaultRetry: 5 tries, 10 ms apart
OWNER_PATCH_PAUSE_S = 0.01

Outcome = Literal["created", "attached", "drifted", "recreated"]


@dataclass(frozen=True)
class Applied:
    """What apply_or_attach did: the object as the server has it, and how we got there."""

    obj: dict[str, Any]
    outcome: Outcome
    drift: str | None = None

    @property
    def created(self) -> bool:
        """True when this call brought the object up (so the caller owns its teardown)."""
        return self.outcome in ("created", "recreated")


def managed_labels(flow_run_id: str | None = None) -> dict[str, str]:
    """Labels on every object we create, so a sweeper can find them."""
    labels = {MANAGED_BY: "prefect-nemo"}
    if flow_run_id:
        labels[FLOW_RUN_LABEL] = flow_run_id
    return labels


def spec_hash(manifest: dict[str, Any]) -> str:
    """Fingerprint of what we ask for: everything but status and server-owned metadata."""
    meta = manifest.get("metadata", {})
    wanted = {
        "spec": {k: v for k, v in manifest.items() if k not in ("metadata", "status")},
        "labels": meta.get("labels", {}),
        "annotations": {
            k: v for k, v in meta.get("annotations", {}).items() if k not in (SPEC_HASH, LAST_USED)
        },
    }
    return stable_hash(json.dumps(wanted, sort_keys=True, default=str), length=16)


def apply_or_attach(
    api: KubeApi,
    manifest: dict[str, Any],
    *,
    namespace: str | None = None,
    recreate: bool = False,
    gone_timeout_s: float = GONE_TIMEOUT_S,
) -> Applied:
    """Create the object, or attach to the one that already has its name.

    An existing object created from the same manifest is reused as is. One from a different
    manifest is reused with a warning (drift) unless `recreate`, which deletes it (foreground:
    its dependents go first), waits until it is gone and creates it anew. One being deleted
    (`metadata.deletionTimestamp` set) is never attached to: we wait until it is gone (up to
    `gone_timeout_s`), then create. Never mutates a live object in place.
    """
    kind = kind_for(manifest)
    name = manifest["metadata"]["name"]
    wanted = spec_hash(manifest)
    stamped = {
        **manifest,
        "metadata": {
            **manifest["metadata"],
            "annotations": {**manifest["metadata"].get("annotations", {}), SPEC_HASH: wanted},
        },
    }
    try:
        return Applied(api.create(kind, stamped, namespace), "created")
    except AlreadyExists:
        existing = api.get(kind, name, namespace)
    what = kind.describe(name, api._ns(kind, namespace, manifest))
    if existing is not None and existing.get("metadata", {}).get("deletionTimestamp"):
        # it is going away with whatever it serves: attaching would hand back a corpse
        log.info("%s is being deleted; waiting until it is gone, then creating it", what)
        wait_gone(api, kind, name, namespace, timeout_s=gone_timeout_s)
        existing = None
    if existing is None:  # deleted between our create and get (or waited out): create
        return Applied(api.create(kind, stamped, namespace), "created")
    seen = existing.get("metadata", {}).get("annotations", {}).get(SPEC_HASH)
    if seen == wanted:
        return Applied(existing, "attached")
    drift = (
        f"{what} exists with a different spec (hash {seen or 'none'}, wanted {wanted})"
        if seen
        else f"{what} exists and was not created by prefect-nemo"
    )
    if not recreate:
        log.warning("%s; reusing it as is (pass recreate=True to replace it)", drift)
        return Applied(existing, "drifted", drift)
    log.warning("%s; recreating it", drift)
    api.delete(kind, name, namespace, propagation="Foreground")
    wait_gone(api, kind, name, namespace, timeout_s=gone_timeout_s)
    return Applied(api.create(kind, stamped, namespace), "recreated", drift)


def wait_gone(
    api: KubeApi, kind: Kind, name: str, namespace: str | None, *, timeout_s: float
) -> None:
    """Wait (on a watch) until the object no longer exists; KubeTimeout naming it if it stays
    (a finalizer nobody removes)."""
    from prefect_nemo.kube.watch import wait_for  # watch imports apply's siblings only

    what = f"deletion of {kind.describe(name, api._ns(kind, namespace))}"
    wait_for(
        api, kind, name, lambda obj: obj is None, namespace=namespace, timeout_s=timeout_s,
        what=what,
    )  # fmt: skip


def check_same_namespace(
    kind: Kind, name: str, namespace: str | None, owner: dict[str, Any]
) -> None:
    """Raise InvalidJobSpec, naming both namespaces, when a namespaced `owner` is not in the
    dependent's namespace ("A namespaced owner must exist in the same namespace as the
    dependent. If it does not, the owner reference is treated as absent": Kubernetes)."""
    owner_ns = (owner.get("metadata") or {}).get("namespace")
    if not owner_ns or not kind.namespaced or owner_ns == namespace:
        return
    raise InvalidJobSpec(
        f"{owner.get('kind')} {owner['metadata'].get('name')} (namespace {owner_ns!r}) cannot "
        f"own {kind.describe(name)} (namespace {namespace!r}): Kubernetes garbage collection "
        "treats an owner in another namespace as absent and would delete it at once. Put both "
        "in one namespace"
    )


def owner_reference(
    owner: dict[str, Any], *, controller: bool = False, block_owner_deletion: bool = False
) -> dict[str, Any]:
    """An ownerReference to `owner` (as the server returned it: it needs the uid)."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": controller,
        "blockOwnerDeletion": block_owner_deletion,
    }


def add_owner_reference(
    api: KubeApi,
    kind: Kind,
    name: str,
    owner: dict[str, Any],
    namespace: str | None = None,
    *,
    controller: bool = False,
) -> dict[str, Any]:
    """Make `owner` an owner of the object (idempotent by owner uid), so deleting the owner
    garbage-collects it. A merge patch replaces the whole list, so the existing refs are kept.

    A namespaced owner must be in the object's namespace: Kubernetes treats an owner in
    another namespace as absent and deletes the object (InvalidJobSpec, nothing patched)."""
    check_same_namespace(kind, name, api._ns(kind, namespace), owner)
    ref = owner_reference(owner, controller=controller)
    for attempt in range(OWNER_PATCH_ATTEMPTS):
        current = api.get(kind, name, namespace)
        if current is None:
            raise NotFound(404, "NotFound", f"{kind.describe(name)} not found")
        refs = current.get("metadata", {}).get("ownerReferences") or []
        if any(r.get("uid") == owner["metadata"]["uid"] for r in refs):
            return current
        # the resourceVersion makes a concurrent change a Conflict, not a lost ref; an operator
        # writing the object's status in between is normal, so read again and retry
        rv = current["metadata"]["resourceVersion"]
        patch = {"metadata": {"ownerReferences": [*refs, ref], "resourceVersion": rv}}
        try:
            return api.patch(kind, name, patch, namespace)
        except Conflict:
            if attempt == OWNER_PATCH_ATTEMPTS - 1:
                raise
            log.debug("%s changed while adding an owner; reading it again", kind.describe(name))
            time.sleep(OWNER_PATCH_PAUSE_S)
    raise AssertionError("unreachable")
