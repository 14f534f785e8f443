"""Kueue on the KubeRay and Kubeflow Trainer backends, fast: where a job queues (labels,
suspended), bad input refused before anything is sent, and how a job Kueue holds reads (QUEUED,
never STOPPED), on the loopback API server. The real Kueue is in test_real_kueue.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from prefect_nemo import InvalidJobSpec, JobSpec, JobState
from prefect_nemo.backends._kueue import (
    PRIORITY_LABEL,
    QUEUE_LABEL,
    queue_reason,
    queued_status,
)
from prefect_nemo.backends.kubeflow.trainjob import status_from_trainjob
from prefect_nemo.backends.kuberay import RayJobConfig, rayjob_manifest, status_from_rayjob
from prefect_nemo.blocks import KubeRayCluster
from prefect_nemo.blocks.kubeflow import KubeflowTrainerCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.kube import RAY_JOB
from tests.test_kuberay import META, cluster_spec

QUEUED = RayJobConfig(ray_cluster_spec=cluster_spec(), queue_name="team-a", priority_class="low")


def test_a_queue_becomes_kueues_labels_and_the_job_is_created_suspended() -> None:
    """Kueue docs, "Run A RayJob": "The target local queue should be specified in the
    metadata.labels section of the RayJob configuration" (kueue.x-k8s.io/queue-name), the
    priority by kueue.x-k8s.io/priority-class; Kueue "controls the spec.suspend field": the job
    is created suspended and started once admitted. JobSpec.queue/priority override the block."""
    m = rayjob_manifest(JobSpec(entrypoint="true"), "j-1", META, QUEUED, namespace="ns")
    assert m["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    assert m["metadata"]["labels"][PRIORITY_LABEL] == "low"
    assert m["spec"]["suspend"] is True and m["spec"]["shutdownAfterJobFinishes"] is True
    spec = JobSpec(entrypoint="true", queue="team-b", priority="high")
    m = rayjob_manifest(spec, "j-1", META, QUEUED, namespace="ns")
    assert (m["metadata"]["labels"][QUEUE_LABEL], m["metadata"]["labels"][PRIORITY_LABEL]) == (
        "team-b", "high")  # fmt: skip
    plain = RayJobConfig(ray_cluster_spec=cluster_spec())
    m = rayjob_manifest(JobSpec(entrypoint="true"), "j-1", META, plain, namespace="ns")
    assert QUEUE_LABEL not in m["metadata"]["labels"] and "suspend" not in m["spec"]


def test_a_trainjob_gets_the_same_labels_and_suspend(kube_server: Any) -> None:
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    block = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim", queue_name="q1")
    docs = block.backend().render(JobSpec(entrypoint="true", priority="p"), "tj-1", META)
    train = docs[-1]
    assert train["kind"] == "TrainJob" and train["spec"]["suspend"] is True
    assert train["metadata"]["labels"][QUEUE_LABEL] == "q1"
    assert train["metadata"]["labels"][PRIORITY_LABEL] == "p"
    # the runtime's name (a hash of its spec) does not change with the queue
    plain = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim").backend()
    runtime = plain.render(JobSpec(entrypoint="true"), "tj-1", META)[-2]
    assert runtime["kind"] == "ClusterTrainingRuntime"
    assert runtime["metadata"]["name"] == docs[-2]["metadata"]["name"]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"ray_cluster_name": "shared"}, "queue_name: Kueue cannot queue a RayJob that runs on"),
        ({"ray_cluster_spec": cluster_spec(), "shutdown_after_job_finishes": False},
         "shutdownAfterJobFinishes true"),
        ({"ray_cluster_spec": cluster_spec(), "queue_name": "a/b"}, "queue_name: 'a/b' cannot"),
        ({"ray_cluster_spec": cluster_spec(), "queue_name": "q" * 64}, "at most 63"),
        ({"ray_cluster_spec": cluster_spec(), "queue_name": "-q"}, "starting and ending"),
        ({"ray_cluster_spec": cluster_spec(), "queue_name": None, "priority_class": "hi"},
         "priority_class: 'hi' is a Kueue WorkloadPriorityClass"),
    ],
)  # fmt: skip
def test_a_kuberay_block_kueue_cannot_take_is_refused(
    fields: dict[str, Any], match: str, kube_server: Any
) -> None:
    """Kueue docs, "Run A RayJob", limitations: "A Kueue managed RayJob cannot use an existing
    RayCluster"; "spec.ShutdownAfterJobFinishes should be true"; Kubernetes label values: at
    most 63 characters of [A-Za-z0-9._-], alphanumeric at both ends."""
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    before = len(kube_server.requests.entries)
    with pytest.raises(ValidationError, match=match):
        KubeRayCluster(kubernetes=kube, **{"queue_name": "team-a", **fields})
    assert len(kube_server.requests.entries) == before


@pytest.mark.parametrize(
    ("block", "spec", "match"),
    [
        ({"ray_cluster_name": "shared"}, {"queue": "team-a"},
         "JobSpec.queue: Kueue cannot queue a RayJob that runs on an existing RayCluster"),
        ({"ray_cluster_spec": cluster_spec(), "shutdown_after_job_finishes": False},
         {"queue": "team-a"}, "JobSpec.queue: a RayJob queued by Kueue must delete its cluster"),
        ({"ray_cluster_spec": cluster_spec()}, {"queue": "no queue"}, "JobSpec.queue: 'no queue'"),
        ({"ray_cluster_spec": cluster_spec()}, {"priority": "high"},
         "JobSpec.priority: 'high' is a Kueue WorkloadPriorityClass"),
    ],
)  # fmt: skip
def test_a_jobspec_queue_kueue_cannot_take_is_refused_before_anything_is_sent(
    block: dict[str, Any], spec: dict[str, Any], match: str, kube_server: Any
) -> None:
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    backend = KubeRayCluster(kubernetes=kube, **block).backend()
    job = JobSpec(entrypoint="true", **spec)
    before = kube_server.requests.count("POST")
    with pytest.raises(InvalidJobSpec, match=match):
        backend.validate(job)
    with pytest.raises(InvalidJobSpec, match=match):
        backend.submit(job, "j-bad", META)
    assert kube_server.requests.count("POST") == before


def test_a_trainjob_queue_name_must_be_a_label_value(kube_server: Any) -> None:
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    with pytest.raises(ValidationError, match=r"KubeflowTrainerCluster\.queue_name: 'a b'"):
        KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim", queue_name="a b")
    backend = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim").backend()
    before = kube_server.requests.count("POST")
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.queue: '_q'"):
        backend.submit(JobSpec(entrypoint="true", queue="_q"), "tj-bad", META)
    assert kube_server.requests.count("POST") == before


def test_unsuspended_by_kueue_reads_starting_not_stopped() -> None:
    """Kueue unsuspends an admitted job; until KubeRay / the Trainer catch up, the job still
    says Suspended: that is a start, not a stop."""
    rayjob = {"metadata": {"name": "r"}, "spec": {"suspend": False},
              "status": {"jobDeploymentStatus": "Suspended"}}  # fmt: skip
    assert status_from_rayjob(rayjob).state is JobState.PENDING
    rayjob["spec"]["suspend"] = True
    assert status_from_rayjob(rayjob).state is JobState.STOPPED  # a user's suspension
    suspended = {"type": "Suspended", "status": "True", "reason": "Suspended"}
    trainjob = {"metadata": {"name": "t"}, "spec": {}, "status": {"conditions": [suspended]}}
    assert status_from_trainjob(trainjob, []).state is JobState.PENDING
    trainjob["spec"]["suspend"] = True
    assert status_from_trainjob(trainjob, []).state is JobState.STOPPED


def test_kueues_reason_comes_from_the_workloads_conditions() -> None:
    """Kueue docs, "Workload": QuotaReserved / Admitted, and "Preemption": "The Evicted
    condition indicates that the Workload was evicted with a reason Preempted"."""

    def workload(*conditions: dict[str, str]) -> dict[str, Any]:
        return {"status": {"conditions": list(conditions)}}

    pending = {"type": "QuotaReserved", "status": "False", "reason": "Pending",
               "message": "couldn't assign flavors: insufficient unused quota"}  # fmt: skip
    assert queue_reason(workload(pending)) == (
        "Pending: couldn't assign flavors: insufficient unused quota", False)  # fmt: skip
    evicted = {"type": "Evicted", "status": "True", "reason": "Preempted",
               "message": "Preempted to accommodate a workload"}  # fmt: skip
    reason, preempted = queue_reason(workload(evicted, pending))
    assert preempted and reason.startswith("Evicted: Preempted")
    assert queue_reason(None) == ("waiting for Kueue to create its Workload", False)


def test_a_preempted_jobs_status_carries_kueues_own_count_of_its_preemptions() -> None:
    """The Workload CRD (v0.17.0): "schedulingStats tracks scheduling statistics", "evictions
    tracks eviction statistics by reason and underlyingCause", "count tracks the number of
    evictions for this reason"; a preemption's reason is `Preempted` (Kueue docs,
    "Preemption"). A job preempted before a poll saw it run is counted all the same."""
    from prefect_nemo.jobs import JobStatus

    obj = {"metadata": {"name": "j", "labels": {QUEUE_LABEL: "team"}}, "spec": {"suspend": True}}
    evicted = {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "m"}
    stats = {"evictions": [
        {"reason": "Preempted", "underlyingCause": "", "count": 2},
        {"reason": "PodsReadyTimeout", "underlyingCause": "", "count": 1},
    ]}  # fmt: skip
    workload = {"status": {"conditions": [evicted], "schedulingStats": stats}}
    status = queued_status(JobStatus(job_id="j", state=JobState.PENDING), obj, workload, None, None)
    assert status.state is JobState.QUEUED and status.queue and status.queue.preempted
    assert status.requeues == 2, "evictions of other reasons are no preemptions"
    never = {"status": {"conditions": []}}
    plain = queued_status(JobStatus(job_id="j", state=JobState.PENDING), obj, never, None, None)
    assert plain.requeues is None


@contextlib.contextmanager
def held_rayjob(kube_server: Any, name: str) -> Iterator[Any]:
    """A KubeRay backend with a queue and its RayJob `name` as Kueue holds it (created
    suspended, KubeRay's Suspended status); the RayJob is deleted after."""
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    backend = KubeRayCluster(kubernetes=kube, ray_cluster_spec=cluster_spec(),
                             queue_name="team-a").backend()  # fmt: skip
    manifest = rayjob_manifest(JobSpec(entrypoint="true"), name, META, backend.config,
                               namespace="default")  # fmt: skip
    backend.api.create(RAY_JOB, manifest, "default")
    try:
        backend.api.patch(RAY_JOB, name, {"status": {"jobDeploymentStatus": "Suspended"}},
                          "default", subresource="status")  # fmt: skip
        yield backend
    finally:
        backend.api.delete(RAY_JOB, name, "default")


def test_a_suspended_job_with_a_queue_label_is_queued_never_stopped(kube_server: Any) -> None:
    """A RayJob Kueue holds (suspended, queue-name label) reads QUEUED with its LocalQueue, from
    find() and from the informers alike; here no Kueue serves Workloads, so the label tells."""
    with held_rayjob(kube_server, "held-1") as backend:
        status = backend.find("held-1")
        assert status is not None and status.state is JobState.QUEUED, status
        assert status.queue is not None and status.queue.queue == "team-a"
        assert not status.queue.preempted
        assert [o.state for o in backend.owned_jobs()] == [JobState.QUEUED]
        unsubscribe = backend.subscribe(lambda: None)
        try:
            names = [i.kind.plural for i in backend.informers]
            assert names == ["rayjobs", "workloads"]
            assert backend.statuses(["held-1"])["held-1"].state is JobState.QUEUED
        finally:
            unsubscribe()


def test_jobs_subscribing_after_the_workload_informer_died_list_no_workloads(
    kube_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: "they wait in the scheduler's queue (QUEUED, no request of ours while they
    wait)". Here no Kueue serves Workloads, so the Workload informer dies on its first list.
    The jobs of a flow subscribe one by one; those that come after it died do not each list
    Workloads again (CI counted 110 lists for 120 jobs on a loaded machine), and a held job's
    status asks for none. A dead one is retried once a while (WORKLOAD_RETRY_S), so a Kueue
    installed later is found."""
    from prefect_nemo.backends import _kube_job
    from prefect_nemo.backends._kueue import WORKLOAD
    from tests.conftest import wait_until

    def workload_lists() -> int:
        return sum(1 for e in kube_server.requests.entries
                   if e.path.endswith("/workloads") and not e.is_watch)  # fmt: skip

    with held_rayjob(kube_server, "held-2") as backend:
        unsubscribes = [backend.subscribe(lambda: None)]
        try:

            def workload_informer_dead() -> bool:
                informer = next(i for i in backend.informers if i.kind is WORKLOAD)
                return informer.dead

            assert wait_until(workload_informer_dead, 10), "the Workload informer did not die"
            before = workload_lists()
            for _ in range(20):  # 20 more jobs of the flow, each polled while it waits
                unsubscribes.append(backend.subscribe(lambda: None))
                assert backend.statuses(["held-2"])["held-2"].state is JobState.QUEUED
                status = backend.current_status("held-2")
                assert status is not None and status.state is JobState.QUEUED
            assert workload_lists() == before, f"{workload_lists() - before} Workload lists"
            monkeypatch.setattr(_kube_job, "WORKLOAD_RETRY_S", 0.0)  # a while later
            unsubscribes.append(backend.subscribe(lambda: None))
            assert wait_until(lambda: workload_lists() > before, 10), "a dead one is never retried"
        finally:
            for unsubscribe in unsubscribes:
                unsubscribe()


@pytest.mark.parametrize("ending", ["failure", "timeout"])
def test_a_flow_run_that_fails_or_times_out_removes_its_queued_job(
    kube_server: Any, prefect_api: str, ending: str
) -> None:
    """Issue 28: "Our own stops (cancel, timeout, failure hooks, the sweeper) still remove
    queued jobs". A RayJob held in its LocalQueue (suspended: nobody admits it here) is
    deleted when its flow run fails (another task raised) or times out (`timeout_seconds`):
    nothing of it is left queued."""
    import uuid

    from prefect import flow

    from prefect_nemo import run_job
    from tests.conftest import wait_until

    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    block = KubeRayCluster(kubernetes=kube, ray_cluster_spec=cluster_spec(),
                           queue_name="team-a")  # fmt: skip
    spec = JobSpec(entrypoint="true", name=f"held-{uuid.uuid4().hex[:6]}")
    api = block.backend().api

    def ours() -> list[str]:
        items, _ = api.list(RAY_JOB, "default")
        return [o["metadata"]["name"] for o in items if f"-{spec.name}-" in o["metadata"]["name"]]

    @flow
    def fails() -> None:
        run_job.submit(spec, block)  # waits QUEUED in its own task run
        assert wait_until(ours, 30), "the job is in its queue"
        raise RuntimeError("another step failed")

    @flow(timeout_seconds=4)
    def times_out() -> None:
        run_job(spec, block)  # waits QUEUED: nobody admits it

    state = (fails if ending == "failure" else times_out)(return_state=True)
    assert state.is_failed(), state
    assert ours() == [], "the queued RayJob was deleted"


# the flow process the kill -9 test kills: one RayJob on a saved block, held in its LocalQueue
KILLED_SCRIPT = """
import sys
from prefect import flow
from prefect_nemo import JobSpec, run_job

@flow
def queued():
    run_job(JobSpec(entrypoint="echo must not run", name="q"), sys.argv[1])

queued()
"""


@pytest.mark.slow
def test_kill_9_then_the_sweeper_removes_the_queued_rayjob(
    kube_server: Any, prefect_api: str, tmp_path: Any
) -> None:
    """Issue 28: "Cancel, timeout, failure and kill -9 + sweeper of a run whose jobs are queued
    leave nothing queued". The flow process is killed with SIGKILL while its RayJob waits in its
    LocalQueue (suspended: nobody admits it here); the sweeper finds the job by our labels
    (issue 17), reads it QUEUED (live, not stopped) and deletes it: nothing is left queued."""
    import os
    import signal
    import subprocess
    import sys
    import uuid

    from prefect_nemo.tasks.sweeper import sweep
    from tests.conftest import subprocess_env, wait_until

    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    block = KubeRayCluster(kubernetes=kube, ray_cluster_spec=cluster_spec(), queue_name="team-a",
                           sweep_grace_s=1)  # fmt: skip
    saved = f"kueue-killed-{uuid.uuid4().hex[:6]}"
    block.save(saved)
    key = f"killed-{uuid.uuid4().hex[:6]}"
    api = block.backend().api

    def ours() -> list[dict[str, Any]]:
        items, _ = api.list(RAY_JOB, "default")
        return [o for o in items if o["metadata"]["name"].startswith(f"{key}-")]

    env = subprocess_env(prefect_api, PREFECT_NEMO_RUN_KEY=key, PREFECT_NEMO_HEARTBEAT_S="1")
    log = tmp_path / "killed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, f"kube-ray-cluster/{saved}"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:

        def queued() -> list[dict[str, Any]]:
            assert proc.poll() is None, log.read_text()[-3000:]
            return [o for o in ours() if o["spec"].get("suspend")]

        (job,) = wait_until(queued, 180) or [None]
        assert job is not None, log.read_text()[-3000:]
        assert job["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    name = job["metadata"]["name"]
    assert block.backend().find(name).state is JobState.QUEUED  # type: ignore[union-attr]

    def swept() -> Any:
        return [v for v in sweep([block], lease_s=4) if v.job_id == name and v.stop]

    verdicts = wait_until(swept, 90)
    assert [v.outcome for v in verdicts] == ["STOPPED"], verdicts
    assert wait_until(lambda: not ours(), 30), "nothing left queued"


def test_kueues_fixed_certificates_are_renewed_before_they_expire(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kueue reads its metrics and visibility certificates from fixed paths; ours last a week.
    A pair good for more than a day is kept as it is (another control plane may be using it);
    one expiring within the day, or half missing, is replaced by a fresh pair."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from prefect_nemo.testing.control_plane import kueue

    fresh, expiring, half = tmp_path / "fresh", tmp_path / "expiring", tmp_path / "half"
    monkeypatch.setattr(kueue, "FIXED_CERT_DIRS", (fresh, expiring, half))
    kueue._ensure_fixed_certs()
    kept = (fresh / "tls.crt").read_bytes()
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "kueue")])
    key = ec.generate_private_key(ec.SECP256R1())
    hour = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(hours=1))
            .sign(key, hashes.SHA256()))  # fmt: skip
    (expiring / "tls.crt").write_bytes(hour.public_bytes(serialization.Encoding.PEM))
    (half / "tls.crt").unlink()

    kueue._ensure_fixed_certs()
    assert (fresh / "tls.crt").read_bytes() == kept
    for folder in (expiring, half):
        cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
        assert cert.not_valid_after_utc > now + datetime.timedelta(days=6), folder
        assert (folder / "tls.key").stat().st_mode & 0o777 == 0o600
