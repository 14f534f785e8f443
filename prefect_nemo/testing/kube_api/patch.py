"""Patch flavours the API server accepts: JSON merge (RFC 7386), JSON patch (RFC 6902),
strategic merge.

Strategic merge follows the Kubernetes rules for the core types we serve, driven by a
pragmatic table of list merge keys (the real server reads them from Go struct tags).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"

# field name -> merge key of its list items (patchMergeKey in the core API types).
_MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
    "conditions": "type",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "topologySpreadConstraints": "topologyKey",
}
# Lists of scalars with patchStrategy "merge": a patch adds to them instead of replacing them.
_PRIMITIVE_MERGE = {"finalizers"}


class PatchError(ValueError):
    """A patch that cannot be applied (bad document or failed JSON patch operation)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 through the `jsonpatch` library."""
    if not isinstance(operations, list):
        raise PatchError("json patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(target, operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError) as exc:
        raise PatchError(str(exc)) from exc


def _list_merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":  # container ports merge by containerPort, service ports by port
        sample = next((i for i in items if isinstance(i, dict)), {})
        return "containerPort" if "containerPort" in sample else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge(target: Any, patch: Any) -> Any:
    """Strategic merge for core objects: keyed lists merge item by item; `$patch` honoured."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in copy.deepcopy(patch).items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    deletions: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions[key.split("/", 1)[1]] = value or []
            continue
        if key.startswith("$"):  # $setElementOrder and friends only order lists: ignore
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            result[key] = value
    for key, removed in deletions.items():
        if isinstance(result.get(key), list):
            result[key] = [v for v in result[key] if v not in removed]
    return result


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current = current if isinstance(current, list) else []
    if field in _PRIMITIVE_MERGE:
        # kube-apiserver puts the patch's items first (seen on 1.37: ["b/y"] onto ["a/x"])
        return patch + [v for v in current if v not in patch]
    key = _list_merge_key(field, patch + current)
    if key is None or not all(isinstance(i, dict) for i in patch):
        return copy.deepcopy(patch)
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [i for i in copy.deepcopy(patch) if i.get("$patch") != "replace"]
    result = copy.deepcopy(current)
    for item in patch:
        idx = next(
            (
                n
                for n, cur in enumerate(result)
                if isinstance(cur, dict) and cur.get(key) == item.get(key)
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if idx is not None:
                result.pop(idx)
        elif idx is None:
            result.append(strategic_merge({}, item))
        else:
            result[idx] = strategic_merge(result[idx], item)
    return result
