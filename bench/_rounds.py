"""Ratios that hold on a noisy machine: ours and raw in interleaved rounds, each ratio as its
median with the lowest and highest round.

One run of each side cannot tell 5 % apart on a shared 2-core machine (issue 30: the same
ratio read 1.108 and 0.824 in two runs). Each round runs both sides back to back, the side
that goes first alternating, so a load that drifts over the bench hits both alike; the ratio
is taken per round, and the spread of the rounds says how far one figure can be trusted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

ROUNDS = 5  # the least issue 30 asks for

Ours = TypeVar("Ours")
Raw = TypeVar("Raw")
Result = TypeVar("Result")


@dataclass(frozen=True)
class Spread:
    """A ratio over rounds: its median, lowest and highest."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        """The spread of per-round values (at least one)."""
        data = sorted(values)
        if not data:
            raise ValueError("a spread of no values")
        return cls(statistics.median(data), data[0], data[-1])

    def __str__(self) -> str:
        """`median [min, max]`, as `make bench` prints a ratio."""
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def figure(values: Iterable[float]) -> float | Spread:
    """One round's value as it is; over more rounds, their spread."""
    data = list(values)
    return data[0] if len(data) == 1 else Spread.of(data)


def interleaved(
    ours: Callable[[], Ours],
    raw: Callable[[], Raw],
    rounds: int = ROUNDS,
    *,
    warmups: int = 0,
) -> list[tuple[Ours, Raw]]:
    """`warmups` + `rounds` rounds of both sides, ours first in even rounds and raw first in odd
    ones; the counted rounds' (ours, raw) results, in order. Warm-up rounds are run and dropped
    (a first run pays for imports, caches and fresh workers)."""
    if rounds < 1:
        raise ValueError(f"rounds: expected >= 1, got {rounds}")
    pairs: list[tuple[Ours, Raw]] = []
    for index in range(warmups + rounds):
        if index % 2:
            raw_result = raw()
            ours_result = ours()
        else:
            ours_result = ours()
            raw_result = raw()
        if index >= warmups:
            pairs.append((ours_result, raw_result))
    return pairs


def rotated(
    sides: Mapping[str, Callable[[], Result]], rounds: int = ROUNDS, *, warmups: int = 0
) -> list[dict[str, Result]]:
    """`interleaved` for more than two sides: in each round every side runs once, the order
    rotated by one each round (with 3 sides and 3 rounds each side goes first, middle and last
    once); the counted rounds' results by side name, in order."""
    if rounds < 1:
        raise ValueError(f"rounds: expected >= 1, got {rounds}")
    names = list(sides)
    results: list[dict[str, Result]] = []
    for index in range(warmups + rounds):
        shift = index % len(names)
        out = {name: sides[name]() for name in names[shift:] + names[:shift]}
        if index >= warmups:
            results.append(out)
    return results
