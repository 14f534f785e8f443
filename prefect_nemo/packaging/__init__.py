"""Shared packaging helpers: snapshot a job's local code and stage it for shipping.

Backend-agnostic; must not import prefect or ray.
"""

from __future__ import annotations

from prefect_nemo.packaging.archive import (
    SourceArchive,
    build_archive,
    discover_includes,
)
from prefect_nemo.packaging.shell import tee_command
from prefect_nemo.packaging.source import (
    ALWAYS_EXCLUDED,
    CACHE_DIR_ENV,
    SourceTree,
    collect_source,
    default_cache_dir,
    stage_source,
)
from prefect_nemo.packaging.transport import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_BYTES,
    PARTS_DIR,
    TransportPlan,
    TransportTooLarge,
    plan_for,
    stage_archive,
)

__all__ = [
    "ALWAYS_EXCLUDED",
    "CACHE_DIR_ENV",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_BYTES",
    "PARTS_DIR",
    "SourceArchive",
    "SourceTree",
    "TransportPlan",
    "TransportTooLarge",
    "build_archive",
    "collect_source",
    "default_cache_dir",
    "discover_includes",
    "plan_for",
    "stage_archive",
    "stage_source",
    "tee_command",
]
