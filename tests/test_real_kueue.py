"""Kueue v0.17.0 (built from its Go module, started by the control plane with its webhooks and
visibility API) queueing RayJobs on the REAL KubeRay operator and TrainJobs on the REAL Kubeflow
Trainer, their pods run by the node agent; per-test queues from `control_plane.kueue.make_queues`.

What Kueue writes (and what prefect-nemo's QUEUED state will read) is asserted here: the
Workload (named `<kind>-<job name>-<hash>`, labelled with the job's uid) and its conditions
(QuotaReserved / Admitted / Evicted / Preempted / Finished, their reasons), `status.admission`,
the job's `spec.suspend`, the LocalQueue's `status.pendingWorkloads` and the visibility API's
positions. `-s` prints each observed Workload condition as a `kueue-fact` line.
"""

from __future__ import annotations

import contextvars
import json
import re
import shlex
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prefect import flow

from prefect_nemo import JobResult, JobSpec, JobState, QueueTimedOut, run_job
from prefect_nemo.blocks import KubeflowTrainerCluster, KubeRayCluster, KubernetesCluster
from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE
from prefect_nemo.testing.control_plane.kueue import QUEUE_LABEL, QueueSet, make_queues
from prefect_nemo.testing.control_plane.run import OPERATOR_NAMESPACE
from tests.conftest import IN_CI, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]

RAY = ("ray.io", "v1", "rayjobs")
TRAIN = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")


@pytest.fixture(scope="module")
def plane(control_plane: Any) -> Any:
    """The control plane, with Kueue and the node agent running (else skip; fail in CI)."""
    for why in (control_plane.kueue_unavailable, control_plane.agent_unavailable):
        if why:
            (pytest.fail if IN_CI else pytest.skip)(why)
    core = client.CoreV1Api(control_plane.api_client())
    try:  # the operator's namespace exists once a test made it (a plane may be reused)
        core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    return control_plane


@pytest.fixture
def objects(plane: Any) -> Iterator[client.CustomObjectsApi]:
    """The custom objects API; every job a test made through `create` is deleted after it."""
    api = client.CustomObjectsApi(plane.api_client())
    made: list[tuple[tuple[str, str, str], str, str]] = []
    original = api.create_namespaced_custom_object

    def create(group: str, version: str, namespace: str, plural: str, body: Any) -> Any:
        made.append(((group, version, plural), namespace, body["metadata"]["name"]))
        return original(group, version, namespace, plural, body)

    api.create_namespaced_custom_object = create  # type: ignore[method-assign]
    yield api
    for (group, version, plural), namespace, name in made:
        try:
            api.delete_namespaced_custom_object(group, version, namespace, plural, name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    """The status condition of `type_`, None when absent."""
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


def is_true(obj: dict[str, Any] | None, type_: str) -> bool:
    return (condition(obj, type_) or {}).get("status") == "True"


def suspended(job: dict[str, Any]) -> bool:
    """`spec.suspend` (KubeRay's Go type omits a false one)."""
    return job["spec"].get("suspend") is True


def fact(what: str, value: Any) -> None:
    """One observation of what Kueue writes (printed with -s; the product side reads these)."""
    print(f"kueue-fact {what}: {json.dumps(value, sort_keys=True, default=str)}")


def get(api: client.CustomObjectsApi, kind: tuple[str, str, str], ns: str, name: str) -> Any:
    group, version, plural = kind
    return api.get_namespaced_custom_object(group, version, ns, plural, name)


def workload_of(queues: QueueSet, job: dict[str, Any]) -> dict[str, Any] | None:
    return queues.workload(job["metadata"]["uid"])


def check_workload_name(workload: dict[str, Any], kind: str, job: dict[str, Any]) -> None:
    """Kueue (jobframework/workload_names.go): `<lower-case kind>-<job name>-<5 hex of a sha1
    of kind, group, name and uid>`; the job is its controller owner."""
    name = workload["metadata"]["name"]
    assert re.fullmatch(rf"{kind.lower()}-{job['metadata']['name']}-[0-9a-f]{{5}}", name), name
    owner = next(r for r in workload["metadata"]["ownerReferences"] if r.get("controller"))
    assert (owner["kind"], owner["uid"]) == (kind, job["metadata"]["uid"])
    assert workload["spec"]["queueName"] == job["metadata"]["labels"][QUEUE_LABEL]


def check_pending(queues: QueueSet, workload: dict[str, Any]) -> None:
    """A workload waiting for quota: QuotaReserved False (reason Pending, the message naming
    the short resource), no Admitted, no `status.admission`; counted by the LocalQueue and
    first in it by the visibility API."""
    reserved = condition(workload, "QuotaReserved")
    fact("pending QuotaReserved", reserved)
    assert reserved and reserved["status"] == "False" and reserved["reason"] == "Pending"
    assert "insufficient unused quota" in reserved["message"], reserved["message"]
    assert not is_true(workload, "Admitted") and "admission" not in workload["status"]
    def counted() -> bool:  # the LocalQueue's status follows a moment later
        status = queues.local_queue_status()
        return status.get("pendingWorkloads") == 1 and status.get("admittedWorkloads") == 1

    counts = wait_until(counted, 30)
    status = queues.local_queue_status()
    fact("LocalQueue status", {k: v for k, v in status.items() if k != "conditions"})
    assert counts, status
    pending = wait_until(queues.pending_workloads, 30)  # the APIService may still be starting
    assert pending is not None, "the visibility API is not served"
    fact("visibility pendingworkloads", pending)
    assert [(p["metadata"]["name"], p["positionInLocalQueue"]) for p in pending] == [
        (workload["metadata"]["name"], 0)]  # fmt: skip


def check_admitted(queues: QueueSet, workload: dict[str, Any]) -> None:
    """An admitted workload: QuotaReserved and Admitted True, `status.admission` naming the
    ClusterQueue and the flavor each pod set got."""
    fact("admitted conditions", workload["status"]["conditions"])
    fact("status.admission", workload["status"]["admission"])
    assert is_true(workload, "QuotaReserved") and is_true(workload, "Admitted")
    admission = workload["status"]["admission"]
    assert admission["clusterQueue"] == queues.cluster_queue
    assert {f for ps in admission["podSetAssignments"] for f in ps["flavors"].values()} == {
        queues.flavor}  # fmt: skip


# -- RayJobs on the real KubeRay operator -------------------------------------------------------


def rayjob(name: str, queues: QueueSet, seconds: float) -> dict[str, Any]:
    """A RayJob as Kueue's "Run A RayJob" has it: the queue label, suspended, its cluster
    deleted at the end, resource requests on the head (1 CPU; KubeRay's default submitter pod
    asks 500m more, which Kueue counts too)."""
    head = {"name": "ray-head", "image": "rayproject/ray:2.60.0",
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}  # fmt: skip
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": name, "labels": queues.labels()},
        "spec": {
            "suspend": True, "shutdownAfterJobFinishes": True,
            "entrypoint": f'python -c "import time; time.sleep({seconds})"',
            "rayClusterSpec": {
                "rayVersion": "2.60.0",
                "headGroupSpec": {
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "1",
                                       "object-store-memory": "100000000"},
                    "template": {"spec": {"containers": [head]}},
                },
            },
        },
    }  # fmt: skip


def test_two_rayjobs_with_quota_for_one_run_one_after_the_other(plane: Any, objects: Any) -> None:
    """Kueue docs, "Run A RayJob": "The target local queue should be specified in the
    metadata.labels section of the RayJob configuration" (kueue.x-k8s.io/queue-name); "The
    RayCluster should be deleted at the end of the job execution, spec.ShutdownAfterJobFinishes
    should be true"; "Overview": Kueue "is a job-level manager that decides when a job should
    be admitted to start (as in pods can be created)"; "Workload": "Kueue calculates the total
    resources usage for a Workload as the sum of the resource requests for each podSet". With
    a ClusterQueue's nominal quota of 2 CPUs and two RayJobs of 1.5 each (head and submitter):
    the first is admitted (Kueue clears `spec.suspend`) and runs to Complete on the real
    operator; the second stays suspended, its Workload's QuotaReserved False (Pending), first
    in the LocalQueue, until the first's Workload is Finished; then it runs to Complete too."""
    with make_queues(plane, OPERATOR_NAMESPACE, cpu="2", memory="4Gi") as queues:
        tag = uuid.uuid4().hex[:6]
        first, second = f"kq-first-{tag}", f"kq-second-{tag}"
        for name, seconds in ((first, 8), (second, 1)):
            objects.create_namespaced_custom_object(*RAY[:2], OPERATOR_NAMESPACE, RAY[2],
                                                    rayjob(name, queues, seconds))  # fmt: skip
        jobs = {n: get(objects, RAY, OPERATOR_NAMESPACE, n) for n in (first, second)}
        admitted = wait_until(lambda: is_true(workload_of(queues, jobs[first]), "Admitted"), 60)
        assert admitted, plane.log("kueue")[-3000:]
        # the job follows its Workload: Kueue's job reconciler unsuspends it once admitted
        assert wait_until(lambda: not suspended(get(objects, RAY, OPERATOR_NAMESPACE, first)), 30)
        check_admitted(queues, workload_of(queues, jobs[first]))
        check_workload_name(workload_of(queues, jobs[first]), "RayJob", jobs[first])

        waiting = wait_until(lambda: condition(workload_of(queues, jobs[second]),
                                               "QuotaReserved"), 30)  # fmt: skip
        assert waiting, plane.log("kueue")[-3000:]
        check_pending(queues, workload_of(queues, jobs[second]))
        assert suspended(get(objects, RAY, OPERATOR_NAMESPACE, second))

        def status(name: str) -> dict[str, Any]:
            return get(objects, RAY, OPERATOR_NAMESPACE, name).get("status") or {}

        why = lambda: plane.log("node_agent")[-2000:] + plane.log("kueue")[-2000:]  # noqa: E731
        done = wait_until(lambda: status(first).get("jobDeploymentStatus") == "Complete", 240)
        assert done and status(first).get("jobStatus") == "SUCCEEDED", (status(first), why())
        finished = wait_until(lambda: condition(workload_of(queues, jobs[first]), "Finished"), 30)
        fact("Finished (RayJob)", finished)
        assert finished and finished["status"] == "True", finished
        assert wait_until(lambda: is_true(workload_of(queues, jobs[second]), "Admitted"), 60)
        assert wait_until(lambda: not suspended(get(objects, RAY, OPERATOR_NAMESPACE, second)), 30)
        done = wait_until(lambda: status(second).get("jobDeploymentStatus") == "Complete", 240)
        assert done and status(second).get("jobStatus") == "SUCCEEDED", (status(second), why())


# -- TrainJobs on the real Kubeflow Trainer -----------------------------------------------------


@pytest.fixture
def runtime(plane: Any) -> Iterator[str]:
    """A TrainingRuntime in the Trainer's namespace: one node, a `node` container (the shape of
    the runtime our TrainJob backend writes, and of Kueue's "Run A TrainJob" example)."""
    if plane.controllers_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(plane.controllers_unavailable)
    api = client.CustomObjectsApi(plane.api_client())
    name = f"kq-runtime-{uuid.uuid4().hex[:6]}"
    node = {"name": "node", "template": {
        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
        "spec": {"backoffLimit": 0, "template": {"spec": {"containers": [
            {"name": "node", "image": "python:3.11-slim"}]}}}}}  # fmt: skip
    api.create_namespaced_custom_object(TRAIN[0], TRAIN[1], TRAINER_NAMESPACE,
                                        "trainingruntimes", {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
        "metadata": {"name": name},
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}},
                 "template": {"spec": {"replicatedJobs": [node]}}},
    })  # fmt: skip
    yield name
    api.delete_namespaced_custom_object(TRAIN[0], TRAIN[1], TRAINER_NAMESPACE,
                                        "trainingruntimes", name)  # fmt: skip


def trainjob(name: str, runtime: str, labels: dict[str, str], program: str) -> dict[str, Any]:
    """A TrainJob of one node asking 1 CPU (Kueue's "Run A TrainJob": the queue label is "the
    only Kueue-specific addition needed"; no `suspend`: the webhook sets it)."""
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                           "name": runtime},
            "trainer": {"image": "python:3.11-slim", "command": ["python", "-c", program],
                        "numNodes": 1, "resourcesPerNode": {"requests": {"cpu": "1"}}},
        },
    }  # fmt: skip


def train_status(api: Any, name: str) -> dict[str, Any]:
    return get(api, TRAIN, TRAINER_NAMESPACE, name)


def test_two_trainjobs_with_quota_for_one_run_one_after_the_other(
    plane: Any, objects: Any, runtime: str
) -> None:
    """Kueue docs, "Run A TrainJob": "By default, Kueue will set suspend to true via webhook and
    unsuspend it when the TrainJob is admitted" and "Kueue manages TrainJobs by scheduling
    their underlying jobs according to available quota and priority". Quota of 1 CPU, two
    TrainJobs of 1 CPU each, created without `suspend`: both are stored suspended; the first is
    admitted, unsuspended and runs to Complete (real Trainer, JobSet and Job controllers, the
    node agent); the second waits (QuotaReserved False, Pending, first in the LocalQueue), then
    is admitted once the first's Workload is Finished, and completes."""
    with make_queues(plane, TRAINER_NAMESPACE, cpu="1", memory="4Gi") as queues:
        tag = uuid.uuid4().hex[:6]
        first, second = f"kq-first-{tag}", f"kq-second-{tag}"
        for name, seconds in ((first, 5), (second, 0)):
            program = f"import time; time.sleep({seconds}); print('trained')"
            stored = objects.create_namespaced_custom_object(
                *TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2],
                trainjob(name, runtime, queues.labels(), program))  # fmt: skip
            assert suspended(stored), "Kueue's webhook suspends it"
        jobs = {n: train_status(objects, n) for n in (first, second)}
        admitted = wait_until(lambda: is_true(workload_of(queues, jobs[first]), "Admitted"), 60)
        assert admitted, plane.log("kueue")[-3000:]
        # the job follows its Workload: Kueue's job reconciler unsuspends it once admitted
        assert wait_until(lambda: not suspended(train_status(objects, first)), 30)
        check_admitted(queues, workload_of(queues, jobs[first]))
        check_workload_name(workload_of(queues, jobs[first]), "TrainJob", jobs[first])
        # Kueue's admission reaches the Trainer through a runtime patch of its own
        patches = train_status(objects, first)["spec"].get("runtimePatches") or []
        fact("TrainJob runtimePatches", patches)
        assert "kueue.x-k8s.io/manager" in [p.get("manager") for p in patches]

        waiting = wait_until(lambda: condition(workload_of(queues, jobs[second]),
                                               "QuotaReserved"), 30)  # fmt: skip
        assert waiting, plane.log("kueue")[-3000:]
        check_pending(queues, workload_of(queues, jobs[second]))
        assert suspended(train_status(objects, second))

        why = lambda: plane.log("jobset-controller")[-2000:] + plane.log("kueue")[-2000:]  # noqa: E731
        assert wait_until(lambda: is_true(train_status(objects, first), "Complete"), 120), why()
        finished = wait_until(lambda: condition(workload_of(queues, jobs[first]), "Finished"), 30)
        fact("Finished (TrainJob)", finished)
        assert finished and finished["status"] == "True", finished
        assert wait_until(lambda: is_true(workload_of(queues, jobs[second]), "Admitted"), 60)
        assert wait_until(lambda: not suspended(train_status(objects, second)), 30)
        assert wait_until(lambda: is_true(train_status(objects, second), "Complete"), 120), why()


def test_a_higher_priority_trainjob_preempts_a_running_one_which_runs_again_after(
    plane: Any, objects: Any, runtime: str, tmp_path: Path
) -> None:
    """Kueue docs, "Preemption": "Preemption is the process of evicting one or more admitted
    Workloads to accommodate another Workload", when "The preemptee belongs to the same
    ClusterQueue as the preemptor and the preemptee has a lower priority", and "The `Evicted`
    condition indicates that the Workload was evicted with a reason `Preempted`, whereas the
    `Preempted` condition gives more details about the preemption reason" (InClusterQueue);
    "Run A TrainJob": "TrainJobs use the same priority mechanism as other Kueue workloads via
    the `kueue.x-k8s.io/priority-class` label"; "Overview": Kueue decides "when it should stop
    (as in active pods should be deleted)". A low-priority TrainJob runs (its pod waits for a
    file); a high one arrives: the low one's Workload is Evicted/Preempted, the TrainJob is
    suspended again and its pod goes; the high one runs to Complete; then the low one is
    admitted again and, the file there, completes."""
    marker = tmp_path / "go"
    wait_for_marker = (f"import os, time\nprint('started', flush=True)\n"
                       f"while not os.path.exists({str(marker)!r}): time.sleep(0.2)")  # fmt: skip
    with make_queues(plane, TRAINER_NAMESPACE, cpu="1", memory="4Gi") as queues:
        tag = uuid.uuid4().hex[:6]
        low, high = f"kq-low-{tag}", f"kq-high-{tag}"
        objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2], trainjob(
            low, runtime, queues.labels("low"), wait_for_marker))  # fmt: skip
        low_job = train_status(objects, low)
        core = client.CoreV1Api(plane.api_client())
        selector = f"jobset.sigs.k8s.io/jobset-name={low}"

        def running_pods() -> list[Any]:
            pods = core.list_namespaced_pod(TRAINER_NAMESPACE, label_selector=selector).items
            return [p for p in pods if p.status.phase == "Running"]

        assert wait_until(running_pods, 90), plane.log("node_agent")[-3000:]
        first_admission = workload_of(queues, low_job)
        fact("priority fields", {k: first_admission["spec"].get(k)
                                 for k in ("priority", "priorityClassName", "priorityClassRef")})
        objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2], trainjob(
            high, runtime, queues.labels("high"), "print('urgent')"))  # fmt: skip

        evicted = wait_until(lambda: is_true(workload_of(queues, low_job), "Evicted"), 60)
        assert evicted, plane.log("kueue")[-3000:]
        workload = workload_of(queues, low_job)
        fact("preempted conditions", workload["status"]["conditions"])
        assert condition(workload, "Evicted")["reason"] == "Preempted"
        preempted = condition(workload, "Preempted")
        assert preempted and preempted["status"] == "True"
        assert preempted["reason"] == "InClusterQueue", preempted
        assert wait_until(lambda: suspended(train_status(objects, low)), 30)
        assert wait_until(lambda: not core.list_namespaced_pod(
            TRAINER_NAMESPACE, label_selector=selector).items, 60), "the preempted pod stayed"
        # once evicted, the quota is released and the Workload waits again (Requeued)
        requeued = wait_until(lambda: is_true(workload_of(queues, low_job), "Requeued")
                              and not is_true(workload_of(queues, low_job), "QuotaReserved"), 30)
        fact("evicted, waiting conditions", workload_of(queues, low_job)["status"]["conditions"])
        assert requeued

        why = lambda: plane.log("jobset-controller")[-2000:] + plane.log("kueue")[-2000:]  # noqa: E731
        assert wait_until(lambda: is_true(train_status(objects, high), "Complete"), 120), why()
        readmitted = wait_until(lambda: is_true(workload_of(queues, low_job), "Admitted"), 60)
        assert readmitted, why()
        workload = workload_of(queues, low_job)
        fact("readmitted conditions", workload["status"]["conditions"])
        fact("requeueState", workload["status"].get("requeueState"))
        assert wait_until(lambda: not suspended(train_status(objects, low)), 30)
        marker.write_text("")
        assert wait_until(lambda: is_true(train_status(objects, low), "Complete"), 120), why()


def test_a_job_without_a_queue_label_is_left_alone(plane: Any, objects: Any, runtime: str) -> None:
    """Kueue's Configuration, manageJobsWithoutQueueName (false here, its default): "those
    jobs are not managed and if they are created unsuspended, they will start immediately". A
    TrainJob with no queue label in the namespace Kueue's webhooks serve is stored as sent (not
    suspended) and gets no Workload."""
    name = f"kq-free-{uuid.uuid4().hex[:6]}"
    stored = objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2],
                                                     trainjob(name, runtime, {}, "print(1)"))
    assert not suspended(stored)
    assert wait_until(lambda: is_true(train_status(objects, name), "Complete"), 120)
    path = (f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{TRAINER_NAMESPACE}/workloads"
            f"?labelSelector=kueue.x-k8s.io/job-uid={stored['metadata']['uid']}")  # fmt: skip
    assert json.loads(plane.request("GET", path))["items"] == []



# -- prefect-nemo's run_job on Kueue ----------------------------------------------------------


# a short flow-run name of its own: a job's id puts the run's name before the job's within the
# TrainJob name limit, and a long generated one ("prehistoric-wolverine", CI run 52) cut the job's
# name that a test looks its TrainJob up by
@flow(flow_run_name="one-job")
def one_job(block: Any, spec: JobSpec) -> JobResult:
    return run_job(spec, cluster=block, stream_logs=False)


def kube_block(plane: Any, namespace: str) -> KubernetesCluster:
    return KubernetesCluster(kubeconfig=plane.kubeconfig(namespace, "real"), namespace=namespace)


def our_rayjob_block(plane: Any, queues: QueueSet) -> KubeRayCluster:
    """Our KubeRay block queueing in `queues`' LocalQueue, its cluster the smoke test's head."""
    spec = rayjob("unused", queues, 0)["spec"]["rayClusterSpec"]
    return KubeRayCluster(kubernetes=kube_block(plane, OPERATOR_NAMESPACE), ray_cluster_spec=spec,
                          ttl_seconds_after_finished=0, queue_name=queues.local_queue)  # fmt: skip


def our_trainjob_block(plane: Any, queues: QueueSet) -> KubeflowTrainerCluster:
    """Our Trainer block asking 1 CPU per node, queueing in `queues`' LocalQueue."""
    return KubeflowTrainerCluster(
        kubernetes=kube_block(plane, TRAINER_NAMESPACE), image="python:3.11-slim",
        torchrun=False, cpus_per_node="1", queue_name=queues.local_queue,
    )  # fmt: skip


@pytest.mark.timeout(600)  # a control plane's start and two jobs on 2 busy cores
def test_run_job_rayjob_waits_queued_behind_another_then_runs(
    plane: Any, objects: Any, prefect_api: str
) -> None:
    """Kueue docs, "Run A RayJob": the queue-name label sends it to the LocalQueue and Kueue
    "controls the spec.suspend field" (created suspended, unsuspended once admitted). With quota
    for one RayJob, ours (run_job, our block's queue_name) waits suspended behind another: it
    reads QUEUED, not STOPPED (the task does not end), runs once the first ends, and succeeds;
    the wait is reported."""
    with make_queues(plane, OPERATOR_NAMESPACE, cpu="2", memory="4Gi") as queues:
        first = f"kq-hold-{uuid.uuid4().hex[:6]}"
        objects.create_namespaced_custom_object(*RAY[:2], OPERATOR_NAMESPACE, RAY[2],
                                                rayjob(first, queues, 10))  # fmt: skip
        job = get(objects, RAY, OPERATOR_NAMESPACE, first)
        assert wait_until(lambda: is_true(workload_of(queues, job), "Admitted"), 60)
        result = one_job(our_rayjob_block(plane, queues),
                         JobSpec(entrypoint='python -c "print(1)"', name="queued"))  # fmt: skip
        assert result.state is JobState.SUCCEEDED, result
        assert result.queue_wait_s and result.queue_wait_s > 0, result
        assert get(objects, RAY, OPERATOR_NAMESPACE, first)["status"]["jobStatus"] == "SUCCEEDED"


@pytest.mark.timeout(600)  # a control plane's start and two jobs on 2 busy cores
def test_run_job_trainjob_waits_longer_than_its_timeout_and_the_timeout_does_not_fire(
    plane: Any, objects: Any, runtime: str, prefect_api: str
) -> None:
    """Kueue docs, "Run A TrainJob": Kueue "will set suspend to true ... and unsuspend it when
    the TrainJob is admitted"; issue 28: "JobSpec.timeout_s counts from RUNNING". Quota for one
    TrainJob; ours (timeout_s=8) waits ~15 s behind another, then runs and succeeds."""
    with make_queues(plane, TRAINER_NAMESPACE, cpu="1", memory="4Gi") as queues:
        first = f"kq-hold-{uuid.uuid4().hex[:6]}"
        objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2], trainjob(
            first, runtime, queues.labels(), "import time; time.sleep(15)"))  # fmt: skip
        job = train_status(objects, first)
        assert wait_until(lambda: is_true(workload_of(queues, job), "Admitted"), 60)
        spec = JobSpec(entrypoint="python -c 'print(1)'", name="queued", timeout_s=8)
        result = one_job(our_trainjob_block(plane, queues), spec)
        assert result.state is JobState.SUCCEEDED, result
        assert result.queue_wait_s and result.queue_wait_s > spec.timeout_s, result  # type: ignore[operator]


@pytest.mark.timeout(600)  # a control plane's start and two jobs on 2 busy cores
def test_queue_timeout_removes_the_queued_trainjob_and_its_workload(
    plane: Any, objects: Any, runtime: str, prefect_api: str
) -> None:
    """Issue 28: "when it expires the queued job is removed (workload deleted ...) and the error
    names the queue and the scheduler's reason"; Kubernetes garbage collection: the Workload
    (owned by the TrainJob, Kueue's jobframework) goes with it. Nothing is left in the
    LocalQueue."""
    from prefect_nemo.kube import TRAIN_JOB, KubeApi

    with make_queues(plane, TRAINER_NAMESPACE, cpu="1", memory="4Gi") as queues:
        first = f"kq-hold-{uuid.uuid4().hex[:6]}"
        objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2], trainjob(
            first, runtime, queues.labels(), "import time; time.sleep(60)"))  # fmt: skip
        job = train_status(objects, first)
        assert wait_until(lambda: is_true(workload_of(queues, job), "Admitted"), 60)
        spec = JobSpec(entrypoint="python -c 'print(1)'", name="impatient", queue_timeout_s=6)
        with pytest.raises(QueueTimedOut, match=rf"in {queues.local_queue} \(Pending: "):
            one_job(our_trainjob_block(plane, queues), spec)
        kube = KubeApi(plane.api_client(), namespace=TRAINER_NAMESPACE)
        ours = [t for t in kube.list(TRAIN_JOB)[0] if t["metadata"]["name"] != first
                and queues.local_queue in str(t["metadata"].get("labels"))]  # fmt: skip
        assert ours == []
        assert wait_until(lambda: queues.local_queue_status().get("pendingWorkloads") == 0, 30)


@pytest.mark.timeout(600)  # a control plane's start and two jobs on 2 busy cores
def test_a_preempted_run_job_trainjob_goes_back_to_queued_and_completes(
    plane: Any, objects: Any, runtime: str, prefect_api: str, tmp_path: Path
) -> None:
    """Kueue docs, "Preemption": a lower-priority admitted Workload is evicted (Evicted,
    reason Preempted) for a higher one in its ClusterQueue, and Kueue suspends its job;
    "Run A TrainJob": priority by the kueue.x-k8s.io/priority-class label. Ours (low, run_job)
    runs, is preempted by a high TrainJob, reads QUEUED again (no JobStopped), is admitted again
    once the high one ends, and completes: preemptions == 1."""
    marker = tmp_path / "go"
    program = f"import os, time\nwhile not os.path.exists({str(marker)!r}): time.sleep(0.2)"
    with make_queues(plane, TRAINER_NAMESPACE, cpu="1", memory="4Gi") as queues:
        block = our_trainjob_block(plane, queues)
        spec = JobSpec(entrypoint=f"python -c {shlex.quote(program)}", name="low",
                       priority=queues.priorities["low"])  # fmt: skip
        results: list[Any] = []
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, daemon=True, args=(
            lambda: results.append(one_job(block, spec, return_state=True)),))  # fmt: skip
        thread.start()
        core = client.CoreV1Api(plane.api_client())

        def ours_running() -> bool:  # our TrainJob's pod (the other jobs here are kq-...)
            pods = core.list_namespaced_pod(TRAINER_NAMESPACE,
                                            label_selector="jobset.sigs.k8s.io/jobset-name").items
            return any(p.status.phase == "Running" and not p.metadata.name.startswith("kq-")
                       for p in pods)  # fmt: skip

        assert wait_until(ours_running, 120), plane.log("node_agent")[-3000:]
        time.sleep(2)  # the watcher sees RUNNING (its poll), so the preemption is counted
        high = f"kq-high-{uuid.uuid4().hex[:6]}"
        objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2], trainjob(
            high, runtime, queues.labels("high"), "print('urgent')"))  # fmt: skip
        why = lambda: plane.log("kueue")[-3000:]  # noqa: E731
        assert wait_until(lambda: is_true(train_status(objects, high), "Complete"), 120), why()
        marker.write_text("")
        thread.join(180)
        assert not thread.is_alive(), why()
        state = results[0]
        assert state.is_completed(), state
        result = state.result()
        assert result.state is JobState.SUCCEEDED and result.preemptions == 1, result


@pytest.mark.timeout(600)  # a control plane's start and two jobs on 2 busy cores
def test_cancelling_a_flow_run_whose_trainjob_is_queued_leaves_nothing_queued(
    plane: Any, objects: Any, runtime: str, prefect_api: str
) -> None:
    """Issue 28: "Our own stops (cancel, timeout, failure hooks, the sweeper) still remove
    queued jobs"; Kubernetes garbage collection takes the Workload with its TrainJob. Our
    TrainJob waits behind another; the flow run is cancelled through the API: the TrainJob is
    deleted and the LocalQueue has nothing pending."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from prefect_nemo.kube import FLOW_RUN_LABEL, TRAIN_JOB, KubeApi

    with make_queues(plane, TRAINER_NAMESPACE, cpu="1", memory="4Gi") as queues:
        first = f"kq-hold-{uuid.uuid4().hex[:6]}"
        objects.create_namespaced_custom_object(*TRAIN[:2], TRAINER_NAMESPACE, TRAIN[2], trainjob(
            first, runtime, queues.labels(), "import time; time.sleep(60)"))  # fmt: skip
        job = train_status(objects, first)
        assert wait_until(lambda: is_true(workload_of(queues, job), "Admitted"), 60)
        block = our_trainjob_block(plane, queues)
        name = f"cancelled-{uuid.uuid4().hex[:6]}"  # other tests' TrainJobs of ours stay
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, daemon=True, args=(lambda: one_job(
            block, JobSpec(entrypoint="true", name=name), return_state=True),))  # fmt: skip
        thread.start()
        kube = KubeApi(plane.api_client(), namespace=TRAINER_NAMESPACE)

        def ours() -> list[dict[str, Any]]:
            return [t for t in kube.list(TRAIN_JOB)[0]
                    if (t["metadata"].get("labels") or {}).get(FLOW_RUN_LABEL)
                    and f"-{name}-" in t["metadata"]["name"]]  # fmt: skip

        assert wait_until(lambda: queues.local_queue_status().get("pendingWorkloads") == 1, 60)
        (queued,) = ours()
        with get_client(sync_client=True) as prefect:
            prefect.set_flow_run_state(queued["metadata"]["labels"][FLOW_RUN_LABEL],
                                       Cancelling(), force=True)  # fmt: skip
        thread.join(60)
        assert not thread.is_alive(), "the flow must end once its queued job is removed"
        assert wait_until(lambda: not ours(), 30), ours()
        assert wait_until(lambda: queues.local_queue_status().get("pendingWorkloads") == 0, 30)
