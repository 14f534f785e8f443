"""Why a Kubernetes job FAILED (issue 29): the RayJob and TrainJob backends set
`JobStatus.failure` from what Kubernetes says, on the loopback API server with objects shaped as
the real controllers write them. Each test quotes the rule it relies on.

The pods (and the Nodes they ran on) are read once per failed job object, never per poll; a plain
non-zero exit code sets no failure: the lifecycle then reads the log tail (an NCCL error exits 1
too) and calls it an application error otherwise.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from prefect_nemo.backends._kube_objects import pod_failure
from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend
from prefect_nemo.backends.kubeflow.runtimes import TrainerConfig
from prefect_nemo.backends.kuberay.manifests import RayJobConfig
from prefect_nemo.backends.kuberay.rayjob import JOB_NAME_LABEL, KubeRayBackend
from prefect_nemo.jobs import Failure, FailureClass, JobState
from prefect_nemo.kube import MANAGED_BY, NODE, POD, RAY_JOB, TRAIN_JOB, KubeApi

T = "2026-11-29T06:00:00Z"
MANAGED = {MANAGED_BY: "prefect-nemo"}


def uid() -> str:
    return uuid.uuid4().hex[:6]


def node(api: KubeApi, name: str, ready: str, reason: str) -> None:
    """A Node whose Ready condition is `ready` (the node lifecycle controller, when the kubelet
    stops posting: status Unknown, reason "NodeStatusUnknown", node_lifecycle_controller.go)."""
    api.create(NODE, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    api.patch(NODE, name, {"status": {"conditions": [{
        "type": "Ready", "status": ready, "reason": reason, "lastHeartbeatTime": T,
        "lastTransitionTime": T}]}}, subresource="status")  # fmt: skip


def pod(
    api: KubeApi, name: str, labels: dict[str, str], node_name: str, status: dict[str, Any]
) -> None:
    """A pod bound to `node_name` with `status` (as its kubelet or a controller wrote it)."""
    api.create(POD, {"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": name, "labels": {**MANAGED, **labels}},
                     "spec": {"nodeName": node_name, "containers": [
                         {"name": "node", "image": "python:3.11"}]}})  # fmt: skip
    api.patch(POD, name, {"status": status}, subresource="status")


def terminated(code: int, reason: str = "Error") -> dict[str, Any]:
    return {"name": "node", "image": "python:3.11", "imageID": "", "ready": False,
            "restartCount": 0, "state": {"terminated": {
                "exitCode": code, "reason": reason, "startedAt": T, "finishedAt": T}}}  # fmt: skip


def disrupted(reason: str, message: str) -> dict[str, Any]:
    return {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": T}  # fmt: skip


def failed_trainjob(api: KubeApi, name: str, reason: str = "FailedJobs") -> None:
    """A TrainJob the Trainer marked Failed: it copies the JobSet's Failed condition (Trainer
    v2.3.0 jobset plugin: `failed.Type = trainer.TrainJobFailed`), reason "FailedJobs",
    "jobset failed due to one or more job failures" (JobSet v0.12.0 constants.go)."""
    api.create(TRAIN_JOB, {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "labels": MANAGED},
        "spec": {"runtimeRef": {"name": "torch"}, "trainer": {"numNodes": 2}}})  # fmt: skip
    api.patch(TRAIN_JOB, name, {"status": {"conditions": [{
        "type": "Failed", "status": "True", "reason": reason,
        "message": "jobset failed due to one or more job failures",
        "lastTransitionTime": T}]}}, subresource="status")  # fmt: skip


def trainjob_pod(api: KubeApi, job: str, index: int, node_name: str, status: dict) -> None:
    labels = {"jobset.sigs.k8s.io/jobset-name": job,
              "batch.kubernetes.io/job-completion-index": str(index)}  # fmt: skip
    pod(api, f"{job}-node-0-{index}", labels, node_name, status)


@pytest.fixture
def api(kube_server: Any) -> KubeApi:
    return KubeApi(kube_server.api_client(), namespace="default")


def test_a_trainjob_whose_node_was_lost_fails_as_infrastructure_naming_the_node(
    api: KubeApi, kube_server: Any
) -> None:
    """Kubernetes' taint-eviction-controller (taint_eviction.go) deletes the pods of a node
    tainted NoExecute (unreachable) with the condition DisruptionTarget, reason
    "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"; the node
    lifecycle controller set the Node's Ready Unknown, "NodeStatusUnknown". The node's pod is
    the cause, not its sibling, which torchrun's agent killed (137). The pods and the Node are
    read once: a second poll asks nothing."""
    lost, healthy, job = f"lost-{uid()}", f"ok-{uid()}", f"tj-{uid()}"
    node(api, lost, "Unknown", "NodeStatusUnknown")
    node(api, healthy, "True", "KubeletReady")
    failed_trainjob(api, job)
    trainjob_pod(api, job, 0, healthy, {"phase": "Failed", "containerStatuses": [
        terminated(137)]})  # fmt: skip
    trainjob_pod(api, job, 1, lost, {"phase": "Running", "conditions": [disrupted(
        "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint")]})  # fmt: skip
    backend = KubeflowTrainerBackend(api, TrainerConfig(image="python:3.11-slim"))
    status = backend.statuses([job])[job]
    assert status.state is JobState.FAILED
    assert status.failure == Failure(
        kind=FailureClass.INFRASTRUCTURE, reason="DeletionByTaintManager", node=lost
    )
    kube_server.requests.clear()
    api.patch(TRAIN_JOB, job, {"metadata": {"annotations": {"seen": "again"}}})
    kube_server.requests.clear()
    assert backend.statuses([job])[job].failure == status.failure
    assert kube_server.requests.count(path_contains="/nodes") == 0


def test_a_pod_the_pod_gc_deleted_before_the_job_failed_still_names_its_node(
    api: KubeApi,
) -> None:
    """PodGC (gc_controller.go) marks an orphaned pod Failed with DisruptionTarget, reason
    "DeletionByPodGC", "PodGC: node no longer exists", then deletes it; the Job controller
    then fails the Job, JobSet the JobSet, and the Trainer the TrainJob. The pod is gone by the
    time the TrainJob reads Failed: the pod informer remembered it on its way out."""
    job, gone_node = f"tj-{uid()}", f"gone-{uid()}"
    backend = KubeflowTrainerBackend(api, TrainerConfig(image="python:3.11-slim"))
    unsubscribe = backend.subscribe(lambda: None)
    try:
        trainjob_pod(api, job, 1, gone_node, {"phase": "Running"})
        name = f"{job}-node-0-1"
        gc = disrupted("DeletionByPodGC", "PodGC: node no longer exists")
        api.patch(POD, name, {"status": {"phase": "Failed", "conditions": [gc]}},
                  subresource="status")  # fmt: skip
        api.delete(POD, name)
        failed_trainjob(api, job)

        def failed() -> Any:
            status = backend.statuses([job]).get(job)
            return status if status and status.state is JobState.FAILED else None

        from tests.conftest import wait_until

        status = wait_until(failed, 10)
        assert status is not None
        assert status.failure == Failure(
            kind=FailureClass.INFRASTRUCTURE, reason="DeletionByPodGC", node=gone_node
        )
    finally:
        unsubscribe()


@pytest.mark.parametrize(
    ("node_ready", "expected"),
    [
        # the node lifecycle controller: "Kubelet stopped posting node status."
        (("Unknown", "NodeStatusUnknown"), "node NotReady: NodeStatusUnknown"),
        (None, "node gone"),  # the Node object deleted (a cloud's node controller)
    ],
)
def test_a_pod_running_on_a_node_that_is_not_ready_or_gone_is_infrastructure(
    api: KubeApi, node_ready: tuple[str, str] | None, expected: str
) -> None:
    """Before any controller evicts them, a lost node's pods still read Running (no kubelet
    reports otherwise): the Node itself says it is lost, its Ready condition not True ("True
    if the node is healthy and ready to accept pods, False if the node is not healthy ...,
    Unknown if the node controller has not heard from the node in the last
    node-monitor-grace-period": Kubernetes docs, Node status) or the Node gone."""
    job, where = f"tj-{uid()}", f"n-{uid()}"
    if node_ready is not None:
        node(api, where, *node_ready)
    failed_trainjob(api, job)
    trainjob_pod(api, job, 0, where, {"phase": "Running"})
    backend = KubeflowTrainerBackend(api, TrainerConfig(image="python:3.11-slim"))
    failure = backend.statuses([job])[job].failure
    assert failure == Failure(kind=FailureClass.INFRASTRUCTURE, reason=expected, node=where)


def test_a_plain_exit_code_leaves_the_class_to_the_log_tail(api: KubeApi) -> None:
    """A container that "Error"s with exit code 1 on a Ready node says only that its code
    failed, as an NCCL error does: no failure is set, the exit code is (the lifecycle matches
    RecoveryPolicy.infrastructure_logs on the log tail, else calls it application)."""
    job, where = f"tj-{uid()}", f"ok-{uid()}"
    node(api, where, "True", "KubeletReady")
    failed_trainjob(api, job)
    trainjob_pod(api, job, 0, where, {"phase": "Failed", "containerStatuses": [terminated(1)]})
    status = KubeflowTrainerBackend(api, TrainerConfig(image="x")).statuses([job])[job]
    assert (status.state, status.exit_code, status.failure) == (JobState.FAILED, 1, None)


def test_a_trainjob_whose_child_could_not_be_created_is_a_spec_error(api: KubeApi) -> None:
    """JobSet v0.12.0 (constants.go): "JobCreationFailed" when a child Job cannot be created
    (the API server refused its spec); the Trainer copies it to the TrainJob."""
    job = f"tj-{uid()}"
    failed_trainjob(api, job, reason="JobCreationFailed")
    status = KubeflowTrainerBackend(api, TrainerConfig(image="x")).statuses([job])[job]
    assert status.failure == Failure(kind=FailureClass.SPEC, reason="JobCreationFailed")


def rayjob(api: KubeApi, name: str, status: dict[str, Any]) -> None:
    api.create(RAY_JOB, {"apiVersion": "ray.io/v1", "kind": "RayJob",
                         "metadata": {"name": name, "labels": MANAGED},
                         "spec": {"entrypoint": "python x.py"}})  # fmt: skip
    api.patch(RAY_JOB, name, {"status": status}, subresource="status")


def test_a_rayjob_whose_head_node_was_lost_fails_as_infrastructure(
    api: KubeApi, kube_server: Any
) -> None:
    """KubeRay v1.6.1 (rayjob_controller.go): when the K8sJobMode submitter Job fails and the
    Ray job had not FAILED, "rayJob.Status.Reason = rayv1.SubmissionFailed", "Job submission
    has failed. Reason: BackoffLimitExceeded ...". The submitter lost its head: the head pod
    (label ray.io/cluster) was deleted by the taint manager off its unreachable node. The
    RayJob's pods (its cluster's and its submitter's, by batch.kubernetes.io/job-name) are
    listed once, when it is first seen FAILED."""
    job, lost = f"rj-{uid()}", f"lost-{uid()}"
    cluster = f"{job}-abcde"
    rayjob(api, job, {"jobDeploymentStatus": "Failed", "reason": "SubmissionFailed",
                      "rayClusterName": cluster, "jobStatus": "RUNNING",
                      "message": "Job submission has failed. Reason: BackoffLimitExceeded. "
                      "Message: Job has reached the specified backoff limit"})  # fmt: skip
    evicted = disrupted("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint")
    pod(api, f"{cluster}-head-x", {"ray.io/cluster": cluster, "ray.io/node-type": "head"}, lost,
        {"phase": "Running", "conditions": [evicted]})  # fmt: skip
    pod(api, f"{job}-sub", {"batch.kubernetes.io/job-name": job}, "healthy",
        {"phase": "Failed", "containerStatuses": [terminated(1)]})  # fmt: skip
    backend = KubeRayBackend(api, RayJobConfig(ray_cluster_name="c"))
    kube_server.requests.clear()
    status = backend.statuses([job])[job]
    assert status.failure == Failure(
        kind=FailureClass.INFRASTRUCTURE, reason="DeletionByTaintManager", node=lost
    )
    pod_lists = kube_server.requests.count("GET", "/pods")
    assert pod_lists == 2  # the cluster's pods and the submitter's
    api.patch(RAY_JOB, job, {"metadata": {"annotations": {"seen": "again"}}})
    backend.statuses([job])
    assert kube_server.requests.count("GET", "/pods") == pod_lists


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        # "ValidationFailed": KubeRay refused the RayJob's spec (validateRayJobSpec)
        ("ValidationFailed", FailureClass.SPEC),
        # activeDeadlineSeconds passed: KubeRay "is not eligible for retry due to failure
        # with DeadlineExceeded" either
        ("DeadlineExceeded", FailureClass.APPLICATION),
        # preRunningDeadlineSeconds passed before the job ran: its cluster never came up
        ("PreRunningDeadlineExceeded", FailureClass.INFRASTRUCTURE),
        ("AppFailed", None),  # the Ray job FAILED: its log tail tells
    ],
)
def test_a_rayjob_reason_says_the_class_where_its_pods_say_nothing(
    api: KubeApi, reason: str, kind: FailureClass | None
) -> None:
    """KubeRay v1.6.1 rayjob_types.go JobFailedReason values, with no pod left to read."""
    job = f"rj-{uid()}"
    deployment = "ValidationFailed" if reason == "ValidationFailed" else "Failed"
    rayjob(api, job, {"jobDeploymentStatus": deployment, "reason": reason,
                      "jobStatus": "FAILED", "message": "x"})  # fmt: skip
    status = KubeRayBackend(api, RayJobConfig(ray_cluster_name="c")).statuses([job])[job]
    assert status.state is JobState.FAILED
    expected = None if kind is None else Failure(kind=kind, reason=reason)
    assert status.failure == expected


INLINE = {"rayVersion": "2.60.0", "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
    "containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}}}}  # fmt: skip
BACKOFF = ("Job submission has failed. Reason: BackoffLimitExceeded. Message: Job has reached "
           "the specified backoff limit")  # fmt: skip
# what Ray's job CLI prints when the head's dashboard does not answer (dashboard_sdk.py)
NO_HEAD = "ConnectionError: Failed to connect to Ray at address: http://rj-head-svc:8265."


def failed_submitter(api: KubeApi, kube_server: Any, job: str, log: str) -> None:
    """The K8sJobMode submitter pod of `job` (Job controller's label), exited 1, with `log`."""
    name, ready = f"{job}-submitter", f"ready-{job}"
    node(api, ready, "True", "KubeletReady")
    container = {"name": "ray-job-submitter", "image": "rayproject/ray:2.60.0"}
    api.create(POD, {"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": name, "labels": {**MANAGED, JOB_NAME_LABEL: job}},
                     "spec": {"nodeName": ready, "containers": [container]}})  # fmt: skip
    api.patch(POD, name, {"status": {"phase": "Failed", "containerStatuses": [terminated(1)]}},
              subresource="status")  # fmt: skip
    kube_server.set_pod_log("default", name, log, container="ray-job-submitter")


@pytest.mark.parametrize(
    ("job_status", "config", "kind"),
    [
        # Ray had the job: the submitter died following it, and the job's own cluster goes
        ("RUNNING", RayJobConfig(ray_cluster_spec=INLINE), FailureClass.INFRASTRUCTURE),
        ("PENDING", RayJobConfig(ray_cluster_spec=INLINE), FailureClass.INFRASTRUCTURE),
        # on a cluster that stays, its Ray job may run on: a resubmission would run it twice
        ("RUNNING", RayJobConfig(ray_cluster_name="c"), FailureClass.APPLICATION),
        ("RUNNING", RayJobConfig(ray_cluster_spec=INLINE, keep_failed_head_s=60),
         FailureClass.APPLICATION),
        # Ray never had it: the submit itself failed
        ("", RayJobConfig(ray_cluster_spec=INLINE), FailureClass.APPLICATION),
    ],
)
def test_a_failed_submission_is_the_clusters_once_ray_had_the_job_and_names_the_submitters_line(
    api: KubeApi, kube_server: Any, job_status: str, config: RayJobConfig, kind: FailureClass
) -> None:
    """KubeRay v1.6.1 rayjob_controller.go: "The submitter Job needs to wait for the user code
    to finish and retrieve its logs. Therefore, a failed Submitter Job indicates that the
    submission itself has failed or the user code has thrown an error. If the failure is due to
    user code, the JobStatus and Job message will be updated accordingly" (reason AppFailed;
    else "rayJob.Status.Reason = rayv1.SubmissionFailed"). So a SubmissionFailed RayJob whose
    Ray job had started (jobStatus PENDING or RUNNING) failed for the cluster, not its code,
    where nothing of it outlives the RayJob (shutdownAfterJobFinishes, no kept head); the
    reason names the submitter pod's last log line, and with no Ray log its log is the job's."""
    job = f"rj-{uid()}"
    status = {"jobDeploymentStatus": "Failed", "reason": "SubmissionFailed", "message": BACKOFF}
    rayjob(api, job, {**status, "jobStatus": job_status} if job_status else status)
    failed_submitter(api, kube_server, job, f"Traceback (most recent call last):\n{NO_HEAD}\n")
    backend = KubeRayBackend(api, config)
    seen = backend.statuses([job])[job]
    assert seen.state is JobState.FAILED
    assert seen.failure == Failure(kind=kind, reason=f"SubmissionFailed: {NO_HEAD}")
    assert NO_HEAD in (backend.read_log(job) or ""), "no Ray log: the submitter's is the job's"


# Ray's answer to a submit while its head has no job agent yet (job_head.py submit_job), as the
# submitter pod of ci run ci2 printed it on the real control plane
NO_AGENT = ("RuntimeError: Request failed with status code 500: No available agent to submit "
            "job, please try again later..")  # fmt: skip


@pytest.mark.parametrize(
    "config", [RayJobConfig(ray_cluster_spec=INLINE), RayJobConfig(ray_cluster_name="c")]
)
def test_a_submission_ray_said_to_try_again_later_is_the_clusters_on_any_cluster(
    api: KubeApi, kube_server: Any, config: RayJobConfig
) -> None:
    """Ray (ray/dashboard/modules/job/job_head.py, submit_job) answers a submit it cannot take
    yet, its head having no job agent within WAIT_AVAILABLE_AGENT_TIMEOUT, with 500 "No
    available agent to submit job, please try again later." Seen in a fresh-clone run on the
    real KubeRay operator: a head still starting on a busy machine, the submitter's three tries
    spent. Ray never had the job, so it failed for the cluster and a resubmission cannot run it
    twice, on its own cluster or on one that stays (a NO_HEAD failure stays the job's:
    test_a_failed_submission_is_the_clusters_once_ray_had_the_job_and_names_the_submitters_line)."""
    job = f"rj-{uid()}"
    rayjob(api, job, {"jobDeploymentStatus": "Failed", "reason": "SubmissionFailed",
                      "message": BACKOFF})  # fmt: skip
    failed_submitter(api, kube_server, job, f"Traceback (most recent call last):\n{NO_AGENT}\n")
    seen = KubeRayBackend(api, config).statuses([job])[job]
    assert seen.state is JobState.FAILED
    assert seen.failure == Failure(
        kind=FailureClass.INFRASTRUCTURE, reason=f"SubmissionFailed: {NO_AGENT}"
    )


def _pod(status: dict[str, Any], node_name: str = "n1") -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"nodeName": node_name}, "status": status}


READY = {"n1": {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}}


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        # kubelet's image manager: the image cannot be pulled or named
        ({"phase": "Pending", "containerStatuses": [{"name": "node", "state": {
            "waiting": {"reason": "ImagePullBackOff"}}}]},
         Failure(kind=FailureClass.SPEC, reason="node: ImagePullBackOff")),
        ({"phase": "Pending", "initContainerStatuses": [{"name": "unpack", "state": {
            "waiting": {"reason": "InvalidImageName"}}}]},
         Failure(kind=FailureClass.SPEC, reason="unpack: InvalidImageName")),
        # a missing Secret or ConfigMap key the env names
        ({"phase": "Pending", "containerStatuses": [{"name": "node", "state": {
            "waiting": {"reason": "CreateContainerConfigError"}}}]},
         Failure(kind=FailureClass.SPEC, reason="node: CreateContainerConfigError")),
        # the container runtime's "OOMKilled" (kuberuntime helpers.go): the job's own memory
        ({"phase": "Failed", "containerStatuses": [terminated(137, "OOMKilled")]},
         Failure(kind=FailureClass.APPLICATION, reason="node: OOMKilled")),
        # the kubelet's eviction manager (eviction/helpers.go: Reason = "Evicted")
        ({"phase": "Failed", "reason": "Evicted"},
         Failure(kind=FailureClass.INFRASTRUCTURE, reason="Evicted", node="n1")),
        # the kubelet's node shutdown manager: "Terminated", "Pod was terminated in response
        # to imminent node shutdown." (nodeshutdown_manager.go)
        ({"phase": "Failed", "reason": "Terminated", "conditions": [disrupted(
            "TerminationByKubelet", "Pod was terminated in response to imminent node shutdown.")]},
         Failure(kind=FailureClass.INFRASTRUCTURE, reason="TerminationByKubelet", node="n1")),
        # MarkPodsNotReady (controller_utils.go): "NodeLost", "Node %v which was running pod
        # %v is unresponsive"
        ({"phase": "Running", "reason": "NodeLost"},
         Failure(kind=FailureClass.INFRASTRUCTURE, reason="NodeLost", node="n1")),
        # the scheduler's preemption (core/v1 PodReasonPreemptionByScheduler)
        ({"phase": "Failed", "conditions": [disrupted("PreemptionByScheduler", "x")]},
         Failure(kind=FailureClass.PREEMPTED, reason="PreemptionByScheduler", node="n1")),
        ({"phase": "Failed", "containerStatuses": [terminated(2)]}, None),
    ],
)  # fmt: skip
def test_what_each_pod_status_says(status: dict[str, Any], expected: Failure | None) -> None:
    """The pod status fields and reasons the kubelet and controllers write (each row names
    its writer), mapped by `pod_failure` on a Ready node."""
    assert pod_failure([_pod(status)], READY) == expected


def test_a_pod_that_succeeded_on_a_node_lost_later_is_no_cause() -> None:
    """A succeeded pod's node does not matter: the node of a pod that did not finish does."""
    gone = {"n1": None}
    assert pod_failure([_pod({"phase": "Succeeded"})], gone) is None


# -- keep a failed job's head (KubeRay deletionRules) -------------------------------------------

INLINE = {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
    {"name": "ray-head", "image": "rayproject/ray"}]}}}}  # fmt: skip


def test_keep_failed_head_sends_deletion_rules_the_real_crd_accepts(api: KubeApi) -> None:
    """KubeRay v1.6.1 (rayjob_types.go): "DeletionRules is a list of deletion rules, processed
    based on their trigger conditions"; policies DeleteCluster / DeleteWorkers / DeleteSelf /
    DeleteNone, a condition on jobStatus (SUCCEEDED, FAILED) or jobDeploymentStatus (Failed)
    with ttlSeconds; validation.go: shutdownAfterJobFinishes and deletionRules "are mutually
    exclusive". A failed job loses its workers at once and its head after keep_failed_head_s;
    a succeeded one its cluster after ttl_seconds_after_finished. The RayJob is accepted by the
    API server with KubeRay v1.6.1's own CRD, written with fieldValidation=Strict."""
    from prefect_nemo import JobSpec

    config = RayJobConfig(ray_cluster_spec=INLINE, ttl_seconds_after_finished=30,
                          keep_failed_head_s=600)  # fmt: skip
    job = f"rj-{uid()}"
    KubeRayBackend(api, config).submit(JobSpec(entrypoint="python x.py"), job, {})
    spec = api.get(RAY_JOB, job)["spec"]
    # none sent; the CRD defaults them (false, 0), which KubeRay accepts with rules
    assert not spec.get("shutdownAfterJobFinishes") and not spec.get("ttlSecondsAfterFinished")
    rules = [(r["policy"], r["condition"]) for r in spec["deletionStrategy"]["deletionRules"]]
    assert rules == [
        ("DeleteCluster", {"jobStatus": "SUCCEEDED", "ttlSeconds": 30}),
        ("DeleteWorkers", {"jobStatus": "FAILED", "ttlSeconds": 0}),
        ("DeleteCluster", {"jobStatus": "FAILED", "ttlSeconds": 600}),
        ("DeleteWorkers", {"jobDeploymentStatus": "Failed", "ttlSeconds": 0}),
        ("DeleteCluster", {"jobDeploymentStatus": "Failed", "ttlSeconds": 600}),
    ]


def test_keep_failed_head_on_an_operator_older_than_1_5_is_refused_naming_the_field(
    tmp_path: Any,
) -> None:
    """deletionRules came with KubeRay 1.5 (deletionStrategy itself with 1.3): an older
    operator's RayJob CRD has no such field, and our strict write is refused as unknown; the
    error names the block field and the KubeRay version it needs, and nothing is left behind."""
    import yaml

    from prefect_nemo import JobSpec
    from prefect_nemo.errors import InvalidJobSpec
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    for path in crd_dir().glob("*.yaml"):  # the kit's CRDs, the RayJob's as before 1.3
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        for doc in docs:
            if doc.get("metadata", {}).get("name") == "rayjobs.ray.io":
                for version in doc["spec"]["versions"]:
                    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
                    spec["properties"].pop("deletionStrategy", None)
        (tmp_path / path.name).write_text(yaml.safe_dump_all(docs))
    config = RayJobConfig(ray_cluster_spec=INLINE, keep_failed_head_s=600)
    with LoopbackKubeServer(crds=[tmp_path]) as server:
        api = KubeApi(server.api_client(), namespace="default")
        with pytest.raises(InvalidJobSpec, match=r"keep_failed_head_s needs KubeRay >= 1\.5"):
            KubeRayBackend(api, config).submit(JobSpec(entrypoint="x"), f"rj-{uid()}", {})
        assert api.list(RAY_JOB)[0] == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(ray_cluster_name="shared"), "ray_cluster_spec"),
        (dict(ray_cluster_spec=INLINE, shutdown_after_job_finishes=False),
         "shutdown_after_job_finishes=False"),
        (dict(ray_cluster_spec={**INLINE, "enableInTreeAutoscaling": True}), "autoscaling"),
        (dict(ray_cluster_spec=INLINE, queue_name="q"), "Kueue"),
    ],
)  # fmt: skip
def test_keep_failed_head_where_kuberay_or_kueue_would_refuse_it(
    config: dict[str, Any], message: str
) -> None:
    """KubeRay v1.6.1 validateDeletionRules: "not supported when ClusterSelector is set",
    "'DeleteWorkers' not supported with autoscaling enabled"; shutdownAfterJobFinishes "and
    spec.deletionStrategy.deletionRules are mutually exclusive"; Kueue docs, RayJob
    limitations: "spec.ShutdownAfterJobFinishes should be true". Refused before any request."""
    from prefect_nemo.errors import InvalidJobSpec

    with pytest.raises(InvalidJobSpec, match=message):
        RayJobConfig(keep_failed_head_s=60, **config)
