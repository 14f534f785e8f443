"""Shared Kubeflow Trainer runtimes we created, removed once no TrainJob uses them. No Prefect.

A runtime is in use while a TrainJob references it (`spec.runtimeRef`), whatever that job's
state: Trainer's own `trainer.kubeflow.org/resource-in-use` finalizer kept a runtime while "the
TrainJobs [listed] with TrainJobRuntimeRefKey: runtime.Name" were not empty, and later Trainer
releases dropped that guard, so we apply the rule ourselves. Ours are labelled with the block's
`runtime_prefix`; each is stamped `prefect-nemo.io/last-used` when a submit takes it, and one
taken within the last `idle_s` is kept (a submit may be between taking it and creating its
TrainJob). The delete carries the resourceVersion we checked, so a runtime taken meanwhile is
not deleted (Conflict).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from prefect_nemo.backends._kube_objects import parse_time
from prefect_nemo.backends.kubeflow.runtimes import RUNTIME_PREFIX_LABEL, TrainerConfig
from prefect_nemo.kube import LAST_USED, MANAGED_BY, TRAIN_JOB, Conflict, KubeApi

IDLE_S = 600.0  # a runtime taken for a job this recently is kept
log = logging.getLogger("prefect_nemo.kubeflow")


def touch_runtime(api: KubeApi, config: TrainerConfig, namespace: str, name: str) -> None:
    """Stamp the runtime as taken now (the sweep keeps it for `IDLE_S`)."""
    patch = {"metadata": {"annotations": {LAST_USED: _now().isoformat()}}}
    api.patch(config.runtime_kind, name, patch, namespace)


def remove_unused_runtimes(
    api: KubeApi,
    config: TrainerConfig,
    namespace: str,
    *,
    keep: str | None = None,
    idle_s: float = IDLE_S,
) -> list[str]:
    """Delete the runtimes of this block's `runtime_prefix` that no TrainJob references and
    no submit took in the last `idle_s` (never `keep`); returns them as 'Kind/name'.

    ClusterTrainingRuntimes are checked against the TrainJobs of every namespace, a
    namespaced TrainingRuntime against those of its namespace."""
    kind = config.runtime_kind
    selector = f"{MANAGED_BY}=prefect-nemo,{RUNTIME_PREFIX_LABEL}={config.runtime_prefix}"
    jobs, _ = api.list(TRAIN_JOB, namespace, all_namespaces=not kind.namespaced)
    used = {
        ((j.get("spec") or {}).get("runtimeRef") or {}).get("name")
        for j in jobs
        if ((j.get("spec") or {}).get("runtimeRef") or {}).get("kind") == kind.kind
    }
    runtimes, _ = api.list(kind, namespace, label_selector=selector)
    removed = []
    for runtime in runtimes:
        name = runtime["metadata"]["name"]
        if name == keep or name in used or runtime["metadata"].get("deletionTimestamp"):
            continue
        current = api.get(kind, name, namespace)  # read after the TrainJobs were listed
        if current is None or _idle_for(current) < idle_s:
            continue
        try:
            api.delete(
                kind, name, namespace, resource_version=current["metadata"]["resourceVersion"]
            )
        except Conflict:
            continue  # taken for a job meanwhile
        log.info("removed %s %s: no TrainJob uses it", kind.kind, name)
        removed.append(f"{kind.kind}/{name}")
    return removed


def _idle_for(runtime: dict[str, Any]) -> float:
    """Seconds since the runtime was last taken for a job (stamped), else since created."""
    meta = runtime.get("metadata") or {}
    last = parse_time((meta.get("annotations") or {}).get(LAST_USED))
    last = last or parse_time(meta.get("creationTimestamp"))
    return float("inf") if last is None else (_now() - last).total_seconds()


def _now() -> datetime:
    return datetime.now(UTC)
