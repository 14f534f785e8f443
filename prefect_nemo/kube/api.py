"""KubeApi: one small, dict-in/dict-out layer over the official client for every kind we manage.

Built on `kubernetes.dynamic.DynamicClient` (the client's own generic layer, kept working across
client versions) with a static resource table instead of discovery: no discovery requests and no
discovery cache file on disk. Errors become prefect-nemo errors that say what failed and why.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Iterator
from functools import cached_property
from typing import Any, cast

import urllib3
from kubernetes import watch as k8s_watch
from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError
from kubernetes.dynamic.resource import Resource

from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    InvalidJobSpec,
    PrefectNemoError,
    Throttled,
)
from prefect_nemo.kube.kinds import POD, Kind
from prefect_nemo.names import check_namespace, secret_hash

_TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)
# kube-apiserver's default is Warn: an unknown field (a typo in a RayCluster spec) would be
# dropped with only a Warning header; Strict makes it a 400 naming the field
STRICT = "Strict"


class KubeError(PrefectNemoError):
    """The API server answered with an error Status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class NotFound(KubeError):
    """404: the object (or its kind, when the CRD is not installed) does not exist."""


class AlreadyExists(KubeError):
    """409 AlreadyExists: an object with that name exists."""


class Conflict(KubeError):
    """409 Conflict: the object changed since we read it (stale resourceVersion)."""


class Invalid(KubeError, InvalidJobSpec):
    """422 Invalid or 400 BadRequest: the manifest was rejected; the message names the field."""


class Expired(KubeError):
    """410 Gone: a watch asked for a resourceVersion the server no longer has; list again."""


class Forbidden(AuthenticationFailed):
    """403: our credentials are valid but RBAC does not allow this verb on this resource."""


class _StaticResources:
    """Stands in for DynamicClient's discoverer: our Kind table is the whole truth."""

    def __init__(self, client: DynamicClient, cache_file: str | None) -> None:
        self.client = client

    @property
    def version(self) -> dict[str, Any]:
        return {}

    def get(self, **kwargs: Any) -> Resource:
        raise NotImplementedError("KubeApi builds resources from prefect_nemo.kube.kinds")


class _DynamicClient(DynamicClient):
    """DynamicClient that passes `field_validation` on (it drops the parameter itself)."""

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        if validation := params.pop("field_validation", None):
            # our writes send no other query parameter: the path can carry this one alone
            path = f"{path}?fieldValidation={validation}"
        return super().request(method, path, body=body, **params)


def _status_of(exc: ApiException | DynamicApiError) -> tuple[int, str, str]:
    """(code, reason, message) of an error response, from its Status body when there is one."""
    code = int(getattr(exc, "status", 0) or 0)
    body = getattr(exc, "body", None)
    reason, message = str(getattr(exc, "reason", "") or ""), ""
    try:
        status = json.loads(body) if body else {}
        if isinstance(status, dict):
            reason = status.get("reason") or reason
            message = status.get("message") or ""
    except ValueError:
        message = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    return code, reason, message or reason or f"HTTP {code}"


class KubeApi:
    """Get, list, create, replace, patch, delete and watch any known Kind, as plain dicts."""

    def __init__(
        self,
        api_client: ApiClient,
        *,
        namespace: str = "default",
        request_timeout_s: float = 30.0,
        credentials: str = "the kubeconfig",
    ) -> None:
        self.api_client = api_client
        self.namespace = check_namespace(namespace)
        self.request_timeout_s = request_timeout_s
        # where the credentials come from (a block and its field), for 401/403 messages; never
        # the credentials themselves
        self.credentials = credentials
        # DynamicClient.__init__ has no annotations (the option untyped_calls_exclude does not
        # reach a subclass's constructor)
        self._dyn = _DynamicClient(api_client, discoverer=_StaticResources)  # type: ignore[no-untyped-call]
        self._resources: dict[tuple[Kind, str | None], Resource] = {}

    # -- identity and credentials ------------------------------------------------------------

    @property
    def host(self) -> str:
        """The API server's base URL."""
        host: str = self.api_client.configuration.host
        return host.rstrip("/")

    def auth_headers(self) -> dict[str, str]:
        """The Authorization header this client sends (a secret: for clients that go through
        the API server's service proxy, e.g. Ray's job client)."""
        config = self.api_client.configuration
        token = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix(
            "authorization"
        )
        return {"Authorization": token} if token else {}

    @cached_property
    def credentials_key(self) -> str:
        """The Authorization header and the client certificate's files as the client was made,
        hashed (the client writes a kubeconfig's certificate data to one file per content; a
        token an exec plugin refreshes later keeps the key)."""
        config = self.api_client.configuration
        parts = [*self.auth_headers().values(), config.cert_file or "", config.key_file or ""]
        return secret_hash(*parts)

    @property
    def secrets(self) -> list[str]:
        """Secret values of these credentials, for redaction."""
        values = [v for v in self.auth_headers().values() if v]
        return values + [v.split(" ", 1)[1] for v in values if " " in v]

    # -- CRUD -----------------------------------------------------------------------------------

    def get(self, kind: Kind, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return self._json(
                self._call(
                    kind,
                    name,
                    "get",
                    self._resource(kind).get,
                    name=name,
                    namespace=self._ns(kind, namespace),
                )
            )
        except NotFound:
            return None

    def list(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        all_namespaces: bool = False,
    ) -> tuple[list[dict[str, Any]], str]:
        """The matching objects (in every namespace with `all_namespaces`) and the list's
        resourceVersion (to watch from)."""
        body = self._json(
            self._call(
                kind,
                "",
                "list",
                self._resource(kind).get,
                namespace=None if all_namespaces else self._ns(kind, namespace),
                label_selector=label_selector,
                field_selector=field_selector,
                limit=limit,
            )
        )
        items = body.get("items") or []
        for item in items:  # lists leave out kind/apiVersion on items; put them back
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items, str(body.get("metadata", {}).get("resourceVersion", ""))

    def create(
        self, kind: Kind, obj: dict[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """Create the object; AlreadyExists if the name is taken, Invalid if it is rejected."""
        name = obj.get("metadata", {}).get("name", "")
        return self._json(
            self._call(
                kind,
                name,
                "create",
                self._resource(kind).create,
                body=obj,
                namespace=self._ns(kind, namespace, obj),
                field_validation=STRICT,
            )
        )

    def replace(
        self, kind: Kind, obj: dict[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """Replace the object; Conflict if its resourceVersion is stale."""
        name = obj["metadata"]["name"]
        return self._json(
            self._call(
                kind,
                name,
                "replace",
                self._resource(kind).replace,
                body=obj,
                name=name,
                namespace=self._ns(kind, namespace, obj),
                field_validation=STRICT,
            )
        )

    def patch(
        self,
        kind: Kind,
        name: str,
        # `builtins.list`: the method `list` above shadows the type in this class
        patch: dict[str, Any] | builtins.list[dict[str, Any]],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """A merge patch (dict) or JSON patch (list) of the object or of its subresource."""
        content_type = (
            "application/json-patch+json" if isinstance(patch, list)
            else "application/merge-patch+json"
        )  # fmt: skip
        resource = self._resource(kind, subresource)
        return self._json(
            self._call(
                kind,
                name,
                "patch",
                resource.patch,
                body=patch,
                name=name,
                namespace=self._ns(kind, namespace),
                content_type=content_type,
                field_validation=STRICT,
            )
        )

    def delete(
        self,
        kind: Kind,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str = "Background",
        resource_version: str | None = None,
    ) -> bool:
        """Ask for deletion with the given propagation policy; False if it was already gone.
        With `resource_version`, only that version is deleted (Conflict if it changed)."""
        precondition = {"resourceVersion": resource_version} if resource_version else None
        body = {"preconditions": precondition} if precondition else None
        try:
            self._call(
                kind,
                name,
                "delete",
                self._resource(kind).delete,
                name=name,
                namespace=self._ns(kind, namespace),
                body=body,
                propagation_policy=propagation,
            )
        except NotFound:
            return False
        return True

    def watch(
        self,
        kind: Kind,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
        timeout_s: int = 60,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watcher: k8s_watch.Watch | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Stream (type, object) events until the server ends the stream (after timeout_s) or
        `watcher.stop()` is called (from any thread: it unblocks the read at once).

        Raises Expired (410) when resource_version is too old: list again and watch from there.
        """
        stream = (watcher or k8s_watch.Watch()).stream(
            self._resource(kind).get,
            namespace=self._ns(kind, namespace),
            label_selector=label_selector,
            field_selector=field_selector,
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            allow_watch_bookmarks=True,
            serialize=False,
            # a silent, half-dead connection must not block forever: read timeout past the
            # server's own end of stream
            _request_timeout=(self.request_timeout_s, timeout_s + self.request_timeout_s),
        )
        try:
            for event in stream:
                if event["type"] != "BOOKMARK":
                    yield event["type"], event["raw_object"]
        except (ApiException, DynamicApiError) as exc:
            raise self._error(exc, kind, "", "watch") from None
        except _TRANSPORT_ERRORS as exc:
            raise BackendUnavailable(f"watching {kind.describe()} at {self.host}: {exc}") from None

    def pod_log(
        self, name: str, namespace: str | None = None, *, container: str | None = None
    ) -> str:
        """A pod's whole log; "" while its container has not started (the server answers 400).
        NotFound when the pod is gone."""
        core = CoreV1Api(self.api_client)
        try:
            # with _preload_content=False the client returns the raw HTTP response, not the str
            # its annotation names; a string, since urllib3 1.26 (the nemo-run set) lacks the name
            resp = cast(
                "urllib3.BaseHTTPResponse",
                core.read_namespaced_pod_log(
                    name, self._namespace(namespace), container=container,
                    _request_timeout=self.request_timeout_s, _preload_content=False,
                ),
            )  # fmt: skip
        except (ApiException, DynamicApiError) as exc:
            if getattr(exc, "status", 0) == 400:
                return ""
            raise self._error(exc, POD, name, "read the log of") from None
        except _TRANSPORT_ERRORS as exc:
            raise BackendUnavailable(
                f"reading the log of pod {name} at {self.host}: {exc}"
            ) from None
        return resp.data.decode(errors="replace")

    # -- service proxy ---------------------------------------------------------------------------

    def proxy_url(self, namespace: str, service: str, port: int | str) -> str:
        """Base URL of a Service port through the API server's service proxy."""
        namespace = check_namespace(namespace)
        return f"{self.host}/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy"

    def proxy(
        self,
        namespace: str,
        service: str,
        port: int | str,
        path: str = "/",
        *,
        method: str = "GET",
        timeout_s: float = 5.0,
    ) -> tuple[int, bytes]:
        """One HTTP request through the service proxy: (status, body); (0, b"") when the API
        server itself cannot be reached. Error statuses are returned, not raised."""
        namespace = check_namespace(namespace)
        url = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy/{path.lstrip('/')}"
        try:
            resp = self._dyn.request(
                method,
                url,
                serialize=False,
                _request_timeout=timeout_s,
                header_params={"Accept": "*/*"},
            )
        except (ApiException, DynamicApiError) as exc:
            body = getattr(exc, "body", b"") or b""
            return int(getattr(exc, "status", 0) or 0), body if isinstance(body, bytes) else str(
                body
            ).encode()
        except _TRANSPORT_ERRORS:
            return 0, b""
        return resp.status, resp.data

    def get_path(self, path: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """GET an API path that no Kind describes (an aggregated API's subresource): its JSON
        body, or None when it is not served, not allowed or not reachable (callers fall back)."""
        try:
            resp = self._dyn.request(
                "GET", path, serialize=False, _request_timeout=timeout_s,
                header_params={"Accept": "application/json"},
            )  # fmt: skip
            body = json.loads(resp.data)
        except (ApiException, DynamicApiError, ValueError, *_TRANSPORT_ERRORS):
            return None
        return body if isinstance(body, dict) else None

    # -- internals -------------------------------------------------------------------------------

    def _ns(
        self, kind: Kind, namespace: str | None, obj: dict[str, Any] | None = None
    ) -> str | None:
        """The namespace a request goes to, checked (every request passes here)."""
        return self._namespace(namespace, obj) if kind.namespaced else None

    def _namespace(self, namespace: str | None, obj: dict[str, Any] | None = None) -> str:
        """The namespace of a request for a namespaced kind, checked."""
        chosen = namespace or (obj or {}).get("metadata", {}).get("namespace") or self.namespace
        return check_namespace(chosen)

    def _resource(self, kind: Kind, subresource: str | None = None) -> Resource:
        key = (kind, subresource)
        if key not in self._resources:
            base = Resource(
                prefix="api" if not kind.group else "apis",
                group=kind.group or None,
                api_version=kind.version,
                kind=kind.kind,
                namespaced=kind.namespaced,
                name=kind.plural,
                client=self._dyn,
                subresources={
                    "status": {
                        "kind": kind.kind,
                        "name": f"{kind.plural}/status",
                        "namespaced": kind.namespaced,
                    }
                }
                if kind.status_subresource
                else None,
            )
            self._resources[key] = base.subresources[subresource] if subresource else base
        return self._resources[key]

    def _call(self, kind: Kind, name: str, verb: str, fn: Any, /, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", self.request_timeout_s)
        try:
            return fn(serialize=False, **kwargs)
        except (ApiException, DynamicApiError) as exc:
            raise self._error(exc, kind, name, verb) from None
        except _TRANSPORT_ERRORS as exc:
            raise BackendUnavailable(
                f"cannot reach the Kubernetes API at {self.host} ({verb} "
                f"{kind.describe(name)}): {exc}"
            ) from None

    def _error(
        self, exc: ApiException | DynamicApiError, kind: Kind, name: str, verb: str
    ) -> Exception:
        code, reason, message = _status_of(exc)
        what = kind.describe(name)
        if code == 401:
            return AuthenticationFailed(
                f"the Kubernetes API at {self.host} rejected our credentials ({verb} {what}): "
                f"{message}; fix the token or client certificate in {self.credentials}"
            )
        if code == 403:
            return Forbidden(
                f"not allowed to {verb} {what}: {message}; grant the account of "
                f"{self.credentials} this verb on this resource (RBAC)"
            )
        if code == 404:
            return NotFound(code, reason, message)
        if code == 409:
            cls = AlreadyExists if reason == "AlreadyExists" else Conflict
            return cls(code, reason, message)
        if code == 410:
            return Expired(code, reason, message)
        if code in (400, 422):
            return Invalid(code, reason, f"the API server rejected {what}: {message}")
        if code in (429, 503):  # the API server's own backpressure (APF, overload)
            return Throttled(
                f"the Kubernetes API pushed back on {verb} {what} ({code}): {message}",
                _retry_after(exc),
            )
        if code >= 500:
            return BackendUnavailable(f"the Kubernetes API failed to {verb} {what}: {message}")
        return KubeError(code, reason, f"{verb} {what}: {message}")

    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        return json.loads(resp.data) if resp is not None else {}


def _retry_after(exc: Any) -> float | None:
    """The Retry-After seconds of a 429/503 answer, if it gave them."""
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
