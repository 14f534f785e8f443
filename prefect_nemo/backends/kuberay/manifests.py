"""RayJob manifests, pure: the block's RayJob config (existing cluster XOR inline spec) and its
checks, the checks of a JobSpec a RayJob can carry, and the documents a submit sends (the
RayJob, the Secret of its secret env values, the ConfigMaps of its working_dir), built once for
`submit` and `render` alike. No API call, no Prefect import.

Local code (JobSpec.working_dir) on an inline cluster travels the way `ray job submit` ships a
local working_dir: KubeRay's K8sJobMode submitter runs `ray job submit --runtime-env-json
'<runtimeEnvYAML>' ...` (common/job.go BuildJobSubmitCommand), and Ray's CLI uploads a local
`working_dir` of that runtime env to the cluster's GCS before it submits. So the RayJob gets a
`submitterPodTemplate` whose init container unpacks the code from our ConfigMaps into an
emptyDir that the submitter container (KubeRay fills its command in: it has none) mounts at
`CODE_DIR`, and runtimeEnvYAML says `working_dir: CODE_DIR`.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import SecretStr

from prefect_nemo.backends._kube_objects import (
    check_labels,
    code_configmaps,
    flow_run_of,
    job_object,
    secret_manifest,
    secret_name,
)
from prefect_nemo.backends._kueue import check_block_labels, kueue_target, queue_for_kueue
from prefect_nemo.backends.kuberay.raycluster import check_cluster_spec
from prefect_nemo.backends.ray_jobs import OVERRIDE_RUNTIME_ENV
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.jobs import JobSpec
from prefect_nemo.kube import CONFIGMAP, RAY_JOB, SECRET, Kind
from prefect_nemo.names import is_dns1035_label, is_dns1123_subdomain
from prefect_nemo.placement.spec import to_ray_entrypoint

if TYPE_CHECKING:
    from prefect_nemo.packaging import TransportPlan

SubmissionMode = Literal["K8sJobMode", "HTTPMode", "SidecarMode"]
SUBMISSION_MODES: tuple[str, ...] = ("K8sJobMode", "HTTPMode", "SidecarMode")
MAX_RAYJOB_NAME = 47  # KubeRay's MaxRayJobNameLength
BLOCK = "KubeRayCluster"
# what the submitter's bash would take for itself wherever it stands, quoted or not (expansions,
# globs, history, comments, line breaks): conservative, a false alarm only costs a `bash -c`
_SHELL_ANYWHERE = re.compile(r"[$`~*?\[{!#\n\\]")
# the submitter pod of an inline cluster with working_dir: KubeRay reads the status of the
# container named SUBMITTER (utils.SubmitterContainerName) and fills its command in when it
# has none (configureSubmitterContainer); the resources are GetDefaultSubmitterContainer's
SUBMITTER = "ray-job-submitter"
SUBMITTER_RESOURCES: dict[str, dict[str, str]] = {
    "limits": {"cpu": "1", "memory": "1Gi"},
    "requests": {"cpu": "500m", "memory": "200Mi"},
}
UNPACK = "prefect-nemo-unpack-code"  # the init container that unpacks the ConfigMaps
CODE_VOLUME = "prefect-nemo-code-dir"  # the emptyDir it unpacks into
CODE_DIR = "/prefect-nemo/code"  # where the submitter sees the code: runtimeEnvYAML working_dir

# -------------------------------------------------------------------------------------------
# Configuration and validation (pure: no API calls)


@dataclass(frozen=True)
class RayJobConfig:
    """Where and how RayJobs run: the cluster (existing name XOR inline spec) and KubeRay knobs."""

    ray_cluster_name: str | None = None
    ray_cluster_spec: dict[str, Any] | None = None
    shutdown_after_job_finishes: bool = True
    ttl_seconds_after_finished: int = 60
    submission_mode: str = "K8sJobMode"
    active_deadline_seconds: int | None = None
    # keep a failed job's head this long, its workers released at once (deletionRules)
    keep_failed_head_s: int | None = None
    queue_name: str | None = None  # Kueue LocalQueue (the queue-name label)
    priority_class: str | None = None  # Kueue WorkloadPriorityClass (the priority-class label)

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def inline(self) -> bool:
        """True when each RayJob brings its own cluster (rayClusterSpec)."""
        return self.ray_cluster_spec is not None

    @property
    def cluster_ends_with_each_job(self) -> bool:
        """True when KubeRay tears a job's cluster down once its RayJob ends, failed or not
        (its own cluster, shutdownAfterJobFinishes, no failed head kept)."""
        return self.inline and self.shutdown_after_job_finishes and self.keep_failed_head_s is None


def check_config(config: RayJobConfig) -> None:
    """Raise InvalidJobSpec naming the field and the fix for a config KubeRay would reject."""
    if (config.ray_cluster_name is None) == (config.ray_cluster_spec is None):
        raise InvalidJobSpec(
            "KubeRayCluster: set exactly one of ray_cluster_name (run on an existing RayCluster) "
            "or ray_cluster_spec (each RayJob brings its own cluster)"
        )
    if config.ray_cluster_name is not None and not (
        is_dns1123_subdomain(config.ray_cluster_name, 63)
    ):
        raise InvalidJobSpec(
            f"KubeRayCluster.ray_cluster_name: '{config.ray_cluster_name}' is not a Kubernetes "
            "object name: use lowercase letters, digits and '-', at most 63 characters"
        )
    if config.submission_mode not in SUBMISSION_MODES:
        raise InvalidJobSpec(
            f"KubeRayCluster.submission_mode: '{config.submission_mode}' is not one of "
            f"{', '.join(SUBMISSION_MODES)} (InteractiveMode needs a person to submit the job)"
        )
    if config.ray_cluster_name is not None and config.submission_mode == "SidecarMode":
        raise InvalidJobSpec(
            "KubeRayCluster.submission_mode: KubeRay does not support SidecarMode with an "
            "existing cluster (ray_cluster_name): use K8sJobMode or HTTPMode"
        )
    if config.ttl_seconds_after_finished < 0:
        raise InvalidJobSpec(
            "KubeRayCluster.ttl_seconds_after_finished: must be >= 0 (seconds the finished "
            "cluster stays up, for its logs)"
        )
    if config.active_deadline_seconds is not None and config.active_deadline_seconds <= 0:
        raise InvalidJobSpec(
            "KubeRayCluster.active_deadline_seconds: must be a positive number of seconds, or "
            "unset (JobSpec.timeout_s already stops the job)"
        )
    if config.keep_failed_head_s is not None:
        _check_keep_failed_head(config)
    if config.ray_cluster_spec is not None:
        check_cluster_spec(config.ray_cluster_spec)
    check_block_labels(config.queue_name, config.priority_class, BLOCK)
    _check_kueue(config, "KubeRayCluster.queue_name" if config.queue_name else None)


def _check_keep_failed_head(config: RayJobConfig) -> None:
    """KubeRay (v1.6 validation.go, validateDeletionRules): deletionRules replace
    shutdownAfterJobFinishes ("mutually exclusive"), cannot delete an existing cluster ("not
    supported when ClusterSelector is set") nor release the workers of an autoscaling one
    ("'DeleteWorkers' not supported with autoscaling enabled")."""
    field = "KubeRayCluster.keep_failed_head_s"
    if config.keep_failed_head_s is not None and config.keep_failed_head_s < 0:
        raise InvalidJobSpec(f"{field}: must be >= 0 seconds, or unset")
    if config.ray_cluster_spec is None:
        raise InvalidJobSpec(
            f"{field}: only a job's own cluster (ray_cluster_spec) is kept or deleted; an "
            "existing RayCluster (ray_cluster_name) is never deleted: unset it"
        )
    if not config.shutdown_after_job_finishes:
        raise InvalidJobSpec(
            f"{field}: says when a failed job's cluster goes, but "
            "KubeRayCluster.shutdown_after_job_finishes=False keeps every cluster: drop one"
        )
    if config.ray_cluster_spec.get("enableInTreeAutoscaling"):
        raise InvalidJobSpec(
            f"{field}: KubeRay cannot release the workers of an autoscaling cluster "
            "(ray_cluster_spec.enableInTreeAutoscaling): unset one of them"
        )


def deletion_rules(config: RayJobConfig) -> list[dict[str, Any]]:
    """KubeRay >= 1.5 `deletionStrategy.deletionRules` for keep_failed_head_s: a succeeded job's
    cluster goes after ttl_seconds_after_finished, as with shutdownAfterJobFinishes; a failed
    one (its Ray job FAILED, or its submission: jobDeploymentStatus Failed) loses its workers
    at once and its head after keep_failed_head_s, so its logs stay readable meanwhile."""
    keep = config.keep_failed_head_s or 0
    rules = [{"policy": "DeleteCluster", "condition": {
        "jobStatus": "SUCCEEDED", "ttlSeconds": config.ttl_seconds_after_finished}}]  # fmt: skip
    for condition in ({"jobStatus": "FAILED"}, {"jobDeploymentStatus": "Failed"}):
        rules += [
            {"policy": "DeleteWorkers", "condition": {**condition, "ttlSeconds": 0}},
            {"policy": "DeleteCluster", "condition": {**condition, "ttlSeconds": keep}},
        ]
    return rules


def _check_kueue(config: RayJobConfig, queue_field: str | None) -> None:
    """Kueue docs, "Run A RayJob", limitations: "A Kueue managed RayJob cannot use an existing
    RayCluster" and "The RayCluster should be deleted at the end of the job execution,
    spec.ShutdownAfterJobFinishes should be true"."""
    if queue_field is None:
        return
    if config.ray_cluster_name is not None:
        raise InvalidJobSpec(
            f"{queue_field}: Kueue cannot queue a RayJob that runs on an existing RayCluster "
            f"(KubeRayCluster.ray_cluster_name='{config.ray_cluster_name}'; Kueue docs, RayJob "
            "limitations): give the block a ray_cluster_spec (each job brings its own cluster), "
            "or drop the queue"
        )
    if not config.shutdown_after_job_finishes:
        raise InvalidJobSpec(
            f"{queue_field}: a RayJob queued by Kueue must delete its cluster when it ends "
            "(Kueue docs, RayJob limitations: shutdownAfterJobFinishes true): set "
            "KubeRayCluster.shutdown_after_job_finishes=True, or drop the queue"
        )
    if config.keep_failed_head_s is not None:
        raise InvalidJobSpec(
            f"{queue_field}: a RayJob queued by Kueue must delete its cluster when it ends "
            "(Kueue docs, RayJob limitations: shutdownAfterJobFinishes true), which "
            "KubeRayCluster.keep_failed_head_s replaces: unset it, or drop the queue"
        )


def check_spec(spec: JobSpec, config: RayJobConfig) -> None:
    """Raise InvalidJobSpec for what a RayJob cannot carry; sends nothing."""
    res = spec.resources
    if res.memory_bytes is not None:
        raise InvalidJobSpec(
            "JobSpec.resources.memory_bytes: a RayJob has no entrypoint memory field: drop it, "
            "or run through the Ray Jobs backend (ray_jobs_block) against the cluster"
        )
    if spec.label_selector:
        raise InvalidJobSpec(
            "JobSpec.label_selector: a RayJob has no entrypoint label selector: drop it, or use "
            "entrypoint resources (JobSpec.resources.custom) to steer the driver"
        )
    placement = spec.placement
    if placement is not None:
        if placement.nodes != 1:
            raise InvalidJobSpec(
                f"JobSpec.placement.nodes: {placement.nodes}, but a RayJob's entrypoint runs on "
                "one node: use nodes=1 (strategy='pack') and put multi-node work in the "
                "RayCluster spec (its worker groups), where the job's own Ray tasks spread"
            )
        if placement.node_labels:
            raise InvalidJobSpec(
                "JobSpec.placement.node_labels: a RayJob has no entrypoint label selector: drop "
                "them, or steer the driver with entrypoint resources (JobSpec.resources.custom)"
            )
        if placement.exclude_head:
            raise InvalidJobSpec(
                "JobSpec.placement.exclude_head: a RayJob cannot keep its entrypoint off the "
                "head (that needs a label selector): drop it, or give the head no CPUs in the "
                "RayCluster spec (rayStartParams num-cpus: '0') so the driver lands on a worker"
            )
    if spec.secret_values() and not config.inline:
        names = ", ".join(k for k, v in spec.env.items() if isinstance(v, SecretStr))
        raise InvalidJobSpec(
            f"JobSpec.env: {names} are secrets, and with an existing cluster (ray_cluster_name) "
            "they could only travel inside the RayJob object, which anyone who may read RayJobs "
            "can read. Put them in a Kubernetes Secret mounted in the RayCluster's pods, or use "
            "an inline ray_cluster_spec (prefect-nemo then creates and mounts the Secret)"
        )
    if spec.working_dir is not None and config.inline:
        _check_code_submitter(config)
    try:
        runtime_env_yaml(spec.runtime_env)
        json.dumps(spec.runtime_env, allow_nan=False)
    except (TypeError, ValueError, yaml.YAMLError) as exc:
        raise InvalidJobSpec(
            f"JobSpec.runtime_env: must be plain data (it travels as YAML in the RayJob): {exc}"
        ) from None
    check_labels(spec.labels)
    target = kueue_target(spec, config.queue_name, config.priority_class, BLOCK)
    if target is not None:
        _check_kueue(config, "JobSpec.queue" if spec.queue else f"{BLOCK}.queue_name")


def _check_code_submitter(config: RayJobConfig) -> None:
    """working_dir on an inline cluster rides on the K8sJobMode submitter pod (module doc)."""
    mode = config.submission_mode
    if mode != "K8sJobMode":
        why = {
            "HTTPMode": "the operator posts the job to Ray itself, with no pod to carry files",
            "SidecarMode": "KubeRay refuses a submitterPodTemplate in SidecarMode",
        }.get(mode, "only K8sJobMode runs a submitter pod")
        raise InvalidJobSpec(
            f"JobSpec.working_dir: with an inline ray_cluster_spec the code travels in the "
            f"K8sJobMode submitter pod, which KubeRayCluster.submission_mode='{mode}' has not "
            f"({why}): use submission_mode='K8sJobMode', run on an existing cluster "
            "(ray_cluster_name), or bake the code into the image"
        )
    head_pod = (config.ray_cluster_spec or {})["headGroupSpec"]["template"]["spec"]
    if not head_pod["containers"][0].get("image"):
        raise InvalidJobSpec(
            "KubeRayCluster.ray_cluster_spec.headGroupSpec.template.spec.containers[0].image: "
            "needed with working_dir (the submitter pod that uploads the code runs the head's "
            "image): set the Ray image there"
        )


def check_job_id(job_id: str) -> None:
    """KubeRay refuses RayJob names over 47 characters or not DNS-1035."""
    if not is_dns1035_label(job_id, MAX_RAYJOB_NAME):
        raise InvalidJobSpec(
            f"job id '{job_id}' cannot name a RayJob: KubeRay wants a DNS-1035 label of at most "
            f"{MAX_RAYJOB_NAME} characters: use a shorter JobSpec.name or experiment name"
        )


# -------------------------------------------------------------------------------------------
# Manifests (pure)


def submitted_entrypoint(entrypoint: str, mode: str) -> str:
    """The RayJob's `entrypoint` for `entrypoint` in submission `mode`. K8sJobMode and
    SidecarMode paste it unquoted into the submitter's bash line (`ray job submit ... --
    <entrypoint>`, kuberay#3802/#3929): in `a; b` only `a` would reach Ray and `b` would run in
    the submitter pod, and its backticks and `$VAR` too. One `bash -c '<entrypoint>'` word keeps
    the whole command for Ray (whose CLI joins the words back, quoted: shlex.join); a command of
    plain and quoted words goes as it is (KubeRay keeps quotes since #2949)."""
    if mode == "HTTPMode" or not _submitter_shell_would_change(entrypoint):
        return entrypoint
    return f"bash -c {shlex.quote(entrypoint)}"


def _submitter_shell_would_change(entrypoint: str) -> bool:
    """True when bash would do more with `entrypoint` than split it into (quoted) words."""
    if _SHELL_ANYWHERE.search(entrypoint):
        return True
    lexer = shlex.shlex(entrypoint, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:  # an operator (; && | > < & ( )) outside quotes is a token of its own
        return any(token and set(token) <= set(lexer.punctuation_chars) for token in lexer)
    except ValueError:  # unbalanced quotes
        return True


#: libyaml's emitter where PyYAML has it (the same text, ~5x faster: a batch of 1,000 RayJobs
#: dumps 4,000 runtime envs, validation's dry builds included)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def runtime_env_yaml(runtime_env: dict[str, Any]) -> str:
    """A runtime env as the RayJob's runtimeEnvYAML (keys sorted: the same env, the same text)."""
    return str(yaml.dump(runtime_env, Dumper=_SAFE_DUMPER, sort_keys=True))


def rayjob_manifest(
    spec: JobSpec,
    job_id: str,
    metadata: dict[str, str],
    config: RayJobConfig,
    *,
    namespace: str,
    working_dir_uri: str | None = None,
    plan: TransportPlan | None = None,
) -> dict[str, Any]:
    """The RayJob for a job: everything but secret env values, which go to `secret_manifest`.
    working_dir: on an existing cluster the gcs:// URI of the uploaded package
    (`working_dir_uri`), on an inline one the submitter pod that unpacks `plan` (module doc)."""
    runtime_env: dict[str, Any] = dict(spec.runtime_env)
    plain = {k: v for k, v in spec.env.items() if isinstance(v, str)}  # secrets: the Secret
    runtime_env["env_vars"] = {**plain, **OVERRIDE_RUNTIME_ENV}
    if working_dir_uri is not None:
        runtime_env["working_dir"] = working_dir_uri
    if plan is not None:
        runtime_env["working_dir"] = CODE_DIR  # a local path of the submitter: Ray uploads it
    body: dict[str, Any] = {
        "entrypoint": submitted_entrypoint(spec.entrypoint or "", config.submission_mode),
        "jobId": job_id,
        "metadata": {**spec.metadata, **metadata},
        "runtimeEnvYAML": runtime_env_yaml(runtime_env),
        "submissionMode": config.submission_mode,
    }
    res = spec.resources
    if res.cpus is not None:
        body["entrypointNumCpus"] = res.cpus
    if res.gpus is not None:
        body["entrypointNumGpus"] = res.gpus
    if spec.placement is not None:  # check_spec refused what a RayJob cannot say
        placed, _ = to_ray_entrypoint(spec.placement)
        if "entrypoint_num_cpus" in placed:
            body["entrypointNumCpus"] = placed["entrypoint_num_cpus"]
        if "entrypoint_num_gpus" in placed:
            body["entrypointNumGpus"] = placed["entrypoint_num_gpus"]
    if res.custom:
        body["entrypointResources"] = json.dumps(dict(res.custom), sort_keys=True)
    if config.active_deadline_seconds is not None:
        body["activeDeadlineSeconds"] = config.active_deadline_seconds
    if config.ray_cluster_spec is not None:
        cluster_spec = copy.deepcopy(config.ray_cluster_spec)
        if spec.secret_values():
            _mount_secret(cluster_spec, secret_name(job_id))
        body["rayClusterSpec"] = cluster_spec
        if plan is not None:
            body["submitterPodTemplate"] = submitter_template(config.ray_cluster_spec, plan)
        if config.keep_failed_head_s is not None:  # instead of shutdownAfterJobFinishes
            body["deletionStrategy"] = {"deletionRules": deletion_rules(config)}
        else:
            body["shutdownAfterJobFinishes"] = config.shutdown_after_job_finishes
            if config.shutdown_after_job_finishes:
                body["ttlSecondsAfterFinished"] = config.ttl_seconds_after_finished
    else:
        body["clusterSelector"] = {"ray.io/cluster": str(config.ray_cluster_name)}
    owned: dict[str, list[str]] = {}
    if spec.secret_values():
        owned["secrets"] = [secret_name(job_id)]
    if plan is not None:
        owned["configmaps"] = [cm["metadata"]["name"] for cm in plan.configmaps]
    manifest = job_object(
        RAY_JOB, job_id, spec, metadata, body, namespace=namespace, owned=owned or None,
        shrink="JobSpec.entrypoint/env/runtime_env/metadata or ray_cluster_spec",
    )  # fmt: skip
    return queue_for_kueue(
        manifest, kueue_target(spec, config.queue_name, config.priority_class, BLOCK)
    )


def submitter_template(cluster_spec: dict[str, Any], plan: TransportPlan) -> dict[str, Any]:
    """The K8sJobMode submitter pod for an inline cluster with working_dir: an init container
    unpacks the ConfigMaps (checking their sha256) into an emptyDir, which KubeRay's submitter
    container mounts at CODE_DIR. Both run the head's image (KubeRay's default submitter
    does too: its Ray version matches the cluster's, and it has python3, sh and tar)."""
    head_pod = cluster_spec["headGroupSpec"]["template"]["spec"]
    image = head_pod["containers"][0]["image"]
    unpack = {
        "name": UNPACK,
        "image": image,
        "command": ["sh", "-c", plan.setup_command(CODE_DIR)],
        "volumeMounts": [*plan.volume_mounts, {"name": CODE_VOLUME, "mountPath": CODE_DIR}],
        "resources": copy.deepcopy(SUBMITTER_RESOURCES),
    }
    submitter = {
        "name": SUBMITTER,
        "image": image,
        "resources": copy.deepcopy(SUBMITTER_RESOURCES),
        "volumeMounts": [{"name": CODE_VOLUME, "mountPath": CODE_DIR, "readOnly": True}],
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # as KubeRay's default: the Job retries with a new pod
        "volumes": [*copy.deepcopy(plan.volumes), {"name": CODE_VOLUME, "emptyDir": {}}],
        "initContainers": [unpack],
        "containers": [submitter],
    }
    if pull := head_pod.get("imagePullSecrets"):  # the same image, from the same registry
        pod["imagePullSecrets"] = copy.deepcopy(pull)
    return {"spec": pod}


def _mount_secret(cluster_spec: dict[str, Any], name: str) -> None:
    """Add `envFrom: secretRef` to every container of the head and worker groups."""
    groups = [cluster_spec["headGroupSpec"], *cluster_spec.get("workerGroupSpecs", [])]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            container.setdefault("envFrom", []).append({"secretRef": {"name": name}})


def rayjob_documents(
    spec: JobSpec,
    job_id: str,
    metadata: dict[str, str],
    config: RayJobConfig,
    *,
    namespace: str,
    working_dir_uri: str | None = None,
    plan: TransportPlan | None = None,
) -> tuple[dict[str, Any], list[tuple[Kind, dict[str, Any]]]]:
    """What a submit sends, built once for `submit` and `render`: the RayJob and the objects
    it owns, created before it (the Secret of the secret env values, when there are any, and
    the ConfigMaps of working_dir on an inline cluster)."""
    manifest = rayjob_manifest(
        spec, job_id, metadata, config, namespace=namespace, working_dir_uri=working_dir_uri,
        plan=plan,
    )  # fmt: skip
    flow_run_id = flow_run_of(metadata)
    secret = secret_manifest(spec, job_id, namespace=namespace, flow_run_id=flow_run_id)
    owned: list[tuple[Kind, dict[str, Any]]] = [(SECRET, secret)] if secret is not None else []
    if plan is not None:
        cms = code_configmaps(plan, namespace=namespace, flow_run_id=flow_run_id)
        owned += [(CONFIGMAP, cm) for cm in cms]
    return manifest, owned
