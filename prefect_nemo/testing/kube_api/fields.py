"""Field ownership as kube-apiserver's field manager keeps it in `metadata.managedFields`, so
that server-side apply reports conflicts as the real server does.

The rules (Kubernetes docs, "Server-Side Apply"): an Update (create, PUT, a non-apply PATCH)
takes every field whose value it changed from whoever managed it; an Apply owns exactly the
fields of its configuration, and one that would change a field another manager owns to a
different value is refused with 409 Conflict unless forced (then it takes the field); equal
values are shared; a field the applier stops applying and nobody else owns is removed.

Simplifications, kept on purpose: every list is atomic (owned and merged whole; the real server
merges lists its schema marks as map/set item by item), FieldsV1 lists leaves only (no "."
entries for maps), and Update managers are never merged into "ancient-changes".
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
Path = tuple[str, ...]
# What the field manager never tracks (its stripMeta): identity and server bookkeeping.
_META = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
         "managedFields", "selfLink")  # fmt: skip
STRIPPED: frozenset[Path] = frozenset(
    {("apiVersion",), ("kind",)} | {("metadata", f) for f in _META}
)
_MISSING = object()


@dataclass(frozen=True)
class Write:
    """Who writes, and how: the field manager, "Apply" or "Update", the object's apiVersion,
    the subresource ("status" or ""), and for an Apply its configuration."""

    manager: str
    operation: str
    api_version: str
    subresource: str = ""
    applied: Obj | None = None

    def same_manager(self, entry: Obj) -> bool:
        """True for this manager's own entry (an Update's is also per apiVersion)."""
        return (
            entry.get("manager") == self.manager
            and entry.get("operation") == self.operation
            and (entry.get("subresource") or "") == self.subresource
            and (self.operation == "Apply" or entry.get("apiVersion") == self.api_version)
        )


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every field with its value: maps are walked; scalars, lists and empty maps are leaves."""
    if isinstance(obj, dict) and (obj or not prefix):
        out: dict[Path, Any] = {}
        for key, value in obj.items():
            out.update(leaves(value, (*prefix, str(key))))
        return out
    return {prefix: obj}


def tracked(obj: Obj | None, subresource: str, status_subresource: bool) -> dict[Path, Any]:
    """The fields a write through this (sub)resource may own: not identity or bookkeeping; where
    the type has a status subresource, status only through it and the rest only without it."""
    out = {}
    for path, value in leaves(obj or {}).items():
        if path in STRIPPED:
            continue
        if status_subresource and (path[0] == "status") != (subresource == "status"):
            continue
        out[path] = value
    return out


def path_text(path: Path) -> str:
    """A field path as the server prints it (".data.a")."""
    return "".join(f".{p}" for p in path)


def manager_text(entry: Obj) -> str:
    """A manager as conflict messages name it ('"kubectl" using v1')."""
    text = json.dumps(entry.get("manager", ""))
    if entry.get("subresource"):
        text += f" with subresource {json.dumps(entry['subresource'])}"
    if entry.get("operation") == "Update":
        text += f" using {entry.get('apiVersion', '')}"
    return text


def owned(entry: Obj) -> set[Path]:
    """The fields a managedFields entry owns."""
    out: set[Path] = set()

    def walk(node: Obj, prefix: Path) -> None:
        for key, child in node.items():
            if not key.startswith("f:"):
                continue
            path = (*prefix, key[2:])
            if child:
                walk(child, path)
            else:
                out.add(path)

    walk(entry.get("fieldsV1") or {}, ())
    return out


def _tree(paths: set[Path]) -> Obj:
    root: Obj = {}
    for path in sorted(paths):
        node = root
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return root


def conflicts(
    entries: list[Obj], write: Write, live: Obj, status_subresource: bool
) -> list[tuple[str, str]]:
    """(manager, field) for each field the apply would set to another value than the live one
    while a different manager owns it, sorted by manager then field."""
    want = tracked(write.applied, write.subresource, status_subresource)
    have = leaves(live)
    found = []
    for entry in entries:
        if write.same_manager(entry):
            continue
        for path in sorted(owned(entry) & want.keys()):
            if have.get(path, _MISSING) != want[path]:
                found.append((entry, path))
    found.sort(key=lambda c: (c[0].get("manager", ""), c[0].get("operation", ""), c[1]))
    return [(manager_text(e), path_text(p)) for e, p in found]


def release(patched: Obj, entries: list[Obj], write: Write, status_subresource: bool) -> Obj:
    """The patched object without the fields this applier owned, no longer applies, and no
    other manager owns (emptied parent maps go too)."""
    mine = next((e for e in entries if write.same_manager(e)), None)
    if mine is None:
        return patched
    others = set().union(*(owned(e) for e in entries if e is not mine))
    dropped = owned(mine) - tracked(write.applied, write.subresource, status_subresource).keys()
    out = copy.deepcopy(patched)
    for path in dropped - others:
        _remove(out, path)
    return out


def _remove(obj: Obj, path: Path) -> None:
    parents = [obj]
    for part in path[:-1]:
        child = parents[-1].get(part)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(parents) - 1, 0, -1):  # prune the maps it emptied
        if not parents[depth]:
            parents[depth - 1].pop(path[depth - 1], None)


def record(
    entries: list[Obj],
    write: Write,
    old: Obj | None,
    new: Obj,
    status_subresource: bool,
    *,
    at: str,
) -> list[Obj]:
    """The managedFields after the write (at time `at`). An Update owns every field it changed
    (taken from the others); an Apply owns exactly its configuration's fields, taking from the
    others those it changed (only a forced apply gets that far with another manager's field)."""
    before = tracked(old, write.subresource, status_subresource)
    after = tracked(new, write.subresource, status_subresource)
    changed = {p for p in before.keys() | after.keys() if before.get(p, _MISSING) != after.get(p)}
    if write.operation == "Apply":
        applied = tracked(write.applied, write.subresource, status_subresource)
        mine, taken = (
            set(applied) & set(after),
            changed | {p for p in applied if before.get(p, _MISSING) != applied[p]},
        )
    else:
        current = next((e for e in entries if write.same_manager(e)), None)
        mine = ((owned(current) if current else set()) | changed) & set(after)
        taken = changed
    out: list[Obj] = []
    found = False
    for entry in entries:
        if write.same_manager(entry):
            found = True
            if owned(entry) == mine and not changed:
                out.append(entry)  # nothing new: keep its time, so a no-op stays a no-op
            elif mine:
                out.append(_entry(write, mine, at))
        elif keep := owned(entry) - taken:
            out.append(entry if keep == owned(entry) else {**entry, "fieldsV1": _tree(keep)})
    if not found and mine:
        out.append(_entry(write, mine, at))
    return out


def _entry(write: Write, paths: set[Path], at: str) -> Obj:
    entry: Obj = {
        "manager": write.manager,
        "operation": write.operation,
        "apiVersion": write.api_version,
        "time": at,
        "fieldsType": "FieldsV1",
        "fieldsV1": _tree(paths),
    }
    if write.subresource:
        entry["subresource"] = write.subresource
    return entry
