"""Placement errors, inside prefect-nemo's one exception hierarchy."""

from __future__ import annotations

from prefect_nemo.errors import InvalidJobSpec, PrefectNemoError


class PlacementError(InvalidJobSpec):
    """The placement request is wrong (bad tp_size, unequal split, conflicting constraints)."""


class InsufficientCapacity(PlacementError):
    """The request can never fit this cluster (checked before anything is reserved)."""


class PlacementTimeout(PrefectNemoError):
    """A placement group did not become ready in time, or a replica did not become healthy."""


class ReplicaFailed(PrefectNemoError):
    """A replica's process exited or never answered its health check."""
