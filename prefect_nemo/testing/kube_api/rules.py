"""CRD validation rules (`x-kubernetes-validations`), evaluated as kube-apiserver evaluates them.

The expressions run on common-expression-language (Python bindings of the Rust `cel` crate):
each rule is compiled once per schema, on its first use, and the schema tree is walked only
where rules are. What kube-apiserver 1.37 does, and this does too (tests/test_kube_api.py
checks it on both servers with the shipped CRDs and a probe CRD of its own):

- a rule is evaluated with `self` the value at its node (at the root, the object with only
  `metadata.name` and `metadata.generateName` of its metadata); nodes whose value is absent or
  null are skipped;
- a transition rule (one that names `oldSelf`) runs on updates only, where the node has an old
  value to compare with: object properties and map values by key, items of `map` lists by
  their keys and of `set` lists by value (items of atomic lists have none);
- on an update, the other rules of a node whose value did not change are ratcheted (their
  failures would only be warnings): they are not evaluated, nor is `self == oldSelf` there;
- a failed rule is one cause `<path>: Invalid value: <value>: <message>` (the value only for
  scalars; `<nil>` is the root's path), its text from `messageExpression` when that gives a
  one-line, non-blank string, else `message`, else "failed rule: <rule>"; `reason` makes it
  Forbidden, Required value or Duplicate value, and `fieldPath` names a field below the node;
- a rule that cannot be evaluated (a missing key) is a cause
  `Invalid value: "<type>": <error> evaluating rule: <message or rule>`.

The rules of the shipped CRDs need CEL's standard functions only (`matches`, `size`, `has`,
`all`, `exists`, `filter`, `in`). A rule calling a function the library lacks (Kubernetes'
extension libraries: `isURL`, `quantity`, ...) is skipped, logged once, rather than refusing
objects the real server accepts. `optionalOldSelf` is not supported: such transition rules
run on updates only, like the others. Not replicated: the Warning header for a ratcheted
failure (it needs an object stored before its CRD's rules changed).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from prefect_nemo.testing.kube_api.cause import Cause

log = logging.getLogger(__name__)


def _load_cel() -> ModuleType:
    """The library's compiled module alone: `import cel` also imports its command line (typer,
    prompt_toolkit), a second or more of start-up we would pay in every process for nothing."""
    spec = importlib.util.find_spec("cel")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if (path := Path(folder) / f"cel{suffix}").is_file():
                loader = importlib.machinery.ExtensionFileLoader("cel.cel", str(path))
                module = importlib.util.module_from_spec(
                    importlib.util.spec_from_loader("cel.cel", loader)  # type: ignore[arg-type]
                )
                loader.exec_module(module)
                sys.modules["cel.cel"] = module  # `import cel` later reuses it
                return module
    import cel  # another layout: the package as it is

    return cel


cel = sys.modules.get("cel.cel") or _load_cel()

NOT_CHECKED = Cause(
    "FieldValueInvalid",
    "<nil>",
    "Invalid value: null: some validation rules were not checked because the object was "
    "invalid; correct the existing errors to complete validation",
)
# schema errors after which kube-apiserver skips the rules (the object may not be typed right)
BLOCKING_REASONS = frozenset({"FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong",
                              "FieldValueTooMany", "FieldValueTypeInvalid"})  # fmt: skip
_ROOT_METADATA = ("name", "generateName")  # all of metadata a root rule sees
_FIELD_PATH = re.compile(r"\.([^.\[\]]+)|\['([^']*)'\]")
_warned: set[str] = set()


@dataclass
class Rule:
    """One compiled `x-kubernetes-validations` entry."""

    source: str
    program: Any  # cel.Program
    message: str  # "" when the rule has none
    message_expression: Any  # cel.Program | None
    reason: str  # FieldValueInvalid (the default), ...Forbidden, ...Required, ...Duplicate
    field_path: str  # appended to the node's path ("" or ".a.b")
    transition: bool  # names oldSelf: evaluated on updates only
    immutable: bool  # is `self == oldSelf`: holds wherever the value did not change

    @property
    def error_name(self) -> str:
        """How an evaluation error names the rule: its message, else its expression."""
        return self.message or self.source.strip()


@dataclass
class Node:
    """The rules at one schema node and the children that have rules somewhere below."""

    type: str
    rules: list[Rule] = field(default_factory=list)
    properties: dict[str, Node] = field(default_factory=dict)
    additional: Node | None = None  # additionalProperties: map values
    items: Node | None = None
    list_type: str = "atomic"
    map_keys: tuple[str, ...] = ()


def _compile_rule(entry: dict[str, Any]) -> Rule | None:
    source = str(entry.get("rule") or "")
    try:
        program = cel.compile(source)
    except ValueError as exc:  # the real server refuses such a CRD; here the rule is skipped
        _warn_once(source, f"does not compile: {exc}")
        return None
    expression = None
    if entry.get("messageExpression"):
        try:
            expression = cel.compile(str(entry["messageExpression"]))
        except ValueError as exc:
            _warn_once(str(entry["messageExpression"]), f"does not compile: {exc}")
    return Rule(
        source=source,
        program=program,
        message=str(entry.get("message") or "").strip(),
        message_expression=expression,
        reason=str(entry.get("reason") or "FieldValueInvalid"),
        field_path=str(entry.get("fieldPath") or ""),
        transition="oldSelf" in program.variables(),
        immutable=" ".join(source.split()) in ("self == oldSelf", "oldSelf == self"),
    )


def compile_schema(schema: dict[str, Any]) -> Node | None:
    """The rule tree of an openAPIV3Schema node; None when no rule is at or below it."""
    node = Node(type=str(schema.get("type") or ""))
    for entry in schema.get("x-kubernetes-validations") or []:
        if (rule := _compile_rule(entry)) is not None:
            node.rules.append(rule)
    for key, sub in (schema.get("properties") or {}).items():
        if (child := compile_schema(sub)) is not None:
            node.properties[key] = child
    if isinstance(schema.get("additionalProperties"), dict):
        node.additional = compile_schema(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        node.items = compile_schema(schema["items"])
        node.list_type = str(schema.get("x-kubernetes-list-type") or "atomic")
        node.map_keys = tuple(schema.get("x-kubernetes-list-map-keys") or ())
    if node.rules or node.properties or node.additional or node.items:
        return node
    return None


def validate(root: Node, obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    """The causes of every failed rule of `obj` (and, for transition rules, `old`)."""
    causes: list[Cause] = []
    _walk(root, _root_view(obj), _root_view(old) if old is not None else None, "", causes)
    return causes


def _root_view(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {**obj, "metadata": {k: meta[k] for k in _ROOT_METADATA if k in meta}}


def _walk(node: Node, value: Any, old: Any, path: str, causes: list[Cause]) -> None:
    if value is None:
        return
    unchanged = old is not None and value == old
    due = [
        rule
        for rule in node.rules
        if not (rule.transition and old is None)  # nothing to compare with: new here
        and not (unchanged and (rule.immutable or not rule.transition))  # ratcheted, or holds
    ]
    if due:  # the values converted for CEL once, for all the node's rules
        transition = any(rule.transition for rule in due)
        variables = {"self": value, "oldSelf": old} if transition else {"self": value}
        context = cel.Context(variables=variables)
        for rule in due:
            if (cause := _evaluate(rule, node, value, context, path)) is not None:
                causes.append(cause)
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        for key in sorted(value):
            if node.additional is not None:  # a map: its values, named by key
                _walk(node.additional, value[key], olds.get(key), f"{path}[{key}]", causes)
            elif (child := node.properties.get(key)) is not None:
                sub_path = f"{path}.{key}" if path else key
                _walk(child, value[key], olds.get(key), sub_path, causes)
    elif isinstance(value, list) and node.items is not None:
        for i, (item, old_item) in enumerate(_correlate(node, value, old)):
            _walk(node.items, item, old_item, f"{path}[{i}]", causes)


def _correlate(node: Node, items: list[Any], old: Any) -> Iterator[tuple[Any, Any]]:
    """Each item with its old self: by keys in a map list, by value in a set, none else."""
    olds = old if isinstance(old, list) else []
    for item in items:
        match = None
        if node.list_type == "map" and node.map_keys and isinstance(item, dict):
            key = [item.get(k) for k in node.map_keys]
            keyed = (o for o in olds if isinstance(o, dict))
            match = next((o for o in keyed if [o.get(k) for k in node.map_keys] == key), None)
        elif node.list_type == "set":
            match = next((o for o in olds if o == item), None)
        yield item, match


def _evaluate(rule: Rule, node: Node, value: Any, context: Any, path: str) -> Cause | None:
    try:
        result = rule.program.execute(context)
    except Exception as exc:
        text = str(exc)
        if "Undefined variable or function" in text:
            _warn_once(rule.source, f"needs a function the CEL library lacks: {text}")
            return None
        if isinstance(exc, KeyError):
            text = f"no such key: {exc.args[0] if exc.args else ''}"
        return Cause(
            "FieldValueInvalid",
            path or "<nil>",
            f'Invalid value: "{node.type}": {text} evaluating rule: {rule.error_name}',
        )
    if result is True:
        return None
    detail = _message(rule, context)
    where = path + _field_path(rule.field_path)
    return _cause(rule.reason, where or "<nil>", value, detail)


def _message(rule: Rule, context: Any) -> str:
    if rule.message_expression is not None:
        try:
            text = rule.message_expression.execute(context)
        except Exception:
            text = None
        # the real server falls back to `message` for a blank or multi-line result
        if isinstance(text, str) and text.strip() and "\n" not in text:
            return text
    return rule.message or f"failed rule: {rule.source.strip()}"


def _field_path(field_path: str) -> str:
    """`.a.b` or `['a']` (relative to the node) as the error's path continues."""
    return "".join(f".{a or b}" for a, b in _FIELD_PATH.findall(field_path))


def _cause(reason: str, path: str, value: Any, detail: str) -> Cause:
    shown = go_value(value)
    if reason == "FieldValueForbidden":
        return Cause(reason, path, f"Forbidden: {detail}")
    if reason == "FieldValueRequired":
        return Cause(reason, path, f"Required value: {detail}")
    if reason == "FieldValueDuplicate":
        return Cause(reason, path, f"Duplicate value: {shown}" if shown else "Duplicate value")
    return Cause(
        "FieldValueInvalid",
        path,
        f"Invalid value: {shown}: {detail}" if shown else f"Invalid value: {detail}",
    )


def go_value(value: Any) -> str:
    """A scalar as kube-apiserver prints a bad value; "" for objects and lists (not shown)."""
    if isinstance(value, dict | list):
        return ""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e21 else repr(value)
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _warn_once(source: str, why: str) -> None:
    if source not in _warned:
        _warned.add(source)
        log.warning("CRD validation rule %r is not checked: it %s", source, why)
