"""The demo pipeline's flows: data-prep -> train -> eval, three experiments of real (small, CPU)
Ray jobs whose scripts are in `jobs/` (shipped as each job's working_dir).

Each experiment is its own flow run and can be started on its own (UI, schedule, CLI); the
dependencies between them are declared by experiment name, so `train` waits for `data-prep`
even when the two were started separately. `demo_pipeline` starts all three at once to show it.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from prefect_nemo import JobResult, JobSpec, run_job, start_experiment

JOB_CODE = Path(__file__).parent / "jobs"
EVAL_SHARDS = 4
PREP_SHARDS = 2


def _spec(name: str, command: str) -> JobSpec:
    return JobSpec(name=name, entrypoint=command, working_dir=JOB_CODE, timeout_s=600)


def _summary(results: list[JobResult]) -> list[dict[str, Any]]:
    return [
        {"job_id": r.handle.job_id, "state": r.state.value, "duration_s": r.duration_s}
        for r in results
    ]


@flow(name="demo-data-prep", flow_run_name="{experiment}")
def data_prep(experiment: str, run_dir: str, cluster: str | None = None) -> dict[str, Any]:
    """Write the training data shards, one Ray job per shard."""
    exp = start_experiment(experiment)
    out = Path(run_dir) / "data"
    futures = [
        run_job.submit(_spec(f"shard-{i}", f"python prep.py --shard {i} --out {out}"), cluster)
        for i in range(PREP_SHARDS)
    ]
    results = [f.result() for f in futures]
    outputs = {"data_uri": str(out), "jobs": _summary(results)}
    exp.emit("completed", outputs)
    return outputs


@flow(name="demo-train", flow_run_name="{experiment}")
def train(
    experiment: str, run_dir: str, depends_on: list[str], cluster: str | None = None
) -> dict[str, Any]:
    """Fit a model on the prepared data, then check the checkpoint in a second job."""
    exp = start_experiment(experiment, depends_on=depends_on, poll_s=1.0)
    data, ckpt = Path(run_dir) / "data", Path(run_dir) / "checkpoint"
    fit = run_job(_spec("fit", f"python train.py --data {data} --out {ckpt}"), cluster)
    check = run_job(_spec("validate", f"python validate.py --model {ckpt}/model.npy"), cluster)
    metrics = json.loads((ckpt / "train.json").read_text())
    outputs = {
        "checkpoint_uri": str(ckpt / "model.npy"),
        "train_loss": metrics["loss"],
        "jobs": _summary([fit, check]),
    }
    exp.emit("completed", outputs)
    return outputs


@flow(name="demo-eval", flow_run_name="{experiment}")
def evaluate(
    experiment: str, run_dir: str, depends_on: list[str], cluster: str | None = None
) -> dict[str, Any]:
    """Evaluate the checkpoint: one job per held-out shard in parallel, then an aggregate job."""
    exp = start_experiment(experiment, depends_on=depends_on, poll_s=1.0)
    model, evals = Path(run_dir) / "checkpoint" / "model.npy", Path(run_dir) / "eval"
    shards = [
        run_job.submit(
            _spec(f"eval-{i}", f"python evaluate.py --model {model} --shard {i} --out {evals}"),
            cluster,
        )
        for i in range(EVAL_SHARDS)
    ]
    aggregate = run_job.submit(
        _spec("aggregate", f"python aggregate.py --evals {evals}"), cluster, wait_for=shards
    )
    results = [f.result() for f in [*shards, aggregate]]
    metrics = json.loads((evals / "metrics.json").read_text())
    outputs = {
        "accuracy": metrics["accuracy"],
        "eval_loss": metrics["loss"],
        "jobs": _summary(results),
    }
    exp.emit("completed", outputs)
    return outputs


@task(name="start-experiment-run", cache_policy=NO_CACHE)
def _start(experiment_flow: Any, **parameters: Any) -> dict[str, Any]:
    # A flow called from a task is its own (child) flow run: three of them run side by side.
    outputs: dict[str, Any] = experiment_flow(**parameters)
    return outputs


@flow(name="demo-pipeline")
def demo_pipeline(
    run_dir: str, name: str | None = None, cluster: str | None = None
) -> dict[str, Any]:
    """Start data-prep, train and eval at once; the experiments' dependencies order them."""
    # experiment names are the jobs' identity on the cluster: two pipelines started in the same
    # second must not share them (a re-run with the same name attaches to its jobs)
    name = name or f"demo-{int(time.time())}-{secrets.token_hex(2)}"
    names = {step: f"{name}-{step}" for step in ("data-prep", "train", "eval")}
    common = {"run_dir": run_dir, "cluster": cluster}
    prep = _start.submit(data_prep, experiment=names["data-prep"], **common)
    fit = _start.submit(train, experiment=names["train"], depends_on=[names["data-prep"]], **common)
    score = _start.submit(evaluate, experiment=names["eval"], depends_on=[names["train"]], **common)
    return {
        step: future.result()
        for step, future in zip(names.values(), (prep, fit, score), strict=True)
    }
