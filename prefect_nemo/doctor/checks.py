"""The doctor's result type: one row per check (no Prefect import)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

THIS_MACHINE = "(this machine)"


class Status(StrEnum):
    """The outcome of one check: a failure makes the doctor exit 1, a warning does not."""

    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table: what was checked, what was found, and what to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    block: str = ""  # the saved block ('kube-ray-cluster/prod'), or THIS_MACHINE


def ok(name: str, detail: str) -> Check:
    """A passed check."""
    return Check(name, Status.OK, detail)


def failed(checks: Iterable[Check]) -> bool:
    """True when any check failed (the doctor's exit code 1)."""
    return any(c.status is Status.FAIL for c in checks)
