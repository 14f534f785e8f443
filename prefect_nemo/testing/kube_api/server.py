"""The HTTP side of the loopback apiserver: routing, auth, RBAC denials, watches, proxy, logs."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

import aiohttp
import yaml
from aiohttp import web

from prefect_nemo.testing.app_thread import AppThread
from prefect_nemo.testing.kube_api import errors, fields, quantity
from prefect_nemo.testing.kube_api import patch as patches
from prefect_nemo.testing.kube_api.client_config import TokenClientConfig
from prefect_nemo.testing.kube_api.errors import ApiError
from prefect_nemo.testing.kube_api.schema import (
    Cause,
    ResourceType,
    read_crd_documents,
    resource_from_crd,
)
from prefect_nemo.testing.kube_api.selectors import field_matcher, label_matcher
from prefect_nemo.testing.kube_api.store import (
    Event,
    Obj,
    Store,
    Watcher,
    WatchWindow,
    generate_name,
    now,
)

ProxyHandler = Callable[[str, str, dict[str, str], bytes], tuple[int, dict[str, str], bytes]]
_CRD_TYPE = ResourceType(
    "apiextensions.k8s.io",
    ["v1"],
    "customresourcedefinitions",
    "customresourcedefinition",
    "CustomResourceDefinition",
    False,
    True,
    ["crd", "crds"],
)
_HOP_HEADERS = {
    "authorization",
    "host",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
_WS_HEADERS = {
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
    "sec-websocket-protocol",
}
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_VERSION = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.0",
    "gitCommit": "loopback",
    "gitTreeState": "clean",
    "buildDate": "2025-04-23T00:00:00Z",
    "goVersion": "go1.24.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_OPTIONS = {"create": "CreateOptions", "update": "UpdateOptions", "patch": "PatchOptions"}
_FIELD_VALIDATION = ("", "Ignore", "Strict", "Warn")
_DROP = object()  # watcher sentinel: cut the connection
_STOP = object()  # watcher sentinel: end the stream cleanly (server shutdown)


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


class RequestEntry(NamedTuple):
    """One request the server saw: (method, path, query, is_watch, time, User-Agent)."""

    method: str
    path: str
    query: dict[str, str]
    is_watch: bool
    time: float
    agent: str = ""  # tells a simulator's requests from the client's under test


@dataclass
class RequestLog:
    """Every request the server answered (after auth), for tests that count API calls."""

    entries: list[RequestEntry] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, entry: RequestEntry) -> None:
        with self._lock:
            self.entries.append(entry)

    def count(
        self, method: str | None = None, path_contains: str | None = None, watch: bool | None = None
    ) -> int:
        with self._lock:
            return sum(
                1
                for e in self.entries
                if (method is None or e.method == method.upper())
                and (path_contains is None or path_contains in e.path)
                and (watch is None or e.is_watch == watch)
            )

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


@dataclass
class _Route:
    rt: ResourceType
    version: str
    namespace: str  # "" for cluster-scoped objects and cluster-wide lists
    name: str
    sub: list[str]  # subresource path: ["status"], ["log"], ["proxy", ...]


class LoopbackKubeServer(TokenClientConfig):
    """A real HTTP Kubernetes API server on 127.0.0.1 for tests; the `kubernetes` client works
    against it unchanged.

    Serves core Namespaces, Pods, Services, ConfigMaps, Secrets, PVCs, Events, ServiceAccounts
    and the custom resources of the CRDs given (validated against their openAPIV3Schema and
    their `x-kubernetes-validations` rules). As kube-apiserver does, it drops a custom
    resource's unknown fields with a Warning header (refuses them with `fieldValidation=Strict`)
    and stores the quantities of Pods and PVCs as canonical strings. Runs its own event loop in
    a background thread. Service proxy requests need an existing Service object plus a target
    registered with `set_service_proxy`. Server-side apply tracks field ownership
    (`metadata.managedFields`) and answers conflicts with 409 unless forced (see `fields.py`
    for what it simplifies).
    """

    def __init__(
        self,
        crds: Iterable[str | Path] = (),
        *,
        token: str | None = None,
        tls: bool = False,
        namespaces: Iterable[str] = ("default",),
        watch_window: WatchWindow | None = None,
    ):
        self.token = token or secrets.token_urlsafe(24)
        self._issued: set[str] = set()  # more tokens accepted (issue_token), as other users'
        self.tls = tls
        self.requests = RequestLog()
        self.ca_pem: bytes | None = None
        self.url = ""
        self._store = Store(watch_window)
        self._store.add_type(_CRD_TYPE)
        self._proxies: dict[tuple[str, str, str], str | ProxyHandler] = {}
        self._logs: dict[tuple[str, str, str | None], str | Callable[[], str]] = {}
        self._forbidden: set[tuple[str, str, str]] = set()
        self._throttled: dict[tuple[str, str, str], int] = {}  # requests left to answer 429
        self._throttle_lock = threading.Lock()
        self.throttle_retry_after_s = 1
        self.throttled_answers = 0
        self._server = AppThread("loopback-kube-api")
        self._session: aiohttp.ClientSession | None = None
        self._open_responses: set[web.StreamResponse] = set()
        for ns in namespaces:
            self._store.create(
                self._store.types[("", "namespaces")], "", {"metadata": {"name": ns}}
            )
        self.load_crds(*crds)

    # lifecycle ---------
    def start(self) -> LoopbackKubeServer:
        """Start serving on a free port; returns self."""
        if self._server.running:
            return self
        ssl_ctx = None
        if self.tls:
            from prefect_nemo.testing.kube_api.tls import make_server_tls

            ssl_ctx, self.ca_pem = make_server_tls()

        def app() -> web.Application:  # built on the server's loop
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._session = aiohttp.ClientSession(auto_decompress=False)
            return app

        port = self._server.start(app, ssl_context=ssl_ctx)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        """Stop serving; open watches end."""

        async def end_watches_and_proxies() -> None:
            with self._store.lock:
                for watcher in list(self._store.watchers):
                    watcher.push(_STOP)
            await asyncio.sleep(0.05)
            if self._session is not None:
                await self._session.close()

        self._server.stop(end_watches_and_proxies)

    def __enter__(self) -> LoopbackKubeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # test controls ---------
    def load_crds(self, *paths: str | Path) -> None:
        """Serve the CRDs in these files (a directory loads every *.yaml in it)."""
        for doc in read_crd_documents(paths):
            self._install_crd(doc)

    def _install_crd(self, doc: Obj) -> Obj:
        rt = resource_from_crd(doc)
        self._store.add_type(rt)
        # the spec is shared with the parsed-file cache; the store copies it on write
        doc = {**doc, "metadata": copy.deepcopy(doc["metadata"])}
        doc["status"] = {
            "acceptedNames": doc["spec"]["names"],
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": r,
                    "lastTransitionTime": now(),
                    "message": m,
                }
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
            "storedVersions": [v["name"] for v in doc["spec"]["versions"] if v.get("storage")],
        }
        name = doc["metadata"]["name"]
        with self._store.lock:
            old = self._store.get(_CRD_TYPE, "", name)
            if old is None:
                return self._store.create(_CRD_TYPE, "", doc)
            doc["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self._store.update(_CRD_TYPE, "", name, doc)

    def set_service_proxy(
        self, namespace: str, service: str, port: int | str, target: str | ProxyHandler
    ) -> None:
        """Answer `services/{service}:{port}/proxy/...` from a base URL or a
        handler(method, path, headers, body) -> (status, headers, body)."""
        self._proxies[(namespace, service, str(port))] = target

    def remove_service_proxy(self, namespace: str, service: str, port: int | str) -> None:
        self._proxies.pop((namespace, service, str(port)), None)

    def set_pod_log(
        self,
        namespace: str,
        pod: str,
        source: str | Callable[[], str],
        container: str | None = None,
    ) -> None:
        """What `pods/{pod}/log` returns (a callable: asked on each read)."""
        self._logs[(namespace, pod, container)] = source

    def forbid(self, verb: str, resource: str, group: str = "") -> None:
        """Answer 403 Forbidden for this verb on this resource (plural, or `plural/subresource`)."""
        self._forbidden.add((verb, resource, group))

    def throttle(
        self, verb: str, resource: str, group: str = "", *, times: int, retry_after_s: int = 1
    ) -> None:
        """Answer the next `times` requests of this verb on this resource with 429 Too Many
        Requests and a Retry-After, as API Priority and Fairness rejects what it cannot queue."""
        with self._throttle_lock:
            self._throttled[(verb, resource, group)] = times
            self.throttle_retry_after_s = retry_after_s

    def allow(self, verb: str, resource: str, group: str = "") -> None:
        """Undo `forbid`."""
        self._forbidden.discard((verb, resource, group))

    def drop_watches(self) -> None:
        """Cut every open watch connection abruptly, as a network failure would."""
        with self._store.lock:
            for watcher in list(self._store.watchers):
                watcher.push(_DROP)

    def issue_token(self) -> str:
        """Another bearer token the server accepts, as one more line of a real API server's
        static token file (another user of the same cluster)."""
        token = secrets.token_urlsafe(24)
        self._issued.add(token)
        return token

    def revoke_token(self, token: str | None = None) -> str:
        """Revoke `token` (one from `issue_token`), or by default rotate the server's own, as a
        real API server restarted with a new token file (or signing key) behaves: every open
        watch ends, and every later request that still carries the revoked token answers 401
        with a `kind: Status` body. Returns the server's token (new when it was rotated).

        Open watches end because a real apiserver checks credentials only when a request
        starts: it never re-authenticates an open stream, so a revocation alone would leave
        them flowing; the restart that brings the new token list in is what ends them (the
        clients whose tokens still hold list and watch again).
        """
        if token is None:
            self.token = secrets.token_urlsafe(24)
        elif token in self._issued:
            self._issued.discard(token)
        else:
            raise ValueError("not a token this server issued: revoke_token() rotates its own")
        with self._store.lock:
            for watcher in list(self._store.watchers):
                watcher.push(_STOP)
        return self.token

    def inject_watch_event(self, event: dict[str, Any], plural: str | None = None) -> int:
        """Write `event` as is, as one line, into every open watch (of `plural` only, if
        given), for tests of clients that must survive a stream they cannot digest. Returns
        how many watches got it."""
        line = json.dumps(event).encode() + b"\n"
        with self._store.lock:
            hit = [w for w in self._store.watchers if plural in (None, w.key[1])]
            for watcher in hit:
                watcher.push(line)
        return len(hit)

    def compact(self) -> None:
        """Forget the event history now (as an etcd compaction at the current revision): watches
        from an older resourceVersion get 410 Gone. Without it, versions expire on their own once
        they fall out of the `watch_window`."""
        self._store.compact()

    def get(
        self,
        kind_plural: str,
        namespace: str | None,
        name: str,
        group: str = "",
        version: str = "v1",
    ) -> Obj | None:
        """Peek at a stored object (no HTTP); None when absent."""
        rt = self._store.find_type(group, kind_plural)
        if rt is None:
            raise ValueError(f"the server does not serve {kind_plural!r} in group {group!r}")
        obj = self._store.get(rt, namespace or "", name)
        return self._render(rt, obj, version) if obj is not None else None

    # HTTP ----------
    def _accepts(self, auth: str) -> bool:
        """Whether an Authorization header carries a token the server accepts (each compared
        in constant time, all of them, so the answer's timing tells nothing)."""
        presented = auth.encode()
        tokens = [self.token, *self._issued]
        return sum(hmac.compare_digest(presented, f"Bearer {t}".encode()) for t in tokens) > 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            auth = request.headers.get("Authorization", "")
            if not self._accepts(auth):
                raise errors.unauthorized()
            raw_path = request.raw_path.split("?", 1)[0]
            parts = [unquote(p) for p in raw_path.strip("/").split("/") if p]
            query = dict(request.query)
            is_watch = _flag(query.get("watch"))
            self.requests.add(
                RequestEntry(
                    request.method,
                    "/" + "/".join(parts),
                    query,
                    is_watch,
                    time.time(),
                    request.headers.get("User-Agent", ""),
                )
            )
            return await self._dispatch(request, parts, query, is_watch)
        except ApiError as exc:
            return _status_response(exc)

    async def _dispatch(
        self, request: web.Request, parts: list[str], query: dict[str, str], is_watch: bool
    ) -> web.StreamResponse:
        if parts == ["version"]:
            return _json(_VERSION)
        if parts == ["api"]:
            return _json(
                {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
            )
        if parts == ["apis"]:
            return _json(self._group_list())
        if parts[:2] == ["api", "v1"]:
            if len(parts) == 2:
                return _json(self._resource_list("", "v1"))
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 2:
            group = parts[1]
            groups = {g["name"]: g for g in self._group_list()["groups"]}
            if group not in groups:
                raise _page_not_found()
            if len(parts) == 2:
                return _json(groups[group])
            version, rest = parts[2], parts[3:]
            if version not in [v["version"] for v in groups[group]["versions"]]:
                raise _page_not_found()
            if not rest:
                return _json(self._resource_list(group, version))
        else:
            raise _page_not_found()
        route = self._route(group, version, rest)
        return await self._serve(request, route, query, is_watch)

    def _route(self, group: str, version: str, rest: list[str]) -> _Route:
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        rt = self._store.find_type(group, rest[0])
        if rt is None or version not in rt.versions:
            raise _page_not_found()
        if namespace and not rt.namespaced:
            raise _page_not_found()
        name = rest[1] if len(rest) > 1 else ""
        return _Route(rt, version, namespace, name, rest[2:])

    async def _serve(
        self, request: web.Request, route: _Route, query: dict[str, str], is_watch: bool
    ) -> web.StreamResponse:
        rt, method = route.rt, request.method
        sub = route.sub[0] if route.sub else ""
        verb = _VERBS.get(method, method.lower())
        if not route.name and method == "GET":
            verb = "watch" if is_watch else "list"
        if not route.name and method == "DELETE":
            verb = "deletecollection"
        self._check_rbac(rt, verb, route, sub)
        if rt.namespaced and route.name and not route.namespace:
            raise _page_not_found()
        if sub == "proxy" and rt.plural == "services":
            return await self._proxy(request, route)
        if sub == "log" and rt.plural == "pods" and method == "GET":
            return await self._pod_log(request, route, query)
        if sub and (sub != "status" or not rt.status_subresource or len(route.sub) > 1):
            raise _page_not_found()
        if not route.name:
            if method == "GET":
                return await (
                    self._watch(request, route, query) if is_watch else self._list(route, query)
                )
            if method == "POST":
                return await self._create(request, route, query)
            if method == "DELETE":
                return await self._delete_collection(route, query)
            raise errors.method_not_allowed()
        if method == "GET":
            obj = self._store.require(rt, route.namespace, route.name)
            return _json(self._render(rt, obj, route.version))
        if method == "PUT":
            return await self._replace(request, route, query)
        if method == "PATCH":
            return await self._patch(request, route, query)
        if method == "DELETE" and not sub:
            return await self._delete(request, route, query)
        raise errors.method_not_allowed()

    def _check_rbac(self, rt: ResourceType, verb: str, route: _Route, sub: str) -> None:
        resource = f"{rt.plural}/{sub}" if sub else rt.plural
        if {(verb, resource, rt.group), ("*", resource, rt.group)} & self._forbidden:
            raise errors.forbidden(rt, verb, route.name, route.namespace or None, sub)
        with self._throttle_lock:
            left = self._throttled.get((verb, resource, rt.group), 0)
            if left > 0:
                self._throttled[(verb, resource, rt.group)] = left - 1
                self.throttled_answers += 1
                raise errors.too_many_requests(self.throttle_retry_after_s)

    # discovery ---------
    def _group_list(self) -> Obj:
        groups: dict[str, list[str]] = {}
        for (group, _), rt in list(self._store.types.items()):
            if group:
                versions = groups.setdefault(group, [])
                versions.extend(v for v in rt.versions if v not in versions)
        out = []
        for group, versions in sorted(groups.items()):
            gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            out.append({"name": group, "versions": gvs, "preferredVersion": gvs[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": out}

    def _resource_list(self, group: str, version: str) -> Obj:
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        resources: list[Obj] = []
        for (g, _), rt in sorted(self._store.types.items()):
            if g != group or version not in rt.versions:
                continue
            resources.append(
                {
                    "name": rt.plural,
                    "singularName": rt.singular,
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                    "verbs": verbs,
                    **({"shortNames": rt.short_names} if rt.short_names else {}),
                }
            )
            subs = (["status"] if rt.status_subresource else []) + {
                "pods": ["log"],
                "services": ["proxy"],
            }.get(rt.plural, [])
            for sub in subs:
                sub_verbs = (
                    ["get", "patch", "update"]
                    if sub == "status"
                    else ["get", "create", "delete", "patch", "update"]
                )
                resources.append(
                    {
                        "name": f"{rt.plural}/{sub}",
                        "singularName": "",
                        "namespaced": rt.namespaced,
                        "kind": rt.kind,
                        "verbs": sub_verbs,
                    }
                )
        gv = f"{group}/{version}" if group else version
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": resources,
        }

    # reads ---------
    def _render(self, rt: ResourceType, obj: Obj, version: str) -> Obj:
        return {**obj, "apiVersion": rt.api_version(version), "kind": rt.kind}

    def _matcher(self, rt: ResourceType, query: dict[str, str]) -> Callable[[Obj], bool]:
        supported = {"metadata.name", "metadata.namespace"}
        if rt.plural == "pods":
            supported |= {
                "status.phase",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.serviceAccountName",
            }
        if rt.plural == "secrets":
            supported.add("type")
        labels = label_matcher(query.get("labelSelector"))
        fields = field_matcher(query.get("fieldSelector"), supported)
        return lambda obj: labels(obj) and fields(obj)

    async def _list(self, route: _Route, query: dict[str, str]) -> web.StreamResponse:
        rt = route.rt
        match = self._matcher(rt, query)
        items, rv = self._store.list(rt, route.namespace or None)
        items = [self._render(rt, o, route.version) for o in items if match(o)]
        list_meta: Obj = {"resourceVersion": str(rv)}
        start = 0
        if token := query.get("continue"):
            try:
                start = int(json.loads(base64.b64decode(token))["start"])
            except (ValueError, KeyError, TypeError) as exc:
                raise errors.bad_request("continue key is not valid") from exc
        limit = int(query.get("limit") or 0)
        page = items[start : start + limit] if limit else items[start:]
        if limit and start + limit < len(items):
            list_meta["continue"] = base64.b64encode(
                json.dumps({"start": start + limit}).encode()
            ).decode()
            list_meta["remainingItemCount"] = len(items) - start - limit
        return _json(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version(route.version),
                "metadata": list_meta,
                "items": page,
            }
        )

    async def _watch(
        self, request: web.Request, route: _Route, query: dict[str, str]
    ) -> web.StreamResponse:
        rt = route.rt
        match = self._matcher(rt, query)
        raw_rv = query.get("resourceVersion") or "0"
        try:
            since = int(raw_rv)
        except ValueError as exc:
            raise errors.bad_request(f'invalid resource version: "{raw_rv}"') from exc
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        assert self._server.loop is not None
        watcher = Watcher(self._server.loop, (rt.group, rt.plural), route.namespace or None, match)
        initial: list[Obj] = []
        with self._store.lock:
            if not since:
                items, _ = self._store.list(rt, route.namespace or None)
                initial = [
                    {"type": "ADDED", "object": self._render(rt, o, route.version)}
                    for o in items
                    if match(o)
                ]
                self._store.watchers.add(watcher)
            else:
                try:
                    events = self._store.events_after((rt.group, rt.plural), since)
                except ApiError as expired:  # the real server streams it as an ERROR event
                    initial.append({"type": "ERROR", "object": expired.status()})
                else:
                    self._store.watchers.add(watcher)
                    for event in events:
                        if seen := watcher.translate(event):
                            initial.append(
                                {"type": seen, "object": self._render(rt, event.new, route.version)}
                            )
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            for line in initial:
                await resp.write(json.dumps(line).encode() + b"\n")
            if initial and initial[0]["type"] == "ERROR":
                await resp.write_eof()
                return resp
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                if item is _STOP:
                    break
                if isinstance(item, bytes):  # inject_watch_event
                    await resp.write(item)
                    continue
                if item is _DROP:
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                assert isinstance(item, Event)
                seen = watcher.translate(item)
                if seen:
                    line = {"type": seen, "object": self._render(rt, item.new, route.version)}
                    await resp.write(json.dumps(line).encode() + b"\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with self._store.lock:
                self._store.watchers.discard(watcher)
        return resp

    # writes ---------
    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            if request.content_type == patches.APPLY or request.content_type.endswith("yaml"):
                return yaml.safe_load(raw)
            return json.loads(raw) if raw else None
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(
                f"the body of the request could not be decoded: {exc}"
            ) from exc

    def _check_custom(
        self, route: _Route, obj: Obj, old: Obj | None, mode: str, verb: str
    ) -> list[str]:
        """Default, prune and validate a custom resource in place (its schema, then its CEL
        rules, the transition rules against `old`); returns Warning texts. Unknown fields are
        dropped: with a warning for `Warn` (the default), silently for `Ignore`; `Strict`
        refuses them, a create or update with 400, a patch with 422 (kube-apiserver's
        wording for each)."""
        rt = route.rt
        schema = rt.schemas.get(route.version)
        if schema is None:
            return []
        as_sent = copy.deepcopy(obj) if mode == "Strict" and verb == "patch" else None
        unknown = schema.default_and_prune(obj, prune=True)
        problems = [f'unknown field "{p}"' for p in unknown]
        if problems and mode == "Strict":
            if as_sent is not None:
                raise errors.strict_patch(as_sent, problems)
            raise errors.strict_decoding(rt, route.version, problems)
        warnings = problems if mode == "Warn" else []
        causes = schema.validate(obj)
        causes += schema.validate_rules(obj, old, causes)
        if causes:
            error = errors.invalid(rt, (obj.get("metadata") or {}).get("name") or "", causes)
            if warnings:  # the real server warns on a refused write too
                error.headers["Warning"] = _warning_header(warnings)
            raise error
        return warnings

    def _prepare(
        self, route: _Route, body: Any, query: dict[str, str], *, verb: str,
        old: Obj | None = None, status_view: bool = False,
    ) -> tuple[Obj, list[str]]:  # fmt: skip
        """Typed body ready for the store: apiVersion/kind set; custom resources checked (a
        `verb` of create, update or patch; `old` the object an update changes), quantities of
        built-in types canonical."""
        rt = route.rt
        mode = query.get("fieldValidation", "")
        if mode not in _FIELD_VALIDATION:
            raise errors.options_invalid(_OPTIONS[verb], Cause(
                "FieldValueNotSupported", "fieldValidation",
                f"Unsupported value: {json.dumps(mode)}: supported values: "
                + ", ".join(json.dumps(m) for m in _FIELD_VALIDATION),
            ))  # fmt: skip
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request was in an unknown format")
        body = copy.deepcopy(body)
        body["apiVersion"] = rt.api_version(route.version)
        body["kind"] = rt.kind
        body.setdefault("metadata", {})
        warnings: list[str] = []
        if rt.crd is not None:
            view, old_view = body, old
            if rt.status_subresource and not status_view:
                view = {k: v for k, v in body.items() if k != "status"}
                old_view = {k: v for k, v in old.items() if k != "status"} if old else None
            warnings = self._check_custom(route, view, old_view, mode or "Warn", verb)
            if view is not body:
                view.update({k: v for k, v in body.items() if k == "status"})
                body = view
        else:
            try:
                quantity.canonicalize(rt.plural, body)
            except quantity.QuantityError as exc:
                raise errors.bad_request(
                    f'{rt.kind} in version "{route.version}" cannot be handled as a {rt.kind}: '
                    f"{exc}"
                ) from exc
        return body, warnings

    async def _create(
        self, request: web.Request, route: _Route, query: dict[str, str]
    ) -> web.StreamResponse:
        rt = route.rt
        body = await self._body(request)
        if isinstance(body, dict) and isinstance(body.get("metadata"), dict):
            generate_name(body["metadata"])
        body, warnings = self._prepare(route, body, query, verb="create")
        if rt.status_subresource and rt.crd is not None:
            body.pop("status", None)  # create ignores status when it is a subresource
        created = self._store.create(
            rt, route.namespace, body, dry_run=_dry_run(query),
            write=self._writer(request, route, query, "Update"),
        )  # fmt: skip
        if rt is _CRD_TYPE and not _dry_run(query):
            created = self._install_crd(created)
        return _json(self._render(rt, created, route.version), 201, warnings)

    async def _replace(
        self, request: web.Request, route: _Route, query: dict[str, str]
    ) -> web.StreamResponse:
        status = route.sub == ["status"]
        body = await self._body(request)
        current = self._store.get(route.rt, route.namespace, route.name)
        if status and isinstance(body, dict):
            body = self._status_merge(route, body)
        old = self._render(route.rt, current, route.version) if current is not None else None
        body, warnings = self._prepare(route, body, query, verb="update", old=old,
                                       status_view=status)  # fmt: skip
        updated = self._store.update(
            route.rt, route.namespace, route.name, body, status=status, dry_run=_dry_run(query),
            write=self._writer(request, route, query, "Update"),
        )  # fmt: skip
        return _json(self._render(route.rt, updated, route.version), 200, warnings)

    def _writer(
        self, request: web.Request, route: _Route, query: dict[str, str], operation: str,
        applied: Any = None,
    ) -> fields.Write:  # fmt: skip
        """Who this write is for managedFields: `fieldManager`, else (not for apply, which
        requires it) the User-Agent's product, as the real server defaults it."""
        manager = query.get("fieldManager") or request.headers.get("User-Agent", "").split("/")[0]
        return fields.Write(
            manager=manager[:128], operation=operation,
            api_version=route.rt.api_version(route.version),
            subresource="status" if route.sub == ["status"] else "",
            applied=copy.deepcopy(applied) if isinstance(applied, dict) else None,
        )  # fmt: skip

    def _status_merge(self, route: _Route, body: Obj) -> Obj:
        """What a status write produces: the current object with the new status and the sent rv."""
        current = self._store.require(route.rt, route.namespace, route.name)
        merged = copy.deepcopy(current)
        if "status" in body:
            merged["status"] = body["status"]
        else:
            merged.pop("status", None)
        merged["metadata"]["resourceVersion"] = (body.get("metadata") or {}).get(
            "resourceVersion"
        ) or ""
        return merged

    async def _patch(
        self, request: web.Request, route: _Route, query: dict[str, str]
    ) -> web.StreamResponse:
        rt = route.rt
        ctype = request.content_type
        body = await self._body(request)
        status = route.sub == ["status"]
        current = self._store.get(rt, route.namespace, route.name)
        apply = ctype == patches.APPLY
        _check_patch_options(query, apply)
        write = self._writer(request, route, query, "Apply" if apply else "Update", body)
        if apply and isinstance(body, dict) and (schema := rt.schemas.get(route.version)):
            if undeclared := schema.applied_unknown_fields(body):
                raise errors.apply_undeclared(body, rt.api_version(route.version), rt.kind,
                                              undeclared)  # fmt: skip
        if apply and current is None and not status:
            return await self._create_from(route, body, query, write)
        if current is None:
            raise errors.not_found(rt, route.name)
        current = self._render(rt, current, route.version)
        entries = current["metadata"].get("managedFields") or []
        if apply and not _flag(query.get("force")):
            if found := fields.conflicts(entries, write, current, rt.status_subresource):
                raise errors.apply_conflict(found)
        try:
            if apply:
                merged = patches.merge_patch(current, body)
                patched = fields.release(merged, entries, write, rt.status_subresource)
            elif ctype == patches.MERGE:
                patched = patches.merge_patch(current, body)
            elif ctype == patches.JSON_PATCH:
                patched = patches.json_patch(current, body)
            elif ctype == patches.STRATEGIC:
                if rt.crd is not None:
                    raise errors.unsupported_patch()
                patched = patches.strategic_merge(current, body)
            else:
                raise errors.unsupported_patch()
        except patches.PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        if not isinstance(patched, dict):
            raise errors.bad_request("the patch did not produce an object")
        if status:
            keep_rv = (patched.get("metadata") or {}).get("resourceVersion")
            patched = self._status_merge(route, patched)
            patched["metadata"]["resourceVersion"] = keep_rv or ""
        body, warnings = self._prepare(route, patched, query, verb="patch", old=current,
                                       status_view=status)  # fmt: skip
        updated = self._store.update(
            rt, route.namespace, route.name, body, status=status, dry_run=_dry_run(query),
            write=write,
        )  # fmt: skip
        return _json(self._render(rt, updated, route.version), 200, warnings)

    async def _create_from(
        self, route: _Route, body: Any, query: dict[str, str], write: fields.Write
    ) -> web.StreamResponse:
        if isinstance(body, dict):
            body.setdefault("metadata", {})["name"] = route.name
        prepared, warnings = self._prepare(route, body, query, verb="patch")
        if route.rt.status_subresource and route.rt.crd is not None:
            prepared.pop("status", None)
        created = self._store.create(
            route.rt, route.namespace, prepared, dry_run=_dry_run(query), write=write
        )
        return _json(self._render(route.rt, created, route.version), 201, warnings)

    async def _delete(
        self, request: web.Request, route: _Route, query: dict[str, str]
    ) -> web.StreamResponse:
        rt = route.rt
        options = {}
        if request.can_read_body:
            body = await self._body(request)
            options = body if isinstance(body, dict) else {}
        policy = query.get("propagationPolicy") or options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise errors.bad_request(f'unsupported propagationPolicy "{policy}"')
        preconditions = options.get("preconditions") or {}
        current = self._store.require(rt, route.namespace, route.name)
        if preconditions.get("uid") and preconditions["uid"] != current["metadata"]["uid"]:
            raise errors.conflict(rt, route.name)
        if (
            preconditions.get("resourceVersion")
            and preconditions["resourceVersion"] != current["metadata"]["resourceVersion"]
        ):
            raise errors.conflict(rt, route.name)
        obj, gone = self._store.delete(
            rt, route.namespace, route.name, policy=policy, dry_run=_dry_run(query)
        )
        # like the real registries: these kinds answer a Status once gone, the others the object
        if gone and rt.group == "" and rt.plural in ("configmaps", "secrets", "events"):
            details: Obj = {"name": route.name, "kind": rt.plural, "uid": obj["metadata"]["uid"]}
            if rt.group:
                details["group"] = rt.group
            return _json(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": details,
                }
            )
        return _json(self._render(rt, obj, route.version), 200)

    async def _delete_collection(self, route: _Route, query: dict[str, str]) -> web.StreamResponse:
        rt = route.rt
        match = self._matcher(rt, query)
        items, _ = self._store.list(rt, route.namespace or None)
        deleted = []
        for obj in items:
            if match(obj):
                md = obj["metadata"]
                with contextlib.suppress(ApiError):
                    deleted.append(
                        self._store.delete(
                            rt,
                            md.get("namespace", ""),
                            md["name"],
                            policy=query.get("propagationPolicy"),
                        )[0]
                    )
        return _json(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version(route.version),
                "metadata": {},
                "items": deleted,
            }
        )

    # pods/log ---------
    async def _pod_log(
        self, request: web.Request, route: _Route, query: dict[str, str]
    ) -> web.StreamResponse:
        pod = self._store.require(route.rt, route.namespace, route.name)
        names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        container = query.get("container")
        if container and container not in names:
            raise errors.bad_request(f"container {container} is not valid for pod {route.name}")
        if not container and len(names) > 1:
            raise errors.bad_request(
                f"a container name must be specified for pod {route.name}, "
                f"choose one of: [{' '.join(names)}]"
            )
        container = container or (names[0] if names else None)

        def read() -> str:
            source = self._logs.get((route.namespace, route.name, container))
            if source is None:
                source = self._logs.get((route.namespace, route.name, None), "")
            return source() if callable(source) else source

        text = await asyncio.get_running_loop().run_in_executor(None, read)
        if query.get("tailLines"):
            lines = text.splitlines(keepends=True)
            n = int(query["tailLines"])
            text = "".join(lines[-n:]) if n > 0 else ""
        if not _flag(query.get("follow")):
            return web.Response(body=text.encode(), content_type="text/plain")
        # follow: stream what appears until the pod is gone or finished, or the client leaves
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        sent = text
        try:
            await resp.write(text.encode())
            while True:
                await asyncio.sleep(0.2)
                full = await asyncio.get_running_loop().run_in_executor(None, read)
                if full.startswith(sent) and len(full) > len(sent):
                    await resp.write(full[len(sent) :].encode())
                sent = full if full.startswith(sent) else sent
                pod_now = self._store.get(route.rt, route.namespace, route.name)
                if pod_now is None or (pod_now.get("status") or {}).get("phase") in (
                    "Succeeded",
                    "Failed",
                ):
                    break
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    # services/proxy ---------
    async def _proxy(self, request: web.Request, route: _Route) -> web.StreamResponse:
        service_name, _, port_part = route.name.partition(":")
        # the scheme prefix form "https:name:port" is rare: treat "name:port" and "name" only
        svc = self._store.get(route.rt, route.namespace, service_name)
        if svc is None:
            raise errors.not_found(route.rt, service_name)
        ports = (svc.get("spec") or {}).get("ports") or []
        chosen: Obj | None = None
        if not port_part:
            chosen = ports[0] if ports else None
        else:
            chosen = next(
                (p for p in ports if port_part in (str(p.get("port")), p.get("name"))), None
            )
            if chosen is None:
                raise errors.service_unavailable(
                    f'no service port "{port_part}" found for service "{service_name}"'
                )
        keys = {port_part} | (
            {str(chosen.get("port")), chosen.get("name") or ""} if chosen else set()
        )
        target = next(
            (
                self._proxies[(route.namespace, service_name, k)]
                for k in keys
                if (route.namespace, service_name, k) in self._proxies
            ),
            None,
        )
        if target is None:
            raise errors.service_unavailable(f'no endpoints available for service "{service_name}"')
        # a trailing slash is part of the upstream path (Ray serves POST /api/jobs/ only)
        rest = "/" + "/".join(route.sub[1:])
        if request.raw_path.split("?", 1)[0].endswith("/") and rest != "/":
            rest += "/"
        path = rest
        if request.query_string:
            path += "?" + request.query_string
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        if callable(target):
            body = await request.read()
            loop = asyncio.get_running_loop()
            code, out_headers, out_body = await loop.run_in_executor(
                None, target, request.method, path, headers, body
            )
            return web.Response(status=code, headers=out_headers, body=out_body)
        # re-encode what the path decoding turned into reserved characters (a "?" sent as %3F)
        url = target.rstrip("/") + quote(rest, safe="/:@!$&'()*+,;=-._~")
        if request.query_string:
            url += "?" + request.query_string
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._proxy_websocket(request, url, headers)
        assert self._session is not None
        try:
            async with self._session.request(
                request.method,
                url,
                headers=headers,
                data=await request.read(),
                allow_redirects=False,
            ) as upstream:
                out = await upstream.read()
                out_headers = {
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
                }
                return web.Response(status=upstream.status, headers=out_headers, body=out)
        except aiohttp.ClientConnectorError as exc:
            raise _unreachable(url, exc) from exc

    async def _proxy_websocket(
        self, request: web.Request, url: str, headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self._session is not None
        protocols = [
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip()
        ]
        fwd = {k: v for k, v in headers.items() if k.lower() not in _WS_HEADERS}
        try:
            upstream = await self._session.ws_connect(
                url.replace("http", "ws", 1), headers=fwd, protocols=protocols
            )
        except aiohttp.ClientConnectorError as exc:
            raise _unreachable(url, exc) from exc
        except aiohttp.WSServerHandshakeError as exc:
            return web.Response(status=exc.status, text=exc.message)
        downstream = web.WebSocketResponse(protocols=protocols)
        await downstream.prepare(request)

        async def pump(src: Any, dst: Any) -> None:
            async for msg in src:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await dst.send_bytes(msg.data)
                else:
                    break

        tasks = [
            asyncio.create_task(pump(upstream, downstream)),
            asyncio.create_task(pump(downstream, upstream)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await upstream.close()
            await downstream.close()
        return downstream


def _unreachable(url: str, exc: Exception) -> ApiError:
    from yarl import URL

    parsed = URL(url)
    return errors.service_unavailable(
        f"error trying to reach service: dial tcp {parsed.host}:{parsed.port}: connect: "
        "connection refused"
        if "refused" in str(exc).lower() or isinstance(exc, aiohttp.ClientConnectorError)
        else f"error trying to reach service: {exc}"
    )


def _page_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def _check_patch_options(query: dict[str, str], apply: bool) -> None:
    """PatchOptions as the real server validates them: apply needs a fieldManager, and only
    apply may say force."""
    cause = None
    if apply and not query.get("fieldManager"):
        cause = Cause(
            "FieldValueRequired", "fieldManager", "Required value: is required for apply patch"
        )
    elif not apply and "force" in query:
        cause = Cause(
            "FieldValueForbidden", "force", "Forbidden: may not be specified for non-apply patch"
        )
    if cause is not None:
        raise errors.options_invalid("PatchOptions", cause)


def _dry_run(query: dict[str, str]) -> bool:
    return query.get("dryRun") == "All"


def _warning_header(warnings: list[str]) -> str:
    """Warnings as one Warning header (the same as several, once a client joins them)."""
    return ", ".join(f'299 - "{w.replace(chr(34), chr(92) + chr(34))}"' for w in warnings)


def _json(body: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    headers = {}
    if warnings:
        headers["Warning"] = _warning_header(warnings)
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )


def _status_response(exc: ApiError) -> web.Response:
    response = _json(exc.status(), exc.code)
    response.headers.update(exc.headers)
    return response
