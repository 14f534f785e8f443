"""RL with Dynamo: NeMo-RL training as a KubeRay RayJob, rollouts served by Dynamo graphs.

Order (as the nrl-k8s source PR): apply the DynamoGraphDeployment(s), wait until each really
serves, submit the training RayJob with the frontend URL injected into its config, wait for
KubeRay's RayCluster, make that RayCluster an owner (controller=false) of every DGD this run
created, so deleting the RayCluster cascades, then wait for the training job. Whenever the run
ends, the DGDs it created (never ones it attached to) are deleted; the RayJob is stopped by the
job tasks' own cleanup. `dry_run=True` renders every manifest the flow would apply and changes
nothing.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from prefect_nemo import JobSpec, lifecycle, start_experiment, stop_job, submit_job, wait_for_job
from prefect_nemo.backends.kuberay import rayjob_manifest, resolve_ray_cluster_name
from prefect_nemo.blocks.kuberay import KubeRayCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.names import job_id as make_job_id
from prefect_nemo.packaging import tee_command
from prefect_nemo.tasks.dgd import (
    DeployedDgd,
    deploy_dgd,
    deployed_from,
    own_dgds_by_raycluster,
    render_dgd,
    resolve_kube,
    teardown_dgds,
    teardown_now,
    wait_dgd_ready,
)

DEFAULT_URL_ARG = "++policy.generation.dynamo.url={url}"
DEFAULT_URL_ENV = "DYNAMO_FRONTEND_URL"
TRAIN_JOB_NAME = "train"


def _cluster(cluster: KubeRayCluster | str) -> KubeRayCluster:
    if isinstance(cluster, KubeRayCluster):
        return cluster
    if isinstance(cluster, str) and "/" in cluster:
        block = KubeRayCluster.load(cluster.split("/", 1)[1])
        return block
    raise InvalidJobSpec(
        f"cluster: pass a KubeRayCluster block or its saved name ('kube-ray-cluster/NAME'), "
        f"got {cluster!r}"
    )


def _overrides_for(dgd_overrides: Any, count: int) -> list[dict[str, Any] | None]:
    """One overrides mapping per manifest: a list (one each) or one mapping for all."""
    if dgd_overrides is None:
        return [None] * count
    if isinstance(dgd_overrides, Mapping):
        return [dict(dgd_overrides)] * count
    if isinstance(dgd_overrides, Sequence) and not isinstance(dgd_overrides, str):
        if len(dgd_overrides) != count:
            raise InvalidJobSpec(
                f"dgd_overrides: {len(dgd_overrides)} entries for {count} manifests: give one "
                "per manifest (null for none) or a single mapping for all"
            )
        return [dict(o) if o else None for o in dgd_overrides]
    raise InvalidJobSpec("dgd_overrides: expected a mapping or a list of mappings")


def training_spec(
    entrypoint: str,
    urls: Sequence[str],
    *,
    url_arg: str | None,
    url_env: str | None,
    env: Mapping[str, str] | None = None,
    working_dir: str | None = None,
    timeout_s: float | None = None,
    log_path: str | None = None,
) -> JobSpec:
    """The training job with the frontend URL(s) injected: `url_arg` ({url} = the first DGD's
    frontend, {urls} = all, comma-separated) appended to the entrypoint, and/or `url_env` set
    to the first URL (and `<url_env>S` to all of them). With `log_path`, the output is also
    teed to that file in the pod, keeping the command's exit status (POSIX sh, dash too)."""
    command = entrypoint
    if url_arg:
        try:
            arg = url_arg.format(url=urls[0], urls=",".join(urls))
        except (KeyError, IndexError) as exc:
            raise InvalidJobSpec(
                f"frontend_url_arg {url_arg!r}: only {{url}} and {{urls}} are known ({exc})"
            ) from None
        command = f"{entrypoint} {shlex.quote(arg)}"
    if log_path:
        command = tee_command(command, log_path)
    job_env = dict(env or {})
    if url_env:
        job_env[url_env] = urls[0]
        job_env[f"{url_env}S"] = ",".join(urls)
    return JobSpec(
        name=TRAIN_JOB_NAME,
        entrypoint=command,
        env=job_env,
        working_dir=working_dir,
        timeout_s=timeout_s,
    )


@flow(name="rl-with-dynamo", flow_run_name="{experiment}")
def rl_with_dynamo(
    experiment: str,
    dgd_manifests: list[str],
    train_entrypoint: str,
    cluster: KubeRayCluster | str,
    kube: KubernetesCluster | str | None = None,
    dgd_overrides: list[dict[str, Any] | None] | dict[str, Any] | None = None,
    dgd_names: list[str | None] | None = None,
    dgd_version: str = "v1alpha1",
    dgd_labels: dict[str, str] | None = None,
    image: str | None = None,
    image_pull_secrets: list[str] | None = None,
    frontend_url: str | None = None,
    frontend_url_arg: str | None = DEFAULT_URL_ARG,
    frontend_url_env: str | None = DEFAULT_URL_ENV,
    train_env: dict[str, str] | None = None,
    working_dir: str | None = None,
    train_log_path: str | None = None,
    ready_timeout_s: float = 1800.0,
    timeout_s: float | None = None,
    recreate: bool = False,
    keep_dgds: bool = False,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Serve rollouts with Dynamo graphs while NeMo-RL trains on KubeRay; clean up after.

    dgd_manifests: DGD YAML files (multi-document files: the DGD in each). dgd_overrides:
    one mapping deep-merged into every manifest, or one per manifest. dgd_names: rename each
    DGD (None keeps the manifest's name). frontend_url: an explicit URL for the first DGD's
    frontend (an ingress, say); an in-cluster one that names another Service is an error.
    frontend_url_arg / frontend_url_env: how training learns the URL. cluster: the
    KubeRayCluster the training RayJob runs on; kube: where the DGDs go (default: the
    cluster's Kubernetes). train_log_path: also tee training's output to this file (in the
    pod; the exit status is kept). keep_dgds: leave this run's DGDs up after a successful run.
    """
    exp = start_experiment(experiment)
    logger = get_run_logger()
    ray_block = _cluster(cluster)
    kube_block = resolve_kube(kube) if kube is not None else ray_block.kubernetes
    namespace = kube_block.namespace
    if not dgd_manifests:
        raise InvalidJobSpec("dgd_manifests: give at least one DynamoGraphDeployment file")
    names = list(dgd_names or [None] * len(dgd_manifests))
    if len(names) != len(dgd_manifests):
        raise InvalidJobSpec(f"dgd_names: {len(names)} names for {len(dgd_manifests)} manifests")
    overrides = _overrides_for(dgd_overrides, len(dgd_manifests))
    common = {
        "namespace": namespace,
        "labels": dgd_labels,
        "image": image,
        "image_pull_secrets": tuple(image_pull_secrets or ()),
        "version": dgd_version,
    }

    # Everything is rendered and checked before the first API call.
    run_id = exp.flow_run_id
    rendered = [
        render_dgd(
            path, name=name, overrides=ovr, flow_run_id=run_id, experiment=experiment, **common
        )
        for path, name, ovr in zip(dgd_manifests, names, overrides, strict=True)
    ]
    seen_names = [d["metadata"]["name"] for d in rendered]
    if len(set(seen_names)) != len(seen_names):
        raise InvalidJobSpec(
            f"two manifests give the same DGD name: {seen_names}; rename one with dgd_names"
        )
    described = [
        deployed_from(doc, dgd_version, frontend_url=frontend_url if i == 0 else None)
        for i, doc in enumerate(rendered)
    ]
    urls = [d.frontend_url for d in described]
    spec = training_spec(
        train_entrypoint,
        urls,
        url_arg=frontend_url_arg,
        url_env=frontend_url_env,
        env=train_env,
        working_dir=working_dir,
        timeout_s=timeout_s,
        log_path=train_log_path,
    )
    backend = ray_block.backend()
    backend.validate(spec)

    if dry_run:
        return _dry_run(rendered, spec, backend, exp.flow_run_id, experiment, logger)

    deployed: list[DeployedDgd] = []
    try:
        for i, path in enumerate(dgd_manifests):
            deployed.append(
                deploy_dgd(
                    path,
                    kube_block,
                    name=names[i],
                    overrides=overrides[i],
                    frontend_url=(frontend_url if i == 0 else None),
                    recreate=recreate,
                    **common,
                )
            )
        for dgd in deployed:
            wait_dgd_ready(dgd, kube_block, timeout_s=ready_timeout_s)
        result = _train(spec, ray_block, kube_block, deployed, namespace, timeout_s, logger)
    except BaseException as exc:
        # Failure, timeout or cancellation: delete what this run brought up, then re-raise.
        teardown_now(run_id, f"rl_with_dynamo stopped ({type(exc).__name__})")
        raise
    if keep_dgds:
        logger.info("keep_dgds: leaving this run's DGDs up")
    else:
        teardown_dgds()
    outputs = {
        "dgds": [d.model_dump() for d in deployed],
        "frontend_urls": urls,
        "job_id": result.handle.job_id,
        "job_state": result.state.value,
    }
    exp.emit("completed", outputs)
    return outputs


def _train(
    spec: JobSpec,
    ray_block: KubeRayCluster,
    kube_block: KubernetesCluster,
    deployed: list[DeployedDgd],
    namespace: str,
    timeout_s: float | None,
    logger: Any,
) -> Any:
    """Submit the RayJob, tie the DGDs to its RayCluster, and wait for it to end."""
    handle = submit_job(spec, ray_block)
    try:
        api = kube_block.api()
        rayjob_ns = ray_block.namespace or namespace
        cluster_name = resolve_ray_cluster_name(api, handle.job_id, rayjob_ns)
        logger.info(f"training runs on RayCluster {cluster_name}")
        own_dgds_by_raycluster(
            deployed, kube_block, cluster_name, rayjob_ns, rayjob_name=handle.job_id
        )
    except BaseException:
        # The job is not watched yet, so its own cleanup cannot stop it: do it here.
        try:
            stop_job(handle, ray_block)
        except BaseException:
            lifecycle.stop_and_confirm(
                ray_block.backend(), handle.job_id, timeout_s=ray_block.stop_timeout_s
            )
        raise
    return wait_for_job(handle, ray_block, timeout_s=timeout_s)


def _dry_run(
    rendered: list[dict[str, Any]],
    spec: JobSpec,
    backend: Any,
    flow_run_id: str,
    experiment: str,
    logger: Any,
) -> dict[str, Any]:
    """Every manifest the flow would apply, as YAML (log and artifact); nothing is changed."""
    key = spec.name or TRAIN_JOB_NAME
    scope = f"experiment:{experiment}"
    job_id = make_job_id(scope, key, readable=experiment, max_len=backend.max_job_id_len)
    metadata = {
        lifecycle.META_FLOW_RUN: flow_run_id,
        lifecycle.META_KEY: f"{scope}/{key}",
        lifecycle.META_SPEC: spec.fingerprint(),
    }
    rayjob = rayjob_manifest(spec, job_id, metadata, backend.config, namespace=backend.namespace)
    manifests = [*rendered, rayjob]
    text = yaml.safe_dump_all(manifests, sort_keys=False)
    logger.info(f"dry run: {len(rendered)} DGD(s) and RayJob {job_id} would be applied:\n{text}")
    if FlowRunContext.get() is not None:
        create_markdown_artifact(
            f"## rl-with-dynamo dry run\n\nNothing was applied. Manifests:\n\n```yaml\n{text}```",
            description="Manifests rl-with-dynamo would apply (dry run)",
        )
    return {"dry_run": True, "manifests": manifests, "yaml": text}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("train_entrypoint")
    parser.add_argument("--dgd", action="append", required=True, help="DGD manifest file")
    parser.add_argument(
        "--cluster", required=True, help="saved KubeRayCluster, e.g. kube-ray-cluster/prod"
    )
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    out = rl_with_dynamo(
        args.experiment, args.dgd, args.train_entrypoint, args.cluster, dry_run=args.dry_run
    )
    print(out["yaml"] if args.dry_run else out)
