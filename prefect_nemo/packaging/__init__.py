"""Shared packaging helpers: snapshot a job's local code and stage it for shipping.

Backend-agnostic; must not import prefect or ray.
"""

from __future__ import annotations

from prefect_nemo.packaging.shell import tee_command
from prefect_nemo.packaging.source import (
    ALWAYS_EXCLUDED,
    CACHE_DIR_ENV,
    SourceTree,
    collect_source,
    default_cache_dir,
    stage_source,
)

__all__ = [
    "ALWAYS_EXCLUDED",
    "CACHE_DIR_ENV",
    "SourceTree",
    "collect_source",
    "default_cache_dir",
    "stage_source",
    "tee_command",
]
