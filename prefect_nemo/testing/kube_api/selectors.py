"""Label selectors (equality and set-based) and field selectors, as the apiserver parses them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prefect_nemo.testing.kube_api.errors import bad_request

Matcher = Callable[[dict[str, Any]], bool]

_SET_TERM = re.compile(r"^\s*([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([^\s!=()]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")
_EXISTS = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside `( ... )`."""
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t for t in terms if t.strip()]


def label_matcher(selector: str | None) -> Matcher:
    """A predicate on objects for a labelSelector string; 400 when it does not parse."""
    if not selector:
        return lambda _obj: True
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(selector):
        if m := _SET_TERM.match(term):
            key, op, raw = m.groups()
            values = {v.strip() for v in raw.split(",") if v.strip()}
            if op == "in":
                checks.append(lambda lb, k=key, vs=values: lb.get(k) in vs)
            else:
                checks.append(lambda lb, k=key, vs=values: lb.get(k) not in vs)
        elif m := _EQ_TERM.match(term):
            key, op, value = m.groups()
            if op == "!=":
                checks.append(lambda lb, k=key, v=value: lb.get(k) != v)
            else:
                checks.append(lambda lb, k=key, v=value: lb.get(k) == v)
        elif m := _EXISTS.match(term):
            neg, key = m.groups()
            checks.append(lambda lb, k=key, n=bool(neg): (k in lb) != n)
        else:
            raise bad_request(f"unable to parse requirement: {term.strip()!r}")

    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return match


def _field(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def field_matcher(selector: str | None, supported: set[str]) -> Matcher:
    """A predicate for a fieldSelector (`a=b`, `a==b`, `a!=b` terms); 400 for unsupported fields."""
    if not selector:
        return lambda _obj: True
    checks: list[tuple[str, str, bool]] = []
    for term in _split_terms(selector):
        m = _EQ_TERM.match(term)
        if not m:
            raise bad_request(f"invalid selector: '{selector}'; can't understand '{term.strip()}'")
        key, op, value = m.groups()
        if key not in supported:
            raise bad_request(f"field label not supported: {key}")
        checks.append((key, value, op == "!="))

    def match(obj: dict[str, Any]) -> bool:
        return all((_field(obj, k) == v) != neg for k, v, neg in checks)

    return match
