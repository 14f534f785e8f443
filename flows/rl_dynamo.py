"""RL with Dynamo: NeMo-RL training as a KubeRay RayJob, rollouts served by Dynamo graphs.

Order (as the nrl-k8s source PR): apply the DynamoGraphDeployment(s), wait until each really
serves, submit the training RayJob with the recipe pointed at them, wait for KubeRay's
RayCluster, make that RayCluster an owner (controller=false) of every DGD this run created, so
deleting the RayCluster cascades, then wait for the training job. Whenever the run ends, the
DGDs it created (never ones it attached to) are deleted; the RayJob is stopped by the job
tasks' own cleanup. `dry_run=True` renders every manifest the flow would apply and changes
nothing.

The recipe (NeMo-RL's `policy.generation.dynamo_cfg`, as nrl-k8s stamps it): with exactly one
DGD declared, training gets `++policy.generation.backend=dynamo` and
`++policy.generation.dynamo_cfg.dgd_name=<its name after overrides>` (Hydra overrides, later
ones win); with several, the recipe is left alone (the entrypoint says which DGD is which).
A user-managed DGD is named by `frontend_url` (stamped as `dynamo_cfg.frontend_url`): it is
never applied, owned or deleted by us. `dgd_name` and `frontend_url` are mutually exclusive.
DGDs and the RayJob share one namespace: an owner in another namespace is treated as absent by
Kubernetes' garbage collector, which would delete the DGDs as training starts.
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
from prefect_nemo.backends.dynamo import FRONTEND_PORT
from prefect_nemo.backends.kuberay import resolve_ray_cluster_name
from prefect_nemo.blocks.kuberay import KubeRayCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.errors import InvalidJobSpec
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

DEFAULT_URL_ENV = "DYNAMO_FRONTEND_URL"
TRAIN_JOB_NAME = "train"
BACKEND_KEY = "policy.generation.backend"
DGD_NAME_KEY = "policy.generation.dynamo_cfg.dgd_name"
FRONTEND_URL_KEY = "policy.generation.dynamo_cfg.frontend_url"
FRONTEND_PORT_KEY = "policy.generation.dynamo_cfg.frontend_port"


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


def recipe_overrides(
    entrypoint: str,
    dgd_names: Sequence[str],
    *,
    frontend_url: str | None = None,
    frontend_port: int = FRONTEND_PORT,
) -> list[str]:
    """The Hydra overrides that point NeMo-RL's recipe at the rollout server, as nrl-k8s
    stamps them: for exactly one DGD, `++policy.generation.backend=dynamo` and
    `++policy.generation.dynamo_cfg.dgd_name=<name>` (plus `frontend_port` when not 8000);
    for several, none; for a user-managed DGD (`frontend_url`), the backend and its
    `frontend_url`. InvalidJobSpec when dgd_name and frontend_url would both be set (from
    these arguments or from the entrypoint's own overrides): NeMo-RL takes exactly one."""
    own = _recipe_keys(entrypoint)
    name_from = (
        f"the one DGD declared ({dgd_names[0]!r})" if len(dgd_names) == 1
        else f"the entrypoint's {DGD_NAME_KEY}" if DGD_NAME_KEY in own else None
    )  # fmt: skip
    url_from = (
        f"frontend_url={frontend_url!r}" if frontend_url is not None
        else f"the entrypoint's {FRONTEND_URL_KEY}" if FRONTEND_URL_KEY in own else None
    )  # fmt: skip
    if name_from and url_from:
        raise InvalidJobSpec(
            f"{DGD_NAME_KEY} and {FRONTEND_URL_KEY} are mutually exclusive (NeMo-RL's "
            f"dynamo_cfg takes exactly one), but dgd_name comes from {name_from} and "
            f"frontend_url from {url_from}. Fix: drop frontend_url to train against the DGD "
            "this flow deploys, or declare no rollout DGD here (and no dgd_name override) to "
            "use the DGD you manage yourself"
        )
    if len(dgd_names) == 1:
        stamped = [f"++{BACKEND_KEY}=dynamo", f"++{DGD_NAME_KEY}={dgd_names[0]}"]
        if frontend_port != FRONTEND_PORT:
            stamped.append(f"++{FRONTEND_PORT_KEY}={frontend_port}")
        return stamped
    if frontend_url is not None:
        return [f"++{BACKEND_KEY}=dynamo", f"++{FRONTEND_URL_KEY}={frontend_url}"]
    return []


def _recipe_keys(entrypoint: str) -> set[str]:
    """The dynamo_cfg keys the entrypoint's own Hydra overrides set (`key=`, `+key=`,
    `++key=`)."""
    try:
        words = shlex.split(entrypoint)
    except ValueError:
        words = entrypoint.split()
    keys = {w.lstrip("+").split("=", 1)[0] for w in words if "=" in w}
    return keys & {DGD_NAME_KEY, FRONTEND_URL_KEY}


def training_spec(
    entrypoint: str,
    urls: Sequence[str],
    *,
    overrides: Sequence[str] = (),
    url_arg: str | None = None,
    url_env: str | None = DEFAULT_URL_ENV,
    env: Mapping[str, str] | None = None,
    working_dir: str | None = None,
    timeout_s: float | None = None,
    log_path: str | None = None,
) -> JobSpec:
    """The training job: `overrides` (recipe_overrides) appended to the entrypoint; optionally
    `url_arg` ({url} = the first frontend, {urls} = all, comma-separated) too, and `url_env`
    set to the first URL (`<url_env>S` to all of them). With `log_path`, the output is also
    teed to that file in the pod, keeping the command's exit status (POSIX sh, dash too)."""
    args = list(overrides)
    if url_arg:
        try:
            args.append(url_arg.format(url=urls[0], urls=",".join(urls)))
        except (KeyError, IndexError) as exc:
            raise InvalidJobSpec(
                f"frontend_url_arg {url_arg!r}: only {{url}} and {{urls}} are known ({exc})"
            ) from None
    command = " ".join([entrypoint, *(shlex.quote(a) for a in args)])
    if log_path:
        command = tee_command(command, log_path)
    job_env = dict(env or {})
    if url_env and urls:
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
    frontend_port: int = FRONTEND_PORT,
    frontend_url_arg: str | None = None,
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
    DGD (None keeps the manifest's name). With one DGD the recipe gets
    policy.generation.backend=dynamo and its dynamo_cfg.dgd_name; with several it is left
    alone. frontend_url: the frontend of a DGD you manage (never applied, owned or deleted
    here), stamped as dynamo_cfg.frontend_url; it excludes a single declared DGD (NeMo-RL
    takes dgd_name or frontend_url). frontend_port: the port the frontends serve on (8000;
    probed for readiness). frontend_url_arg / frontend_url_env: also tell training the URL(s)
    as an argument / env var. cluster: the KubeRayCluster the training RayJob runs on; kube:
    credentials for the DGDs (default: the cluster's), in the RayJob's namespace (an owner
    reference cannot cross namespaces). train_log_path: also tee training's output to this
    file (in the pod; the exit status is kept). keep_dgds: leave this run's DGDs up after a
    successful run.
    """
    exp = start_experiment(experiment)
    logger = get_run_logger()
    ray_block = _cluster(cluster)
    train_ns = ray_block.target_namespace()  # where its RayJob (and RayCluster) are made
    kube_block = resolve_kube(kube) if kube is not None else ray_block.kubernetes
    namespace = kube_block.namespace if kube is not None else train_ns
    if not dgd_manifests and frontend_url is None:
        raise InvalidJobSpec(
            "dgd_manifests: give at least one DynamoGraphDeployment file, or frontend_url for "
            "a DGD you manage yourself"
        )
    if dgd_manifests and namespace != train_ns:
        raise InvalidJobSpec(
            f"kube puts the DGDs in namespace {namespace!r} but cluster runs the training "
            f"RayJob (and its RayCluster) in {train_ns!r}: a DGD can only be owned by a "
            "RayCluster in its own namespace (Kubernetes treats an owner in another namespace "
            "as absent and would delete the DGDs as training starts). Use one namespace: pass "
            f"kube for {train_ns!r}, or set the KubeRayCluster's namespace to {namespace!r}"
        )
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
    described = [deployed_from(doc, dgd_version, frontend_port=frontend_port) for doc in rendered]
    urls = [d.frontend_url for d in described]
    if frontend_url is not None:
        urls.insert(0, _user_url(frontend_url))
    spec = training_spec(
        train_entrypoint,
        urls,
        overrides=recipe_overrides(
            train_entrypoint, seen_names, frontend_url=frontend_url, frontend_port=frontend_port
        ),
        url_arg=frontend_url_arg,
        url_env=frontend_url_env,
        env=train_env,
        working_dir=working_dir,
        timeout_s=timeout_s,
        log_path=train_log_path,
    )
    ray_block.backend().validate(spec)
    deploys = [
        {"name": name, "overrides": ovr, "frontend_port": frontend_port, **common}
        for name, ovr in zip(names, overrides, strict=True)
    ]
    if dry_run:
        return _dry_run(dgd_manifests, deploys, kube_block, spec, ray_block, logger)

    deployed: list[DeployedDgd] = []
    try:
        for path, args in zip(dgd_manifests, deploys, strict=True):
            deployed.append(deploy_dgd(path, kube_block, recreate=recreate, **args))
        for dgd in deployed:
            wait_dgd_ready(dgd, kube_block, timeout_s=ready_timeout_s)
        result = _train(spec, ray_block, kube_block, deployed, timeout_s, logger)
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


def _user_url(url: str) -> str:
    """The frontend URL of a user-managed DGD, checked for shape only (it is theirs)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidJobSpec(
            f"frontend_url {url!r} is not an http(s) URL: give the frontend of your DGD, e.g. "
            "http://my-dgd-frontend.my-ns.svc.cluster.local:8000/v1"
        )
    return url


def _train(
    spec: JobSpec,
    ray_block: KubeRayCluster,
    kube_block: KubernetesCluster,
    deployed: list[DeployedDgd],
    timeout_s: float | None,
    logger: Any,
) -> Any:
    """Submit the RayJob, tie the DGDs to its RayCluster, and wait for it to end."""
    handle = submit_job(spec, ray_block)
    try:
        if any(d.created_by_this_run for d in deployed):
            # the RayJob is where the block made it: its backend's API and namespace
            backend = ray_block.backend()
            cluster_name = resolve_ray_cluster_name(backend.api, handle.job_id, backend.namespace)
            logger.info(f"training runs on RayCluster {cluster_name}")
            own_dgds_by_raycluster(
                deployed, kube_block, cluster_name, backend.namespace, rayjob_name=handle.job_id
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
    manifests: list[str],
    deploys: list[dict[str, Any]],
    kube_block: KubernetesCluster,
    spec: JobSpec,
    ray_block: KubeRayCluster,
    logger: Any,
) -> dict[str, Any]:
    """Every manifest the flow would apply, rendered by the same tasks a real run uses
    (deploy_dgd and submit_job with dry_run, secrets masked), as YAML (log and artifact);
    nothing is changed."""
    dgds = [
        deploy_dgd(path, kube_block, dry_run=True, **args)
        for path, args in zip(manifests, deploys, strict=True)
    ]
    job = submit_job(spec, ray_block, dry_run=True)
    documents = [*dgds, *job.documents]
    text = yaml.safe_dump_all(documents, sort_keys=False)
    logger.info(f"dry run: {len(dgds)} DGD(s) and RayJob {job.job_id} would be applied:\n{text}")
    if FlowRunContext.get() is not None:
        create_markdown_artifact(
            f"## rl-with-dynamo dry run\n\nNothing was applied. Manifests:\n\n```yaml\n{text}```",
            description="Manifests rl-with-dynamo would apply (dry run)",
        )
    return {"dry_run": True, "manifests": documents, "yaml": text}


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
