"""Serve-and-evaluate: start replicas of a small real HTTP model server on Ray placement groups,
evaluate the model through them, stop them.

The server (flows/serve_jobs/model_server.py) is the demo pipeline's logistic-regression model
(numpy, CPU, no downloads): it loads a checkpoint the demo wrote (`model_path`) or trains the
same model itself in a fraction of a second. The evaluation runs as a Prefect task in the flow's
process: it is a light HTTP client, and running it where the flow runs also proves the endpoints
are reachable from the caller, which is what a real evaluation harness needs; heavy evaluation
would go to the cluster with run_job instead.

    .venv/bin/python -m flows.serve_and_evaluate          # on the embedded local Ray cluster
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from prefect_nemo import serve_replicas
from prefect_nemo.demo import JOB_CODE

SERVER = Path(__file__).parent / "serve_jobs" / "model_server.py"
COMMON = JOB_CODE / "common.py"
BATCH = 250


def _common() -> ModuleType:
    """The demo jobs' data module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("demo_jobs_common", COMMON)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _predict(endpoint: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    body = json.dumps({"x": x.tolist()}).encode()
    request = urllib.request.Request(
        f"{endpoint}/predict", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        out = json.loads(resp.read())
    return np.asarray(out["p"]), out["replica"]


@task(name="evaluate-endpoints", cache_policy=NO_CACHE)
def evaluate_endpoints(endpoints: list[str], rows: int = 4000, seed: int = 5000) -> dict[str, Any]:
    """Accuracy and log loss on held-out data, batches spread round-robin over the replicas."""
    common = _common()
    x, y = common.sample(np.random.default_rng(seed), rows)
    batches = [(i, x[i : i + BATCH]) for i in range(0, rows, BATCH)]
    with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        answers = list(
            pool.map(
                lambda k: _predict(endpoints[k % len(endpoints)], batches[k][1]),
                range(len(batches)),
            )
        )
    p = np.concatenate([a[0] for a in answers])
    eps = 1e-12
    per_replica: dict[str, int] = {}
    for _, replica in answers:
        per_replica[replica] = per_replica.get(replica, 0) + 1
    return {
        "accuracy": float(np.mean((p > 0.5) == (y > 0.5))),
        "loss": float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))),
        "rows": rows,
        "batches_per_replica": per_replica,
    }


@flow(name="serve-and-evaluate")
def serve_and_evaluate(
    replicas: int = 2,
    tp_size: int = 0,
    model_path: str | None = None,
    rows: int = 4000,
    ray_address: str | None = None,
    exclude_head: bool = False,
    readiness_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Start `replicas` model servers, evaluate through them, stop them; returns the metrics.

    tp_size=0 serves on CPU (the default: this model needs no GPU); tp_size>=1 reserves GPUs.
    """
    command = [sys.executable, str(SERVER), "--port", "{port}"]
    if model_path:
        command += ["--model", model_path]
    with serve_replicas(
        command,
        replicas=replicas,
        tp_size=tp_size,
        name="logreg",
        ray_address=ray_address,
        exclude_head=exclude_head,
        readiness_timeout_s=readiness_timeout_s,
    ) as served:
        metrics = evaluate_endpoints(served.endpoints, rows)
        metrics["endpoints"] = served.endpoints
        metrics["nodes"] = [r.node_ids[0] for r in served.replicas]
    return metrics


if __name__ == "__main__":
    print(json.dumps(serve_and_evaluate(), indent=2))
