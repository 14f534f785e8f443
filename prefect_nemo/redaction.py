"""Keep secret values out of everything we print, log, report or raise."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MASK = "**********"
_MIN_SECRET = 4  # shorter values would mask ordinary text; blocks reject them anyway


class Redactor:
    """Replaces every known secret value in a text with a mask."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self._secrets = sorted(
            {s for s in secrets if s and len(s) >= _MIN_SECRET}, key=len, reverse=True
        )

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def deep(self, value: Any) -> Any:
        """A copy of a document (dicts, lists, strings) with every string redacted."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(k) if isinstance(k, str) else k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.deep(v) for v in value]
        return value
