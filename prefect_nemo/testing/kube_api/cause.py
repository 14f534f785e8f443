"""One field error of a refused object, as kube-apiserver lists them (Status.details.causes):
what the schema and the CEL rules both report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Cause:
    """One field error, as in Status.details.causes."""

    reason: str
    field: str
    message: str

    def text(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message
