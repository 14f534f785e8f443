"""The rules of the one Kubernetes job base (backends/_kube_job.py), asserted for BOTH job
backends: RayJob (the KubeRay simulator, jobs on the session's real local Ray) and TrainJob (the
Trainer simulator, pods as local processes), on a loopback API server driven by the real
`kubernetes` client, through `run_job` in a Prefect flow where the issue speaks of the task.

Each test gets its own API server, with its own token (so its own watcher: the registry is keyed
by the server's address and the credentials, and a later server may get an earlier one's port),
and reaches it through a TcpProxy, which can take the API away; the simulators talk to the
server directly, as a cluster's operators keep running while the flow loses the API.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prefect import flow  # at import time: Prefect configures logging when `flow` is first imported

from prefect_nemo import AuthenticationFailed, BackendUnavailable, JobSpec, JobState
from prefect_nemo.errors import BackendClosed
from prefect_nemo.kube import POD, RAY_JOB, TRAIN_JOB, Kind, KubeApi
from tests.conftest import wait_until

LOOPBACK_RAY_CLUSTER = {  # the KubeRay simulator runs every cluster's jobs on the one real Ray
    "headGroupSpec": {
        "rayStartParams": {},
        "template": {"spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray"}]}},
    },
}


@dataclass
class JobKind:
    """What differs between the two job backends, for these tests."""

    name: str
    kind: Kind
    running: Callable[[KubeApi, dict[str, Any]], bool]  # the job's object says it runs
    stopped: Callable[[dict[str, Any] | None], bool]  # ... that it was stopped (or is gone)
    done: dict[str, Any]  # a status patch that completes the job (no operator needed)
    live: dict[str, Any]  # a status patch that says the job runs, on its object alone


def _rayjob_running(api: KubeApi, obj: dict[str, Any]) -> bool:
    return (obj.get("status") or {}).get("jobStatus") == "RUNNING"


def _trainjob_running(api: KubeApi, obj: dict[str, Any]) -> bool:
    job = obj["metadata"]["name"]
    pods, _ = api.list(POD, label_selector=f"jobset.sigs.k8s.io/jobset-name={job}")
    return any((p.get("status") or {}).get("phase") == "Running" for p in pods)


KINDS = {
    "rayjob": JobKind(
        "rayjob", RAY_JOB, _rayjob_running,
        stopped=lambda obj: obj is None or obj["status"].get("jobStatus") == "STOPPED",
        done={"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "jobId": "x"},
        live={"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "jobId": "x"},
    ),
    "trainjob": JobKind(
        "trainjob", TRAIN_JOB, _trainjob_running,
        stopped=lambda obj: obj is None,  # stopped by deleting it
        done={"conditions": [{"type": "Complete", "status": "True", "reason": "Done",
                              "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        live={"jobsStatus": [{"name": "node", "ready": 1, "active": 1, "succeeded": 0,
                              "failed": 0, "suspended": 0}]},
    ),
}  # fmt: skip


@dataclass
class Env:
    """A loopback API server (behind a proxy), its operator simulator and how to make blocks."""

    job: JobKind
    server: Any
    proxy: Any
    ray_head: Any = None
    kube: Any = None  # the KubernetesCluster block (through the proxy)
    logs: list[logging.LogRecord] = field(default_factory=list)

    def block(self, **kw: Any) -> Any:
        """The job kind's cluster block on `kube` (or the `kubernetes` block given)."""
        from prefect_nemo.blocks import KubeflowTrainerCluster, KubeRayCluster

        kw.setdefault("max_poll_interval_s", 0.5)
        kw.setdefault("kubernetes", self.kube)
        if self.job.name == "rayjob":
            return KubeRayCluster(
                ray_cluster_spec=LOOPBACK_RAY_CLUSTER, ray_token=self.ray_head.token,
                ttl_seconds_after_finished=30, **kw,
            )  # fmt: skip
        return KubeflowTrainerCluster(image="python:3.11-slim", **kw)

    def kube_block(self, token: str | None = None, name: str | None = None) -> Any:
        """A KubernetesCluster block on the server through the proxy, saved (its name goes into
        auth errors) under `name` (overwritten) or a new one; the server's token by default."""
        from prefect_nemo.blocks.kubernetes import KubernetesCluster

        config = self.server.kubeconfig(token=token)
        config["clusters"][0]["cluster"]["server"] = self.proxy.url
        kube = KubernetesCluster(kubeconfig=config)
        kube.save(name or f"kube-{self.job.name}-{uuid.uuid4().hex[:8]}", overwrite=True)
        return kube

    def api(self) -> KubeApi:
        """A client straight to the server (with its current token), to look behind our back."""
        return KubeApi(self.server.api_client())

    def objects(self) -> list[dict[str, Any]]:
        """Every object of the job kind on the server."""
        return self.api().list(self.job.kind)[0]

    def get(self, job_id: str) -> dict[str, Any] | None:
        """The job's object on the server, or None."""
        return self.api().get(self.job.kind, job_id)

    def our_watches(self) -> int:
        """Watch requests of our informers (labelled selector) on the job kind so far."""
        return sum(
            1
            for e in self.server.requests.entries
            if e.is_watch and f"/{self.job.kind.plural}" in e.path
            and "managed-by=prefect-nemo" in e.query.get("labelSelector", "")
        )  # fmt: skip


@pytest.fixture(params=sorted(KINDS))
def env(request: pytest.FixtureRequest, prefect_api: str) -> Iterator[Env]:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir
    from prefect_nemo.testing.operators import KubeRaySimulator, TrainJobSimulator
    from prefect_nemo.testing.proxy import TcpProxy

    job = KINDS[request.param]
    server = LoopbackKubeServer(crds=[crd_dir()]).start()
    host, port = server.url.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port)).start()
    ray_head = request.getfixturevalue("ray_head") if job.name == "rayjob" else None
    sim = (
        KubeRaySimulator(server, ray_head.dashboard_url, ray_head.token)
        if ray_head is not None
        else TrainJobSimulator(server)
    )
    sim.start()
    out = Env(job, server, proxy, ray_head)
    out.kube = out.kube_block()
    handler = _Collect(out.logs)
    logging.getLogger("prefect_nemo").addHandler(handler)
    try:
        yield out
    finally:
        logging.getLogger("prefect_nemo").removeHandler(handler)
        ray_jobs = [(o.get("status") or {}).get("jobId") for o in out.objects()]
        sim.stop()
        proxy.stop()
        server.stop()
        if ray_head is not None:  # a job left running (token revoked) must not hold Ray's CPUs
            _stop_ray_jobs(ray_head, [j for j in ray_jobs if j])


class _Collect(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _stop_ray_jobs(ray_head: Any, job_ids: list[str]) -> None:
    client = ray_head.block().backend().client
    for job_id in job_ids:
        if not client.get_job_status(job_id).is_terminal():
            client.stop_job(job_id)



class FlowInThread:
    """Runs `run_job(spec, block)` in a flow on a thread; keeps its result or error and when."""

    def __init__(self, spec: JobSpec, block: Any) -> None:
        from prefect_nemo import run_job

        @flow
        def job_flow() -> Any:
            from prefect.runtime import flow_run

            self.flow_run_id = str(flow_run.id)
            return run_job(spec, block, stream_logs=False)

        self.flow_run_id = ""
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None

        def run() -> None:
            try:
                self.result = job_flow()
            except BaseException as exc:  # the test asserts on it
                self.error = exc
            self.ended_at = time.monotonic()

        self.thread = threading.Thread(
            target=contextvars.copy_context().run, args=(run,), daemon=True
        )
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the flow is still running after {timeout_s:g}s"


def running_job(env: Env, timeout_s: float = 60.0, count: int = 1) -> str:
    """The job id once the job runs (each test's server holds that one job), or once `count`
    jobs run (the first one's id)."""
    api = env.api()

    def running() -> list[dict[str, Any]] | None:
        jobs = [o for o in env.objects() if env.job.running(api, o)]
        return jobs if len(jobs) >= count else None

    found = wait_until(running, timeout_s)
    assert found, f"{count} {env.job.kind.kind}(s) never ran"
    return str(found[0]["metadata"]["name"])


# ---------------------------------------------------------------------------------------------
# Through run_job in a flow


@pytest.mark.slow
def test_a_revoked_token_fails_the_task_at_once_naming_the_block(env: Env) -> None:
    """Issue 13 (3a): "the token is revoked mid-wait (the server starts answering 401): the task
    fails within 5 s with `AuthenticationFailed` naming the block". The block gives the API five
    minutes of unreachable budget, so failing within 5 s shows the 401 is final at once, not
    retried as an outage (the Kubeflow backend used to retry it for the whole budget)."""
    block = env.block(unreachable_budget_s=300)
    running = FlowInThread(JobSpec(entrypoint="sleep 60", name="revoked"), block)
    running_job(env)
    revoked_at = time.monotonic()
    env.server.revoke_token()
    running.join(60)
    assert isinstance(running.error, AuthenticationFailed), running.error
    assert running.ended_at is not None and running.ended_at - revoked_at < 5
    message = str(running.error)
    assert f"KubernetesCluster '{env.kube._block_document_name}'" in message
    assert "kubeconfig field" in message
    assert env.server.token not in message and "Bearer" not in message


@pytest.mark.slow
def test_each_blocks_jobs_are_watched_with_that_blocks_own_token(env: Env) -> None:
    """Two blocks of two users (tokens) on one cluster, and a token fixed after a 401: each
    block's jobs are watched with its own credentials. Found in CI (ci41): the process-wide
    watcher was keyed by the cluster alone and polled with the backend that made it, so a
    later block (here: a new server on the port of an earlier test's, whose token was revoked)
    was watched with the earlier token, and its job failed with that 401 at once. Asserted:
    revoking one user's token fails that user's job only, the other's job succeeds, and the
    first block saved again with a good token runs its next job to the end."""
    revoked, kept = env.server.issue_token(), env.server.issue_token()
    first, second = env.kube_block(revoked), env.kube_block(kept)
    doomed = FlowInThread(JobSpec(entrypoint="sleep 60", name="a"), env.block(kubernetes=first))
    others = FlowInThread(JobSpec(entrypoint="sleep 6", name="b"), env.block(kubernetes=second))
    running_job(env, count=2)
    env.server.revoke_token(revoked)
    doomed.join(60)
    assert isinstance(doomed.error, AuthenticationFailed), doomed.error
    assert f"KubernetesCluster '{first._block_document_name}'" in str(doomed.error)
    others.join(60)
    assert others.error is None, f"the other user's job failed: {others.error!r}"
    assert others.result.state is JobState.SUCCEEDED
    fixed = env.kube_block(env.server.issue_token(), name=first._block_document_name)
    rerun = FlowInThread(JobSpec(entrypoint="sleep 1", name="rerun"), env.block(kubernetes=fixed))
    rerun.join(60)
    assert rerun.error is None, f"the fixed block's job failed: {rerun.error!r}"
    assert rerun.result.state is JobState.SUCCEEDED


@pytest.mark.slow
def test_a_dead_informer_thread_is_replaced_and_the_wait_completes(env: Env) -> None:
    """Issue 13 (3b): "the informer's watch thread dies: it is replaced and the wait completes".
    The server writes an event our informer cannot digest (an object without a name) into its
    watch: a real failure on the real stream, which ends the informer's thread. The base replaces
    it (a new list+watch) and the job's end is still seen: SUCCEEDED. The budget is short, so a
    dead informer left in place (statuses() failing on it) would fail the task instead."""
    block = env.block(unreachable_budget_s=20)
    running = FlowInThread(JobSpec(entrypoint="sleep 5", name="replaced"), block)
    running_job(env)
    assert wait_until(env.our_watches, 15), "our informer never watched"
    watches = env.our_watches()
    garbled = {"type": "ADDED", "object": {"kind": "Garbled"}}
    assert env.server.inject_watch_event(garbled, plural=env.job.kind.plural)

    def died() -> bool:
        return any(r.getMessage().startswith("informer for") for r in env.logs)

    assert wait_until(died, 10), "the informer's thread did not die"
    running.join(90)
    assert running.error is None, running.error
    assert running.result.state is JobState.SUCCEEDED
    assert env.our_watches() > watches, "no new informer watched"


@pytest.mark.slow
def test_an_outage_shorter_than_the_budget_is_survived(env: Env) -> None:
    """Issue 13 (3c): "an API outage shorter than `unreachable_budget_s` is survived": the API
    goes away for 3 s of a 30 s budget while the job runs; the wait goes on to SUCCEEDED."""
    block = env.block(unreachable_budget_s=30)
    running = FlowInThread(JobSpec(entrypoint="sleep 8", name="outage"), block)
    running_job(env)
    env.proxy.go_down()
    time.sleep(3)
    env.proxy.come_back()
    running.join(90)
    assert running.error is None, running.error
    assert running.result.state is JobState.SUCCEEDED
    assert any("down for" in r.getMessage() for r in env.logs), "the outage was not noticed"


@pytest.mark.slow
def test_a_longer_outage_fails_clearly_and_the_job_is_stopped_when_the_api_returns(
    env: Env,
) -> None:
    """Issue 13 (3c): "a longer one fails with a clear error and the job is stopped when the API
    returns": the API stays away past a 2 s budget; the task fails with BackendUnavailable that
    says so and names the field to raise, and once the API is back the job is stopped (the
    RayJob's Ray job STOPPED, the TrainJob deleted), as seen on the server."""
    block = env.block(unreachable_budget_s=2, stop_timeout_s=60)
    running = FlowInThread(JobSpec(entrypoint="sleep 120", name="lost"), block)
    job_id = running_job(env)
    env.proxy.go_down()
    time.sleep(10)  # past the budget: the watcher gave up and the task is trying to stop the job
    assert running.thread.is_alive(), "the stop must wait for the API"
    env.proxy.come_back()
    running.join(90)
    assert isinstance(running.error, BackendUnavailable), running.error
    assert not isinstance(running.error, AuthenticationFailed)
    assert "unreachable" in str(running.error) and "unreachable_budget_s" in str(running.error)
    assert wait_until(lambda: env.job.stopped(env.get(job_id)), 30), env.get(job_id)


# ---------------------------------------------------------------------------------------------
# The backend alone: who starts threads, and who stops them


def _ours(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t not in before and t.name.startswith("prefect-nemo")]  # fmt: skip


def _submitted(env: Env, backend: Any) -> str:
    job_id = f"unit-{uuid.uuid4().hex[:8]}"
    backend.submit(JobSpec(entrypoint="sleep 30"), job_id, {})
    return job_id


@pytest.fixture(params=sorted(KINDS))
def bare(request: pytest.FixtureRequest) -> Iterator[Env]:
    """A loopback API server with no operator: the tests drive the job's status themselves."""
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    with LoopbackKubeServer(crds=[crd_dir()]) as server:
        yield Env(KINDS[request.param], server, proxy=None,
                  kube=KubernetesCluster(kubeconfig=server.kubeconfig()))  # fmt: skip


def _backend(env: Env) -> Any:
    from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend, TrainerConfig
    from prefect_nemo.backends.kuberay import KubeRayBackend, RayJobConfig

    if env.job.name == "rayjob":
        return KubeRayBackend(env.kube.api(), RayJobConfig(ray_cluster_name="c"))
    return KubeflowTrainerBackend(env.kube.api(), TrainerConfig(image="python:3.11-slim"))


def test_an_unsubscribed_backend_starts_no_thread(bare: Env) -> None:
    """An instance that nobody subscribed starts no thread: statuses() answers from one list
    request (of the jobs, and of their pods where the kind reads them), with no watch."""
    backend = _backend(bare)
    job_id = _submitted(bare, backend)
    before = set(threading.enumerate())
    bare.server.requests.clear()
    statuses = backend.statuses([job_id, "no-such-job"])
    assert statuses[job_id].state is JobState.PENDING and "no-such-job" not in statuses
    assert backend.informers == () and not _ours(before)
    assert bare.server.requests.count(watch=True) == 0
    lists = bare.server.requests.count("GET", f"/{bare.job.kind.plural}", watch=False)
    assert lists == 2  # the one list, and the GET that says the missing id is absent


def test_close_stops_every_informer_and_later_statuses_raise_backend_closed(bare: Env) -> None:
    """close() stops every informer thread it started (none is left alive when it returns);
    afterwards statuses() raises BackendClosed and a new subscriber starts nothing."""
    backend = _backend(bare)
    job_id = _submitted(bare, backend)
    before = set(threading.enumerate())
    woken = threading.Event()
    backend.subscribe(woken.set)
    assert wait_until(lambda: all(i.synced.is_set() for i in backend.informers), 10)
    assert [t.name for t in _ours(before)], "subscribing starts the informers"
    backend.close()
    assert not _ours(before), [t.name for t in _ours(before)]
    assert woken.is_set(), "close() wakes the subscribers so they see BackendClosed"
    with pytest.raises(BackendClosed):
        backend.statuses([job_id])
    backend.subscribe(lambda: None)
    assert backend.informers == () and not _ours(before)
    backend.close()  # idempotent


def test_nothing_runs_on_after_the_server_stops_and_the_backend_closes(bare: Env) -> None:
    """Issue 13 (must hold 4): "wait a job on a loopback API server, stop the server, close the
    backend: within 2 s no thread started by prefect-nemo is alive and nothing more is logged".
    A watcher waits the job to its end; statuses() is asked once more (as the bench did, which
    used to leave an informer retrying every ~5 s); a subscriber is still there when the server
    stops, so close() must end informers that are retrying against a dead server."""
    from prefect_nemo.lifecycle import wait_until_terminal
    from prefect_nemo.watcher import ClusterWatcher

    backend = _backend(bare)
    before = set(threading.enumerate())
    job_id = _submitted(bare, backend)
    watcher = ClusterWatcher(backend, max_interval_s=0.5)
    threading.Timer(
        1.0, lambda: bare.api().patch(bare.job.kind, job_id, {"status": bare.job.done},
                                      subresource="status"),
    ).start()  # fmt: skip
    final = wait_until_terminal(watcher, backend.handle(job_id), timeout_s=60)
    assert final.state is JobState.SUCCEEDED
    assert backend.statuses([job_id])[job_id].state is JobState.SUCCEEDED
    backend.subscribe(lambda: None)
    assert wait_until(lambda: all(i.synced.is_set() for i in backend.informers), 10)
    bare.server.stop()
    backend.close()
    assert wait_until(lambda: not _ours(before), 2), [t.name for t in _ours(before)]
    records: list[logging.LogRecord] = []
    handler = _Collect(records)
    logging.getLogger("prefect_nemo").addHandler(handler)
    try:
        time.sleep(1.0)
    finally:
        logging.getLogger("prefect_nemo").removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


def test_the_watcher_asks_only_about_the_jobs_the_watch_says_changed(bare: Env) -> None:
    """Issue 16 (2), push, not poll: "the informers already know which objects changed. Make
    the watcher wake only the waits whose job changed ... so 1,000 idle waits cost ~0 CPU".
    What the watch is documented for (Kubernetes API Concepts, "Efficient detection of
    changes"): "watch is a verb that is used to track changes to an object in Kubernetes as a
    stream. It is used for the efficient detection of changes." With 20 jobs watched and idle,
    the watcher asks the backend nothing (its safety-net full pass comes every max_interval_s,
    set long here); when one job's status changes, it asks about that job alone."""
    from prefect_nemo.watcher import ClusterWatcher

    backend = _backend(bare)
    job_ids = [_submitted(bare, backend) for _ in range(20)]
    asked: list[list[str]] = []
    statuses = backend.statuses

    def recording(ids: Any) -> Any:
        asked.append(list(ids))
        return statuses(ids)

    backend.statuses = recording
    watcher = ClusterWatcher(backend, max_interval_s=3600)
    with contextlib.ExitStack() as stack:
        for job_id in job_ids:
            stack.enter_context(watcher.watching(job_id))
        assert wait_until(lambda: all(watcher.latest(j) for j in job_ids), 10)
        assert wait_until(lambda: all(i.synced.is_set() for i in backend.informers), 10)
        idle_from = -1  # settled: the informers' first list told of every job once
        for _ in range(20):
            if idle_from == (idle_from := len(asked)):
                break
            time.sleep(0.5)
        time.sleep(1.0)
        assert asked[idle_from:] == [], "idle jobs were asked about"
        done = job_ids[7]
        bare.api().patch(bare.job.kind, done, {"status": bare.job.done}, subresource="status")
        assert wait_until(lambda: (watcher.latest(done) or _pending()).state.is_terminal(), 10)
        assert asked[idle_from:] and all(ids == [done] for ids in asked[idle_from:]), asked
    watcher.close()
    backend.close()


def _pending() -> Any:
    from prefect_nemo.jobs import JobStatus

    return JobStatus(job_id="", state=JobState.PENDING)


# ---------------------------------------------------------------------------------------------
# The sweeper's view: owned_jobs(), and a stop from a backend that submitted nothing


def _foreign(env: Env, backend: Any, entrypoint: str) -> str:
    """A job object of the kind created straight with the `kubernetes` client, as someone else
    would: our manifest with no label or annotation of ours. Returns its name."""
    from kubernetes import client as k8s

    name = f"foreign-{uuid.uuid4().hex[:8]}"
    manifest = backend.render(JobSpec(entrypoint=entrypoint), name, {})[-1]
    manifest["metadata"].pop("labels")
    manifest["metadata"].pop("annotations")
    kind = env.job.kind
    k8s.CustomObjectsApi(env.server.api_client()).create_namespaced_custom_object(
        kind.group, kind.version, backend.namespace, kind.plural, manifest
    )
    return name


def _sweeper_lists(env: Env) -> list[Any]:
    """The list requests made with exactly our managed-by selector (the sweeper's listing)."""
    ours = "app.kubernetes.io/managed-by=prefect-nemo"
    return [e for e in env.server.requests.entries
            if not e.is_watch and e.path.endswith(f"/{env.job.kind.plural}")
            and e.query.get("labelSelector") == ours]  # fmt: skip


def test_owned_jobs_is_one_list_of_our_live_jobs_with_their_owner(bare: Env) -> None:
    """Issue 17 (1), the sweeper's view of a Kubernetes cluster, on its own (no operator: the
    test writes each job's status): ONE list request by our managed-by label, whatever the
    number of jobs; a live job is listed with the flow run its `prefect.io/flow-run-id` label
    names (the full id; None for a job submitted without one), its state read from its object
    alone (RUNNING: the RayJob's jobStatus, the TrainJob's jobsStatus), its creationTimestamp as
    submitted_at; a job of ours that ended is not listed, nor is an object of the kind created
    with the client without our label."""
    from prefect_nemo.backends._kube_objects import parse_time
    from prefect_nemo.jobs import META_FLOW_RUN, META_KEY

    backend = _backend(bare)
    owner = str(uuid.uuid4())
    ids = {k: f"{k}-{uuid.uuid4().hex[:8]}" for k in ("live", "pending", "ended")}
    for key, job_id in ids.items():
        meta = {META_KEY: f"scope/{key}"} | ({} if key == "pending" else {META_FLOW_RUN: owner})
        backend.submit(JobSpec(entrypoint="sleep 30"), job_id, meta)
    api = bare.api()
    api.patch(bare.job.kind, ids["live"], {"status": bare.job.live}, subresource="status")
    api.patch(bare.job.kind, ids["ended"], {"status": bare.job.done}, subresource="status")
    foreign = _foreign(bare, backend, "sleep 30")
    bare.server.requests.clear()
    owned = {j.job_id: j for j in backend.owned_jobs()}
    assert len(bare.server.requests.entries) == 1 and len(_sweeper_lists(bare)) == 1
    assert set(owned) == {ids["live"], ids["pending"]}, owned  # not ended, not foreign
    assert foreign in {o["metadata"]["name"] for o in bare.objects()}
    live = owned[ids["live"]]
    assert live.state is JobState.RUNNING and live.flow_run_id == owner
    assert owned[ids["pending"]].state is JobState.PENDING
    assert owned[ids["pending"]].flow_run_id is None
    created = (bare.get(ids["live"]) or {})["metadata"]["creationTimestamp"]
    assert live.submitted_at is not None and live.submitted_at == parse_time(created)


@pytest.mark.slow
def test_a_sweeper_finds_a_flow_runs_job_and_stops_it_from_a_fresh_backend(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17 (1), as the sweeper sees it on a cluster the operators run: a job run_job
    submitted in a flow is listed by `owned_jobs()` of a FRESH backend instance (nothing
    remembered of the submit, as in another process) with the flow run's full id, from the
    job's label, in one list request; an object of the kind created with the client (no label of
    ours) and a job of ours that ended are not listed. Stopping the job from that instance is
    confirmed by `lifecycle.stop_and_confirm` (STOPPED), after which it is no longer listed and
    the flow that waited on it ends with JobStopped."""
    from prefect_nemo.backends._kube_objects import JobMemory
    from prefect_nemo.errors import JobStopped
    from prefect_nemo.jobs import META_FLOW_RUN, META_KEY
    from prefect_nemo.lifecycle import stop_and_confirm

    block = env.block()
    running = FlowInThread(JobSpec(entrypoint="sleep 120", name="swept"), block)
    job_id = running_job(env)
    other = block.backend()
    ended = f"ended-{uuid.uuid4().hex[:8]}"
    other.submit(JobSpec(entrypoint="true"), ended,
                 {META_FLOW_RUN: str(uuid.uuid4()), META_KEY: "scope/ended"})  # fmt: skip
    assert wait_until(lambda: (s := other.find(ended)) is not None and s.state.is_terminal(), 90)
    foreign = _foreign(env, other, "sleep 30")

    sweeper = block.backend()
    monkeypatch.setattr(type(sweeper), "memory", JobMemory())  # a new process remembers nothing

    def listed() -> list[Any]:
        return [j for j in sweeper.owned_jobs() if j.state is JobState.RUNNING]

    assert wait_until(listed, 30), "the job never read RUNNING from its object"
    env.server.requests.clear()
    owned = sweeper.owned_jobs()
    assert len(_sweeper_lists(env)) == 1
    assert [(j.job_id, j.flow_run_id) for j in owned] == [(job_id, running.flow_run_id)]
    assert len(running.flow_run_id) == 36  # the full UUID, not a truncated label value
    assert {ended, foreign} <= {o["metadata"]["name"] for o in env.objects()}

    final = stop_and_confirm(sweeper, job_id, timeout_s=60)
    assert final is not None and final.state is JobState.STOPPED, final
    assert job_id not in {j.job_id for j in sweeper.owned_jobs()}
    running.join(90)
    assert isinstance(running.error, JobStopped), running.error
    sweeper.close()
