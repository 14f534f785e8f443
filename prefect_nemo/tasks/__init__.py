"""Where Prefect meets the engines: the only package that imports Prefect's task/flow machinery.

`jobs` (run_job, submit_job, wait_for_job, stop_job), `batch` (run_jobs: many jobs on one
loop), `experiments` (start_experiment, wait_for_experiments), `dgd` (Dynamo inference graphs),
`replicas` (serve_replicas and its tasks), `slurm_ray` (slurm_ray_cluster: Ray on Slurm for
the life of a flow); `_run` is the one run context (flow run, experiment,
teardown of live work, cancel watch) and `reporting` the one way to report (events, table
artifacts, the job reporter).
"""

from prefect_nemo.tasks._blocks import resolve_block, resolve_cluster, resolve_kube
from prefect_nemo.tasks.batch import run_jobs
from prefect_nemo.tasks.dgd import (
    DeployedDgd,
    deploy_dgd,
    own_dgds_by_raycluster,
    teardown_dgds,
    wait_dgd_ready,
)
from prefect_nemo.tasks.experiments import (
    Experiment,
    run_key,
    start_experiment,
    wait_for_experiments,
)
from prefect_nemo.tasks.jobs import run_job, stop_job, submit_job, wait_for_job
from prefect_nemo.tasks.replicas import serve_replicas, start_replicas, stop_replicas
from prefect_nemo.tasks.slurm_ray import slurm_ray_cluster

__all__ = [
    "DeployedDgd",
    "Experiment",
    "deploy_dgd",
    "own_dgds_by_raycluster",
    "resolve_block",
    "resolve_cluster",
    "resolve_kube",
    "run_job",
    "run_jobs",
    "run_key",
    "serve_replicas",
    "slurm_ray_cluster",
    "start_experiment",
    "start_replicas",
    "stop_job",
    "stop_replicas",
    "submit_job",
    "teardown_dgds",
    "wait_dgd_ready",
    "wait_for_experiments",
    "wait_for_job",
]
