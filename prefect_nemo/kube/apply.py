"""Create-or-attach for Kubernetes objects, with drift detection, plus labels and owner refs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from prefect_nemo.kube.api import AlreadyExists, KubeApi, NotFound
from prefect_nemo.kube.kinds import Kind, kind_for
from prefect_nemo.names import stable_hash

log = logging.getLogger(__name__)

MANAGED_BY = "app.kubernetes.io/managed-by"
FLOW_RUN_LABEL = "prefect.io/flow-run-id"
SPEC_HASH = "prefect-nemo.io/spec-hash"

Outcome = Literal["created", "attached", "drifted", "recreated"]


@dataclass(frozen=True)
class Applied:
    """What apply_or_attach did: the object as the server has it, and how we got there."""

    obj: dict
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


def spec_hash(manifest: dict) -> str:
    """Fingerprint of what we ask for: everything but status and server-owned metadata."""
    meta = manifest.get("metadata", {})
    wanted = {
        "spec": {k: v for k, v in manifest.items() if k not in ("metadata", "status")},
        "labels": meta.get("labels", {}),
        "annotations": {k: v for k, v in meta.get("annotations", {}).items() if k != SPEC_HASH},
    }
    return stable_hash(json.dumps(wanted, sort_keys=True, default=str), length=16)


def apply_or_attach(
    api: KubeApi, manifest: dict, *, namespace: str | None = None, recreate: bool = False
) -> Applied:
    """Create the object, or attach to the one that already has its name.

    An existing object created from the same manifest is reused as is. One from a different
    manifest is reused with a warning (drift) unless `recreate`, which deletes it (foreground:
    its dependents go first), waits until it is gone and creates it anew. Never mutates a live
    object in place.
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
    if existing is None:  # deleted between our create and get: one more try
        return Applied(api.create(kind, stamped, namespace), "created")
    seen = existing.get("metadata", {}).get("annotations", {}).get(SPEC_HASH)
    if seen == wanted:
        return Applied(existing, "attached")
    what = kind.describe(name, api._ns(kind, namespace, manifest))
    drift = (
        f"{what} exists with a different spec (hash {seen or 'none'}, wanted {wanted})"
        if seen
        else f"{what} exists and was not created by prefect-nemo"
    )
    if not recreate:
        log.warning("%s; reusing it as is (pass recreate=True to replace it)", drift)
        return Applied(existing, "drifted", drift)
    log.warning("%s; recreating it", drift)
    _delete_and_wait(api, kind, name, namespace)
    return Applied(api.create(kind, stamped, namespace), "recreated", drift)


def _delete_and_wait(api: KubeApi, kind: Kind, name: str, namespace: str | None) -> None:
    from prefect_nemo.kube.watch import wait_for  # watch imports apply's siblings only

    api.delete(kind, name, namespace, propagation="Foreground")
    what = f"deletion of {kind.describe(name)}"
    wait_for(
        api, kind, name, lambda obj: obj is None, namespace=namespace, timeout_s=120, what=what
    )


def owner_reference(
    owner: dict, *, controller: bool = False, block_owner_deletion: bool = False
) -> dict:
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
    owner: dict,
    namespace: str | None = None,
    *,
    controller: bool = False,
) -> dict:
    """Make `owner` an owner of the object (idempotent by owner uid), so deleting the owner
    garbage-collects it. A merge patch replaces the whole list, so the existing refs are kept."""
    current = api.get(kind, name, namespace)
    if current is None:
        raise NotFound(404, "NotFound", f"{kind.describe(name)} not found")
    refs = current.get("metadata", {}).get("ownerReferences") or []
    if any(ref.get("uid") == owner["metadata"]["uid"] for ref in refs):
        return current
    ref = owner_reference(owner, controller=controller)
    # the resourceVersion makes a concurrent change of the list a Conflict, not a lost ref
    rv = current["metadata"]["resourceVersion"]
    patch = {"metadata": {"ownerReferences": [*refs, ref], "resourceVersion": rv}}
    return api.patch(kind, name, patch, namespace)
