"""Object storage with the apiserver's bookkeeping: resourceVersions, a bounded event history
per resource (the watch cache's window), finalizers and garbage collection.

One `threading.RLock` guards everything: the HTTP handlers run on the server's event loop
thread while tests peek from their own thread. Stored objects are never mutated in place
(every write stores a new dict), so the event history can share them.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import random
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prefect_nemo.testing.kube_api import errors, fields
from prefect_nemo.testing.kube_api.schema import CORE_TYPES, Cause, ResourceType

Obj = dict[str, Any]
Key = tuple[str, str]  # (group, plural)

MAX_CONFIG_BYTES = 1024 * 1024
# The apiserver's generateName alphabet (no vowels, no confusable digits).
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', "
    "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_LABEL_1123_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must "
    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_LABEL_1035_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
    "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
_CONFIG_KEY_MSG = (
    "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. "
    "'key.name',  "
    "or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
)


def generate_name(md: Obj) -> None:
    """Give an object that has only a generateName its name (as the registry does before it
    validates the object, so that the name's checks and CEL rules see it)."""
    if not md.get("name") and md.get("generateName"):
        md["name"] = md["generateName"] + "".join(random.choices(_SUFFIX_CHARS, k=5))


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def meta(obj: Obj) -> Obj:
    return obj.setdefault("metadata", {})


@dataclass
class Event:
    """One change in the history: `old` is what watchers matched before (None for ADDED)."""

    rv: int
    type: str
    key: Key
    namespace: str
    old: Obj | None
    new: Obj


@dataclass(frozen=True)
class WatchWindow:
    """How much event history the server keeps per resource, as kube-apiserver's watch cache
    does (k8s.io/apiserver/pkg/storage/cacher, watch_cache history): at least the last
    `min_events` (defaultLowerBoundCapacity), doubling up to `max_events`
    (defaultUpperBoundCapacity) while all it holds is younger than `fresh_s`
    (DefaultEventFreshDuration). A watch from a resourceVersion older than what is kept gets
    410 Gone. Tests pass a small window to make versions expire without waiting."""

    min_events: int = 100
    fresh_s: float = 75.0
    max_events: int = 100 * 1024


class History:
    """One resource's retained events, in the watch cache's ring-buffer rules: when full, the
    capacity doubles if the oldest event is fresh, halves if even the newest quarter is stale,
    else the oldest event is dropped; once one was dropped, a version before the oldest kept is
    too old to resume from."""

    def __init__(self, window: WatchWindow, floor: int) -> None:
        self.window = window
        self.capacity = window.min_events
        self.events: deque[tuple[float, Event]] = deque()
        self.floor = floor  # the oldest version to resume from while nothing was dropped
        self.dropped = False

    def add(self, event: Event, at: float) -> None:
        w, events = self.window, self.events
        if len(events) >= self.capacity:
            if at - events[0][0] < w.fresh_s:
                self.capacity = min(self.capacity * 2, w.max_events)
            elif at - events[(len(events) - self.capacity // 4) % len(events)][0] > w.fresh_s:
                self.capacity = max(self.capacity // 2, w.min_events)
        while len(events) >= self.capacity:
            events.popleft()
            self.dropped = True
        events.append((at, event))

    def resumable_from(self) -> int:
        """The oldest resourceVersion a watch may start from ("oldest-1" in the watch cache)."""
        if not self.dropped or not self.events:
            return self.floor
        return self.events[0][1].rv - 1

    def reset(self, rv: int) -> None:
        """Forget everything up to rv (as a relist of the cache at rv does)."""
        self.events.clear()
        self.floor, self.dropped = rv, False


@dataclass(eq=False)
class Watcher:
    """An open watch stream; events reach it through its event loop."""

    loop: asyncio.AbstractEventLoop
    key: Key
    namespace: str | None
    match: Callable[[Obj], bool]
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def push(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def translate(self, event: Event) -> str | None:
        """Event type this watcher sees (selectors turn MODIFIED into ADDED/DELETED), or None."""
        if event.key != self.key or (self.namespace and event.namespace != self.namespace):
            return None
        new_ok = self.match(event.new)
        old_ok = event.old is not None and self.match(event.old)
        if event.type == "DELETED":
            return "DELETED" if old_ok or new_ok else None
        if new_ok:
            return "MODIFIED" if old_ok else "ADDED"
        return "DELETED" if old_ok else None


def validate_name(rt: ResourceType, name: str) -> list[Cause]:
    if rt.plural == "namespaces":
        pattern, msg, limit = _LABEL_1123, _LABEL_1123_MSG, 63
    elif rt.plural == "services":
        pattern, msg, limit = _LABEL_1035, _LABEL_1035_MSG, 63
    else:
        pattern, msg, limit = _SUBDOMAIN, _SUBDOMAIN_MSG, 253
    causes = []
    if len(name) > limit:
        causes.append(
            Cause(
                "FieldValueInvalid",
                "metadata.name",
                f'Invalid value: "{name}": must be no more than {limit} characters',
            )
        )
    if not pattern.match(name):
        causes.append(
            Cause("FieldValueInvalid", "metadata.name", f'Invalid value: "{name}": {msg}')
        )
    return causes


Location = tuple[Key, tuple[str, str]]  # (group, plural), (namespace, name)


def _owner_uids(obj: Obj) -> set[str]:
    return {r.get("uid", "") for r in meta(obj).get("ownerReferences") or []}


class Store:
    """All objects of all types, one resourceVersion counter, event history, open watchers."""

    def __init__(self, window: WatchWindow | None = None) -> None:
        self.lock = threading.RLock()
        self.rv = 0
        # The garbage collector's graph, kept as objects change (as kube-controller-manager's
        # is): a pass visits only the objects a change may concern, not every object (a full
        # scan per write made 1,000 RayJobs with their clusters and pods quadratic).
        self._locations: dict[str, Location] = {}  # uid → where the live object is
        self._dependents: dict[str, set[Location]] = {}  # owner uid → objects referring to it
        self._gc_work: set[Location] = set()  # objects to look at in the next pass
        self.window = window or WatchWindow()
        self.types: dict[Key, ResourceType] = {}
        self.objects: dict[Key, dict[tuple[str, str], Obj]] = {}
        self.histories: dict[Key, History] = {}
        self.watchers: set[Watcher] = set()
        for rt in CORE_TYPES:
            self.add_type(copy.copy(rt))

    def add_type(self, rt: ResourceType) -> None:
        with self.lock:
            self.types[(rt.group, rt.plural)] = rt
            self.objects.setdefault((rt.group, rt.plural), {})
            self.histories.setdefault((rt.group, rt.plural), History(self.window, self.rv))

    def find_type(self, group: str, plural: str) -> ResourceType | None:
        return self.types.get((group, plural))

    # reads -------------------------------------------------------------------------------------
    def get(self, rt: ResourceType, namespace: str, name: str) -> Obj | None:
        with self.lock:
            obj = self.objects[(rt.group, rt.plural)].get(
                (namespace if rt.namespaced else "", name)
            )
            return copy.deepcopy(obj) if obj is not None else None

    def require(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        obj = self.get(rt, namespace, name)
        if obj is None:
            raise errors.not_found(rt, name)
        return obj

    def list(self, rt: ResourceType, namespace: str | None) -> tuple[list[Obj], int]:
        with self.lock:
            items = [
                obj
                for (ns, _), obj in sorted(self.objects[(rt.group, rt.plural)].items())
                if not namespace or ns == namespace
            ]
            return copy.deepcopy(items), self.rv

    def namespace_exists(self, name: str) -> bool:
        return ("", name) in self.objects[("", "namespaces")]

    # writes ------------------------------------------------------------------------------------
    def _commit(self, rt: ResourceType, event_type: str, new: Obj, old: Obj | None) -> Obj:
        """Store (or drop, for DELETED) an object under the next resourceVersion; tell watchers."""
        self.rv += 1
        new = copy.deepcopy(new)
        md = meta(new)
        md["resourceVersion"] = str(self.rv)
        key = (rt.group, rt.plural)
        ident = (md.get("namespace", ""), md["name"])
        if event_type == "DELETED":
            self.objects[key].pop(ident, None)
        else:
            self.objects[key][ident] = new
        self._track(key, ident, event_type, new, old)
        event = Event(self.rv, event_type, key, ident[0], old, new)
        self.histories[key].add(event, time.monotonic())
        for watcher in list(self.watchers):
            watcher.push(event)
        return copy.deepcopy(new)

    def create(
        self,
        rt: ResourceType,
        namespace: str,
        obj: Obj,
        *,
        dry_run: bool = False,
        write: fields.Write | None = None,
    ) -> Obj:
        """Create (POST semantics); `write` says who, for the object's managedFields."""
        with self.lock:
            md = meta(obj)
            if rt.namespaced:
                if md.get("namespace") not in (None, "", namespace):
                    raise errors.bad_request(
                        "the namespace of the provided object does not match the namespace "
                        "sent on the request"
                    )
                md["namespace"] = namespace
                ns_obj = self.objects[("", "namespaces")].get(("", namespace))
                if ns_obj is None:
                    raise errors.not_found(self.types[("", "namespaces")], namespace)
                if ns_obj["metadata"].get("deletionTimestamp"):
                    raise errors.ApiError(
                        403,
                        "Forbidden",
                        f'{rt.group_resource} "{md.get("name", "")}" is forbidden: unable to '
                        "create new content "
                        f"in namespace {namespace} because it is being terminated",
                    )
            else:
                md.pop("namespace", None)
            generate_name(md)
            name = md.get("name") or ""
            if not name:
                raise errors.invalid(
                    rt,
                    "",
                    [
                        Cause(
                            "FieldValueRequired",
                            "metadata.name",
                            "Required value: name or generateName is required",
                        )
                    ],
                )
            if name_causes := validate_name(rt, name):
                raise errors.invalid(rt, name, name_causes)
            if (namespace if rt.namespaced else "", name) in self.objects[(rt.group, rt.plural)]:
                raise errors.already_exists(rt, name)
            for stale in (
                "resourceVersion",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "managedFields",
            ):
                md.pop(stale, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = now()
            if rt.crd is not None:
                md["generation"] = 1
            prepare_core(rt, obj, None)
            if write is not None:
                tracked = fields.record([], write, None, obj, rt.status_subresource, at=now())
                md["managedFields"] = tracked
            if dry_run:
                return obj
            created = self._commit(rt, "ADDED", obj, None)
            self.collect_garbage()
            return created

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        obj: Obj,
        *,
        status: bool = False,
        dry_run: bool = False,
        write: fields.Write | None = None,
    ) -> Obj:
        """Replace an object (PUT semantics; patches arrive here already applied); `write` says
        who, for its managedFields (None: the server's own bookkeeping, which owns nothing)."""
        with self.lock:
            old = self.require(rt, namespace, name)
            md = meta(obj)
            if md.get("name", name) != name:
                raise errors.bad_request(
                    f"the name of the object ({md.get('name')}) does not match the name on "
                    f"the URL ({name})"
                )
            rv = md.get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise errors.conflict(rt, name)
            if not rv and rt.crd is not None:
                raise errors.invalid(
                    rt,
                    name,
                    [
                        Cause(
                            "FieldValueInvalid",
                            "metadata.resourceVersion",
                            "Invalid value: 0x0: must be specified for an update",
                        )
                    ],
                )
            if status:
                new = copy.deepcopy(old)
                if "status" in obj:
                    new["status"] = obj["status"]
                else:
                    new.pop("status", None)
            else:
                new = obj
                if rt.status_subresource:
                    if "status" in old:
                        new["status"] = old["status"]
                    else:
                        new.pop("status", None)
                md = meta(new)
                old_md = old["metadata"]
                for kept in (
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                ):
                    if kept in old_md:
                        md[kept] = old_md[kept]
                    else:
                        md.pop(kept, None)
                md["name"] = name
                if rt.namespaced:
                    md["namespace"] = namespace
                if old_md.get("deletionTimestamp"):
                    added = [
                        f
                        for f in md.get("finalizers") or []
                        if f not in (old_md.get("finalizers") or [])
                    ]
                    if added:
                        raise errors.invalid(
                            rt,
                            name,
                            [
                                Cause(
                                    "FieldValueForbidden",
                                    "metadata.finalizers",
                                    "Forbidden: no new finalizers can be added if the object "
                                    "is being deleted, "
                                    f"found new finalizers {added}",
                                )
                            ],
                        )
                if rt.crd is not None:
                    md["generation"] = old_md.get("generation", 1) + (
                        _spec_of(rt, new) != _spec_of(rt, old)
                    )
                prepare_core(rt, new, old)
            meta(new)["resourceVersion"] = old["metadata"]["resourceVersion"]
            entries = old["metadata"].get("managedFields") or []
            if write is not None:
                entries = fields.record(entries, write, old, new, rt.status_subresource, at=now())
            meta(new).pop("managedFields", None)
            if entries:
                meta(new)["managedFields"] = entries
            if dry_run:
                return new
            if new == old:  # a no-op write keeps the resourceVersion, as the real server does
                return old
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                gone = self._commit(rt, "DELETED", new, old)
                self.collect_garbage()
                return gone
            updated = self._commit(rt, "MODIFIED", new, old)
            self.collect_garbage()
            return updated

    def delete(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        *,
        policy: str | None = None,
        dry_run: bool = False,
    ) -> tuple[Obj, bool]:
        """Delete (or mark for deletion when finalizers hold it); returns (object, gone)."""
        with self.lock:
            obj = self.require(rt, namespace, name)
            if dry_run:
                return obj, True
            result = self._delete(rt, obj, policy or "Background")
            self.collect_garbage()
            current = self.get(rt, namespace, name)
            return (current, False) if current is not None else (result, True)

    def _delete(self, rt: ResourceType, obj: Obj, policy: str) -> Obj:
        md = obj["metadata"]
        finalizers = list(md.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if policy == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        if rt.plural == "namespaces":
            # namespace contents go first; the namespace itself leaves in the GC pass once empty
            new = copy.deepcopy(obj)
            new["metadata"].setdefault("deletionTimestamp", now())
            new.setdefault("status", {})["phase"] = "Terminating"
            committed = self._commit(rt, "MODIFIED", new, obj) if new != obj else obj
            for (group, plural), objs in self.objects.items():
                for (ns, _), child in list(objs.items()):
                    if ns == md["name"] and not child["metadata"].get("deletionTimestamp"):
                        self._delete(self.types[(group, plural)], child, "Background")
            return committed
        if not finalizers:
            return self._commit(rt, "DELETED", obj, obj)
        if md.get("deletionTimestamp") and finalizers == md.get("finalizers"):
            return obj
        new = copy.deepcopy(obj)
        new["metadata"]["finalizers"] = finalizers
        new["metadata"].setdefault("deletionTimestamp", now())
        new["metadata"].setdefault("deletionGracePeriodSeconds", 0)
        return self._commit(rt, "MODIFIED", new, obj)

    def _remove_finalizer(self, rt: ResourceType, obj: Obj, finalizer: str) -> None:
        new = copy.deepcopy(obj)
        new["metadata"]["finalizers"] = [
            f for f in obj["metadata"].get("finalizers", []) if f != finalizer
        ]
        if not new["metadata"]["finalizers"]:
            del new["metadata"]["finalizers"]
            self._commit(rt, "DELETED", new, obj)
        else:
            self._commit(rt, "MODIFIED", new, obj)

    def _track(
        self, key: Key, ident: tuple[str, str], event_type: str, new: Obj, old: Obj | None
    ) -> None:
        """Keep the collector's graph; queue what this change may concern: the object, its
        dependents and owners, and its namespace (which may be waiting to be empty)."""
        here: Location = (key, ident)
        uid = meta(new)["uid"]
        before = _owner_uids(old) if old is not None else set()
        after = set() if event_type == "DELETED" else _owner_uids(new)
        for owner in before - after:
            if (deps := self._dependents.get(owner)) is not None:
                deps.discard(here)
                if not deps:
                    del self._dependents[owner]
        for owner in after - before:
            self._dependents.setdefault(owner, set()).add(here)
        if event_type == "DELETED":
            self._locations.pop(uid, None)
        else:
            self._locations[uid] = here
        refs_changed = meta(new).get("ownerReferences") != (
            meta(old).get("ownerReferences") if old is not None else None
        )
        if event_type == "DELETED" or meta(new).get("deletionTimestamp") or refs_changed:
            self._gc_work.add(here)
            self._gc_work.update(self._dependents.get(uid, ()))
            self._gc_work.update(self._locations[o] for o in before | after if o in self._locations)
            if ident[0]:
                self._gc_work.add((("", "namespaces"), ("", ident[0])))

    def collect_garbage(self) -> None:
        """One synchronous pass of the garbage collector, until nothing it looks at changes."""
        with self.lock:
            while self._gc_work:
                key, ident = self._gc_work.pop()
                obj = self.objects[key].get(ident)
                if obj is not None and self._gc_one(self.types[key], obj):
                    self._gc_work.add((key, ident))  # changed: it may have more to do

    def _resolves(self, ref: Obj, dep_rt: ResourceType, dep: Obj) -> bool:
        # "A namespaced owner must exist in the same namespace as the dependent. If it
        # does not, the owner reference is treated as absent" (Kubernetes, Owners and
        # Dependents); a cluster-scoped dependent's unresolvable ref blocks nothing.
        found = self._locations.get(ref.get("uid", ""))
        if found is None:
            return False
        owner_rt, owner = self.types[found[0]], self.objects[found[0]][found[1]]
        if not owner_rt.namespaced or not dep_rt.namespaced:
            return True
        return owner["metadata"].get("namespace") == dep["metadata"].get("namespace")

    def _gc_one(self, rt: ResourceType, obj: Obj) -> bool:
        """Do the collector's next step for one object; True when it changed something."""
        md = obj["metadata"]
        if md.get("deletionTimestamp"):
            deps = []
            for dep_key, dep_ident in sorted(self._dependents.get(md["uid"], ())):
                dep = self.objects[dep_key].get(dep_ident)
                dep_rt = self.types[dep_key]
                if dep is not None and any(
                    r.get("uid") == md["uid"] and self._resolves(r, dep_rt, dep)
                    for r in dep["metadata"].get("ownerReferences") or []
                ):
                    deps.append((dep_rt, dep))
            finalizers = md.get("finalizers") or []
            if "orphan" in finalizers:
                for dep_rt, dep in deps:
                    new = copy.deepcopy(dep)
                    refs = [
                        r for r in dep["metadata"]["ownerReferences"] if r.get("uid") != md["uid"]
                    ]
                    new["metadata"]["ownerReferences"] = refs
                    if not refs:
                        del new["metadata"]["ownerReferences"]
                    self._commit(dep_rt, "MODIFIED", new, dep)
                self._remove_finalizer(rt, obj, "orphan")
                return True
            if "foregroundDeletion" in finalizers:
                pending = [
                    (d_rt, d) for d_rt, d in deps if not d["metadata"].get("deletionTimestamp")
                ]
                for dep_rt, dep in pending:
                    self._delete(dep_rt, dep, "Foreground")
                if pending:
                    return True
                blocking = [
                    d
                    for _, d in deps
                    if any(
                        r.get("uid") == md["uid"] and r.get("blockOwnerDeletion")
                        for r in d["metadata"].get("ownerReferences", [])
                    )
                ]
                if not blocking:
                    self._remove_finalizer(rt, obj, "foregroundDeletion")
                    return True
            if rt.plural == "namespaces" and not any(
                ns == md["name"] for objs in self.objects.values() for (ns, _) in objs
            ):
                self._commit(rt, "DELETED", obj, obj)
                return True
        refs = md.get("ownerReferences") or []
        if not refs:
            return False
        live = [r for r in refs if self._resolves(r, rt, obj)]
        if not live and not md.get("deletionTimestamp"):
            self._delete(rt, obj, "Background")
            return True
        if live and len(live) != len(refs):
            new = copy.deepcopy(obj)
            new["metadata"]["ownerReferences"] = live
            self._commit(rt, "MODIFIED", new, obj)
            return True
        return False

    def compact(self) -> None:
        """Forget every resource's history: any older version is now too old to watch from."""
        with self.lock:
            for history in self.histories.values():
                history.reset(self.rv)

    def events_after(self, key: Key, rv: int) -> list[Event]:
        """The resource's events after rv; 410 Gone when rv is older than its window keeps."""
        with self.lock:
            history = self.histories[key]
            if rv < (oldest := history.resumable_from()):
                raise errors.gone(rv, oldest)
            return [e for _, e in history.events if e.rv > rv]


def _spec_of(rt: ResourceType, obj: Obj) -> Obj:
    """What bumps generation: everything but metadata (and status, when it is a subresource)."""
    skip = {"metadata", "apiVersion", "kind"} | ({"status"} if rt.status_subresource else set())
    return {k: v for k, v in obj.items() if k not in skip}


def prepare_core(rt: ResourceType, obj: Obj, old: Obj | None) -> None:
    """Defaults and validation of the core types (the subset of the real strategies we need)."""
    if rt.group:
        return
    name = obj["metadata"]["name"]
    if rt.plural == "secrets":
        data = dict(obj.get("data") or {})
        for key, value in (obj.pop("stringData", None) or {}).items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        if data or "data" in obj:
            obj["data"] = data
        obj.setdefault("type", "Opaque")
        causes = _key_causes("data", data)
        size = sum(len(base64.b64decode(v or "")) for v in data.values())
        if size > MAX_CONFIG_BYTES:
            causes.append(
                Cause(
                    "FieldValueTooLong",
                    "data",
                    f"Too long: must have at most {MAX_CONFIG_BYTES} bytes",
                )
            )
        if causes:
            raise errors.invalid(rt, name, causes)
    elif rt.plural == "configmaps":
        data, binary = obj.get("data") or {}, obj.get("binaryData") or {}
        causes = _key_causes("data", data) + _key_causes("binaryData", binary)
        size = sum(len(k) + len(str(v).encode()) for k, v in data.items())
        size += sum(len(k) + len(base64.b64decode(v or "")) for k, v in binary.items())
        if size > MAX_CONFIG_BYTES:
            causes.append(
                Cause(
                    "FieldValueTooLong",
                    "[]",
                    f"Too long: must have at most {MAX_CONFIG_BYTES} bytes",
                )
            )
        if causes:
            raise errors.invalid(rt, name, causes)
    elif rt.plural == "pods":
        containers = (obj.get("spec") or {}).get("containers")
        if not containers:
            raise errors.invalid(
                rt, name, [Cause("FieldValueRequired", "spec.containers", "Required value")]
            )
        if old is None:
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    elif rt.plural == "services":
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        old_ip = ((old or {}).get("spec") or {}).get("clusterIP")
        spec["clusterIP"] = (
            old_ip
            or spec.get("clusterIP")
            or f"10.96.{random.randint(0, 255)}.{random.randint(1, 254)}"
        )
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        if old is None:
            obj["status"] = {"loadBalancer": {}, "conditions": []}
    elif rt.plural == "namespaces" and old is None:
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
    elif rt.plural == "persistentvolumeclaims" and old is None:
        obj["status"] = {"phase": "Pending"}


def _key_causes(field_name: str, data: dict[str, Any]) -> list[Cause]:
    return [
        Cause(
            "FieldValueInvalid",
            f"{field_name}[{key}]",
            f'Invalid value: "{key}": {_CONFIG_KEY_MSG}',
        )
        for key in data
        if not _CONFIG_KEY.match(key)
    ]
