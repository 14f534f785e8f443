"""Status bodies with the apiserver's reasons and message texts."""

from __future__ import annotations

import json
from typing import Any

from prefect_nemo.testing.kube_api.schema import Cause, ResourceType


class ApiError(Exception):
    """An error the server answers with a `kind: Status` body."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers: dict[str, str] = {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if not self.reason:  # an internal error has none (Go's omitempty)
            del body["reason"]
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": rt.plural}
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.group_resource} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists', _details(rt, name)
    )


def conflict(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": the object has been '
        "modified; "
        "please apply your changes to the latest version and try again",
        _details(rt, name),
    )


def invalid(rt: ResourceType, name: str, causes: list[Cause]) -> ApiError:
    texts = [c.text() for c in causes]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    # empty name, group and kind are left out, as Go's omitempty does
    details: dict[str, Any] = {k: v for k, v in (("name", name), ("kind", rt.kind)) if v}
    if rt.group:
        details["group"] = rt.group
    details["causes"] = [
        {"reason": c.reason, "message": c.message, "field": c.field} for c in causes
    ]
    return ApiError(422, "Invalid", f'{rt.qualified_kind} "{name}" is invalid: {joined}', details)


def options_invalid(options: str, cause: Cause) -> ApiError:
    """422 for a bad query parameter of a write: `options` is CreateOptions, UpdateOptions or
    PatchOptions."""
    rt = ResourceType("meta.k8s.io", ["v1"], options.lower(), options.lower(), options, False)
    return invalid(rt, "", [cause])


def strict_decoding(rt: ResourceType, version: str, problems: list[str]) -> ApiError:
    """What fieldValidation=Strict answers a create or update with unknown fields: 400."""
    return bad_request(
        f'{rt.kind} in version "{version}" cannot be handled as a {rt.kind}: strict decoding '
        f"error: {', '.join(problems)}"
    )


def strict_patch(patched: Any, problems: list[str]) -> ApiError:
    """... and a JSON or merge patch: 422 for a `patch` field whose value is the patched
    object, of no kind and no name."""
    shown = json.dumps(json.dumps(patched, separators=(",", ":"), sort_keys=True))
    message = f"Invalid value: {shown}: strict decoding error: {', '.join(problems)}"
    return ApiError(
        422, "Invalid", f' "" is invalid: patch: {message}',
        {"causes": [{"reason": "FieldValueInvalid", "message": message, "field": "patch"}]},
    )  # fmt: skip


def apply_undeclared(obj: Any, api_version: str, kind: str, paths: list[str]) -> ApiError:
    """A server-side apply of undeclared fields: 500, whatever fieldValidation says (the
    field manager cannot type the applied configuration)."""
    meta = (obj.get("metadata") if isinstance(obj, dict) else None) or {}
    problems = [f"{p}: field not declared in schema" for p in paths]
    listed = problems[0] if len(problems) == 1 else "errors:\n  " + "\n  ".join(problems)
    return ApiError(
        500, "",
        f"failed to create typed patch object ({meta.get('namespace', '')}/{meta.get('name', '')}; "
        f"{api_version}, Kind={kind}): {listed}",
    )  # fmt: skip


def apply_conflict(conflicts: list[tuple[str, str]]) -> ApiError:
    """409 for an apply that would change fields other managers own, given (manager, field)
    pairs sorted by manager, worded as kube-apiserver's field manager words it."""
    causes = [
        {"reason": "FieldManagerConflict", "message": f"conflict with {manager}", "field": path}
        for manager, path in conflicts
    ]
    if len(conflicts) == 1:
        manager, path = conflicts[0]
        message = f"Apply failed with 1 conflict: conflict with {manager}: {path}"
    else:
        lines: list[str] = []
        for manager in dict.fromkeys(m for m, _ in conflicts):
            lines.append(f"conflicts with {manager}:")
            lines += [f"- {path}" for m, path in conflicts if m == manager]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, "Conflict", message, {"causes": causes})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden(
    rt: ResourceType, verb: str, name: str, namespace: str | None, sub: str = ""
) -> ApiError:
    resource = f"{rt.plural}/{sub}" if sub else rt.plural
    who = f'{rt.group_resource} "{name}"' if name else rt.group_resource
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    return ApiError(
        403,
        "Forbidden",
        f'{who} is forbidden: User "loopback" cannot {verb} resource "{resource}" '
        f'in API group "{rt.group}" {scope}',
        _details(rt, name),
    )


def unsupported_patch() -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
    )


def method_not_allowed() -> ApiError:
    return ApiError(
        405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
    )


def service_unavailable(message: str) -> ApiError:
    return ApiError(503, "ServiceUnavailable", message)


def too_many_requests(retry_after_s: int) -> ApiError:
    """What API Priority and Fairness answers a request it rejects: 429 with Retry-After."""
    error = ApiError(
        429, "TooManyRequests", "Too many requests, please try again later.",
        {"retryAfterSeconds": retry_after_s},
    )  # fmt: skip
    error.headers["Retry-After"] = str(retry_after_s)
    return error


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def gone(requested: int, oldest: int) -> ApiError:
    """A watch from `requested`, older than the `oldest` version the server can resume from."""
    return ApiError(410, "Expired", f"too old resource version: {requested} ({oldest})")
