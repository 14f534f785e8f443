"""Resource types the server serves, and CRD openAPIV3Schema handling: defaults, pruning,
validation.

Validation goes through `jsonschema` (Draft 7) on a converted copy of each served version's
schema, compiled once per CRD version on first use; so are its `x-kubernetes-validations` (CEL
rules, `rules.py`).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from prefect_nemo.testing.kube_api.cause import Cause

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class ResourceType:
    """One kind the server serves (core type or CRD)."""

    group: str
    versions: list[str]
    plural: str
    singular: str
    kind: str
    namespaced: bool
    status_subresource: bool = False
    short_names: list[str] = field(default_factory=list)
    crd: dict[str, Any] | None = None
    schemas: dict[str, Schema] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return self.versions[0]

    def api_version(self, version: str | None = None) -> str:
        version = version or self.version
        return f"{self.group}/{version}" if self.group else version

    @property
    def group_resource(self) -> str:
        """`pods` or `rayjobs.ray.io`: how Status messages name a resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """`Pod` or `RayJob.ray.io`: how Invalid messages name a kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


def _int_or_string(_checker: Any, instance: Any) -> bool:
    return isinstance(instance, str) or (
        isinstance(instance, int) and not isinstance(instance, bool)
    )


_TYPES = jsonschema.Draft7Validator.TYPE_CHECKER.redefine("int-or-string", _int_or_string)
_Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, type_checker=_TYPES)
_JSON_TYPES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def _to_json_schema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) -> JSON Schema: nullable, int-or-string; loose formats."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if k not in ("default", "example")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)  # the CRD generator adds anyOf [integer, string]: same thing
        out["type"] = "int-or-string"
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


# ObjectMeta's fields: any other key under metadata is an unknown field
OBJECT_META = frozenset({
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
    "annotations", "ownerReferences", "finalizers", "managedFields",
})  # fmt: skip
_UNCOMPILED: Any = object()


class Schema:
    """A compiled CRD version schema."""

    def __init__(self, openapi: dict[str, Any]):
        self.raw = openapi
        # compiled on first use: most loaded versions are never written
        self._validator: Any = None
        self._rules: Any = _UNCOMPILED

    @property
    def validator(self) -> Any:
        if self._validator is None:
            self._validator = _Validator(_to_json_schema(self.raw))
        return self._validator

    @property
    def rules(self) -> Any:
        """The CEL rule tree (`rules.Node`), None when the schema has no rule."""
        if self._rules is _UNCOMPILED:
            # the CEL library is imported only when a schema has rules
            from prefect_nemo.testing.kube_api import rules

            self._rules = rules.compile_schema(self.raw)
        return self._rules

    def default_and_prune(self, obj: dict[str, Any], prune: bool) -> list[str]:
        """Apply `default:` values in place; return unknown field paths, sorted (removed when
        `prune`)."""
        unknown: list[str] = []
        props = self.raw.get("properties", {})
        for key in list(obj):
            if key in ("apiVersion", "kind"):
                continue
            if key == "metadata":
                if isinstance(meta := obj[key], dict):
                    for bad in [k for k in meta if k not in OBJECT_META]:
                        unknown.append(f"metadata.{bad}")
                        if prune:
                            del meta[bad]
            elif key in props:
                obj[key] = _walk(obj[key], props[key], key, unknown, prune)
            elif not self.raw.get("x-kubernetes-preserve-unknown-fields"):
                unknown.append(key)
                if prune:
                    del obj[key]
        _apply_defaults(obj, self.raw, skip=("metadata",))
        return sorted(unknown)

    def validate(self, obj: dict[str, Any]) -> list[Cause]:
        body = {k: v for k, v in obj.items() if k != "metadata"}
        causes = [_cause(e) for e in self.validator.iter_errors(body)]
        return sorted(causes, key=lambda c: c.field)

    def validate_rules(
        self, obj: dict[str, Any], old: dict[str, Any] | None, causes: list[Cause]
    ) -> list[Cause]:
        """The causes of failed CEL rules, after the schema's own `causes`: none are evaluated
        after an error that leaves the object mistyped (kube-apiserver then says so instead)."""
        if self.rules is None:
            return []
        from prefect_nemo.testing.kube_api import rules

        if any(c.reason in rules.BLOCKING_REASONS for c in causes):
            return [rules.NOT_CHECKED]
        return rules.validate(self.rules, obj, old)

    def applied_unknown_fields(self, obj: dict[str, Any]) -> list[str]:
        """What a server-side apply of `obj` is refused for (500, whatever fieldValidation
        says): the first undeclared field of each object, as `.spec.foo`, list items by their
        map keys (`containers[name="a"]`), sorted."""
        found: list[str] = []
        meta = obj.get("metadata")
        if isinstance(meta, dict):
            found += [f".metadata.{k}" for k in meta if k not in OBJECT_META][:1]
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        _undeclared(body, self.raw, "", found)
        return sorted(found)


def _apply_defaults(
    value: dict[str, Any], schema: dict[str, Any], skip: tuple[str, ...] = ()
) -> None:
    for key, sub in schema.get("properties", {}).items():
        if key not in value and "default" in sub and key not in skip:
            value[key] = _walk(copy.deepcopy(sub["default"]), sub, key, [], True)


def _walk(value: Any, schema: dict[str, Any], path: str, unknown: list[str], prune: bool) -> Any:
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        embedded = schema.get("x-kubernetes-embedded-resource")
        for key in list(value):
            sub_path = f"{path}.{key}"
            if props is not None and key in props:
                value[key] = _walk(value[key], props[key], sub_path, unknown, prune)
            elif isinstance(extra, dict):
                value[key] = _walk(value[key], extra, f"{path}[{key}]", unknown, prune)
            elif keep_unknown or (embedded and key in ("apiVersion", "kind", "metadata")):
                continue
            elif props is not None or schema.get("type") == "object":
                unknown.append(sub_path)
                if prune:
                    del value[key]
        _apply_defaults(value, schema)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            _walk(v, schema["items"], f"{path}[{i}]", unknown, prune) for i, v in enumerate(value)
        ]
    return value


def _undeclared(value: Any, schema: dict[str, Any], path: str, found: list[str]) -> None:
    """Structured-merge-diff's view of unknown fields: one per object, in document order."""
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if schema.get("x-kubernetes-preserve-unknown-fields") or extra is True:
            return
        reported = False
        embedded = schema.get("x-kubernetes-embedded-resource")
        for key, sub in value.items():
            if props is not None and key in props:
                _undeclared(sub, props[key], f"{path}.{key}", found)
            elif isinstance(extra, dict):
                _undeclared(sub, extra, f"{path}.{key}", found)
            elif embedded and key in ("apiVersion", "kind", "metadata"):
                continue
            elif not reported and (props is not None or schema.get("type") == "object"):
                found.append(f"{path}.{key}")
                reported = True
    elif isinstance(value, list) and isinstance(items := schema.get("items"), dict):
        keys = schema.get("x-kubernetes-list-map-keys") or []
        for i, item in enumerate(value):
            if keys and isinstance(item, dict):
                where = ",".join(f"{k}={json.dumps(item.get(k))}" for k in keys)
                _undeclared(item, items, f"{path}[{where}]", found)
            else:
                _undeclared(item, items, f"{path}[{i}]", found)


def _show(value: Any) -> str:
    return (
        json.dumps(value)
        if not isinstance(value, dict | list)
        else '"' + _JSON_TYPES[type(value)] + '"'
    )


def _cause(err: jsonschema.ValidationError) -> Cause:
    """Translate a jsonschema error into the apiserver's wording."""
    path = ""
    for part in err.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    value = err.instance
    where = path or "<root>"
    kind = err.validator
    if kind == "required":
        missing = err.message.split("'")[1]
        return Cause(
            "FieldValueRequired", f"{path}.{missing}" if path else missing, "Required value"
        )
    if kind == "type":
        want = err.validator_value
        want = want[0] if isinstance(want, list) else want
        want = "integer or string" if want == "int-or-string" else want
        got = "null" if value is None else _JSON_TYPES.get(type(value), "unknown")
        return Cause(
            "FieldValueTypeInvalid",
            path,
            f'Invalid value: "{got}": {where} in body must be of type {want}: "{got}"',
        )
    if kind == "enum":
        allowed = ", ".join(json.dumps(v) for v in err.validator_value)
        return Cause(
            "FieldValueNotSupported",
            path,
            f"Unsupported value: {_show(value)}: supported values: {allowed}",
        )
    if kind == "maxLength":
        return Cause(
            "FieldValueTooLong", path, f"Too long: may not be more than {err.validator_value} bytes"
        )
    if kind == "maxItems":
        return Cause(
            "FieldValueTooMany",
            path,
            f"Too many: {len(value)}: must have at most {err.validator_value} items",
        )
    texts = {
        "pattern": f"should match '{err.validator_value}'",
        "minimum": f"should be greater than or equal to {err.validator_value}",
        "maximum": f"should be less than or equal to {err.validator_value}",
        "minLength": f"should be at least {err.validator_value} chars long",
        "minItems": f"should have at least {err.validator_value} items",
    }
    text = texts.get(str(kind), err.message)
    return Cause(
        "FieldValueInvalid", path, f"Invalid value: {_show(value)}: {where} in body {text}"
    )


@functools.lru_cache(maxsize=64)
def _parse_file(path: Path, _mtime: float) -> list[dict[str, Any]]:
    # CRD files are large (up to 1.4 MB): parse each once per process; callers must not mutate
    with path.open() as fh:
        return [
            doc
            for doc in yaml.load_all(fh, Loader=_LOADER)
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"
        ]


def read_crd_documents(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every CustomResourceDefinition document in the given files (a directory means its *.yaml).

    The documents are shared between callers: treat them as read-only.
    """
    docs: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        files = sorted([*path.glob("*.yaml"), *path.glob("*.yml")]) if path.is_dir() else [path]
        for file in files:
            docs.extend(_parse_file(file.resolve(), file.stat().st_mtime))
    return docs


_SCHEMAS: dict[int, tuple[dict[str, Any], Schema]] = {}


def _schema_for(openapi: dict[str, Any]) -> Schema:
    """One compiled Schema per (shared, read-only) schema document."""
    cached = _SCHEMAS.get(id(openapi))
    if cached is None or cached[0] is not openapi:
        cached = _SCHEMAS[id(openapi)] = (openapi, Schema(openapi))
    return cached[1]


def resource_from_crd(crd: dict[str, Any]) -> ResourceType:
    """A ResourceType (with compiled schemas of served versions) from a CRD document."""
    spec = crd["spec"]
    names = spec["names"]
    served = [v for v in spec["versions"] if v.get("served", True)]
    # storage version first: it is the preferred version in discovery
    served.sort(key=lambda v: not v.get("storage", False))
    rtype = ResourceType(
        group=spec["group"],
        versions=[v["name"] for v in served],
        plural=names["plural"],
        singular=names.get("singular", names["kind"].lower()),
        kind=names["kind"],
        namespaced=spec.get("scope", "Namespaced") == "Namespaced",
        status_subresource=any("status" in (v.get("subresources") or {}) for v in served),
        short_names=list(names.get("shortNames", [])),
        crd=crd,
    )
    for v in served:
        openapi = (v.get("schema") or {}).get("openAPIV3Schema")
        if openapi:
            rtype.schemas[v["name"]] = _schema_for(openapi)
    return rtype


CORE_TYPES = [
    ResourceType("", ["v1"], "namespaces", "namespace", "Namespace", False, True, ["ns"]),
    ResourceType("", ["v1"], "pods", "pod", "Pod", True, True, ["po"]),
    # cluster-scoped: a job's failure names the Node its pod was lost with
    ResourceType("", ["v1"], "nodes", "node", "Node", False, True, ["no"]),
    ResourceType("", ["v1"], "services", "service", "Service", True, True, ["svc"]),
    ResourceType("", ["v1"], "configmaps", "configmap", "ConfigMap", True, False, ["cm"]),
    ResourceType("", ["v1"], "secrets", "secret", "Secret", True, False),
    ResourceType(
        "",
        ["v1"],
        "persistentvolumeclaims",
        "persistentvolumeclaim",
        "PersistentVolumeClaim",
        True,
        True,
        ["pvc"],
    ),
    ResourceType("", ["v1"], "events", "event", "Event", True, False, ["ev"]),
    ResourceType(
        "", ["v1"], "serviceaccounts", "serviceaccount", "ServiceAccount", True, False, ["sa"]
    ),
]
