"""Recovery by failure class (issue 29, item 1): the policy's arithmetic, then real attempts on
a real local Ray cluster (Jobs API): an application error, a budget of errors, a named exit
code, an infrastructure failure seen in the log, and a worker node killed under a job.

The rules these tests hold, as issue 29 states them:
- "an application error (exit code 1, a Python traceback, OOM in user code) should fail fast
  with its log tail, or be retried only on exit codes the user names";
- "preempted ... and infrastructure ... should be resubmitted, resuming from the last
  checkpoint, without using up the user's error budget";
- "a spec error (bad image, bad entrypoint, invalid manifest) should never be retried";
- "max_restarts_on_errors is honoured exactly; a preemption does not count against it";
- "Each new attempt gets the next -rN id, chained in the job table and in events
  (prefect-nemo.job.retrying with the class and reason); the job gets PREFECT_NEMO_ATTEMPT and
  the previous attempt's id so it can resume from its checkpoint; JobResult lists the attempts."
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from prefect_nemo import JobSpec, JobState
from prefect_nemo.errors import InvalidJobSpec, JobFailed
from prefect_nemo.jobs import (
    Failure,
    FailureClass,
    JobHandle,
    JobResult,
    JobStatus,
    RecoveryPolicy,
)
from prefect_nemo.lifecycle import META_KEY
from prefect_nemo.local_ray import LocalRayCluster, kill_session, start_local_ray
from prefect_nemo.recovery import Recovery, classify
from tests.conftest import jobs_of_run, wait_until
from tests.progress_checks import events as flow_run_events
from tests.ray_nodes import worker_node

APP, INFRA = FailureClass.APPLICATION, FailureClass.INFRASTRUCTURE
PATTERNS = RecoveryPolicy().infrastructure_logs


def _failed(exit_code: int | None = 1, failure: Failure | None = None, job: str = "j") -> JobResult:
    handle = JobHandle(backend="ray-jobs", cluster="c", job_id=job)
    return JobResult(handle=handle, state=JobState.FAILED, exit_code=exit_code, failure=failure)


def _app(code: int = 1) -> JobResult:
    return _failed(code, Failure(kind=APP, reason=f"exit code {code}"))


def _cluster(kind: FailureClass = FailureClass.PREEMPTED) -> JobResult:
    return _failed(None, Failure(kind=kind, reason="NODE_FAIL", node="n1"))


# -- the classes and the budgets (pure) -----------------------------------------------------------


def test_the_engine_says_the_class_and_a_log_line_names_the_clusters_fault():
    status = JobStatus(job_id="j", state=JobState.FAILED, exit_code=1)
    assert classify(status, "Traceback...\nValueError: bad", PATTERNS).kind is APP
    assert classify(status, "", PATTERNS).reason == "exit code 1"
    nccl = "step 10\nRuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled system error"
    seen = classify(status, nccl, PATTERNS)
    assert seen.kind is INFRA and "NCCL error" in seen.reason, "the code only passed it on"
    xid = classify(status, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", PATTERNS)
    assert xid.kind is INFRA
    spec = Failure(kind=FailureClass.SPEC, reason="ImagePullBackOff")
    assert classify(status.model_copy(update={"failure": spec}), nccl, PATTERNS) == spec, (
        "what the engine says of the cluster or the spec stands over any log line"
    )
    assert classify(status, nccl, ()).kind is APP, "no patterns, no log classification"


def test_a_secret_in_the_line_that_classifies_a_failure_is_masked():
    """ "Secrets never leak": the reason of a failure is a log line or the engine's message,
    and it reaches events, the job table, JobResult and errors."""
    from prefect_nemo.lifecycle import Supervisor, WaitPolicy
    from prefect_nemo.redaction import MASK, Redactor

    secret = "hf_s3cr3t_t0k3n_value"
    supervisor = Supervisor(None, WaitPolicy(), redact=Redactor([secret]))  # type: ignore[arg-type]
    status = JobStatus(job_id="j", state=JobState.FAILED, exit_code=1)
    seen = supervisor._classified(status, f"RuntimeError: NCCL error token={secret}")
    assert seen.failure is not None and seen.failure.kind is INFRA
    assert secret not in seen.failure.reason and MASK in seen.failure.reason
    said = Failure(kind=FailureClass.SPEC, reason=f"pull {secret} denied")
    engine = supervisor._classified(status.model_copy(update={"failure": said}), "")
    assert engine.failure is not None and secret not in engine.failure.reason


def test_an_application_error_is_not_retried_by_default_and_says_which_knob_would():
    recovery = Recovery(RecoveryPolicy())
    result = _app(1)
    assert recovery.retry_after(result) is None
    refusal = recovery.refusal(result)
    assert "max_restarts_on_errors=0" in refusal and "recover_on_exit_codes" in refusal


def test_max_restarts_on_errors_is_honoured_exactly_and_a_preemption_does_not_count():
    recovery = Recovery(RecoveryPolicy(max_restarts_on_errors=2, backoff_s=0))
    assert recovery.retry_after(_app()) == 0
    assert recovery.retry_after(_cluster()) == 0, "the cluster's fault: not the error budget"
    assert recovery.retry_after(_cluster(INFRA)) == 0
    assert recovery.retry_after(_app()) == 0
    assert recovery.retry_after(_app()) is None, "2 restarts on errors, not 3"
    assert (recovery.error_restarts, recovery.cluster_restarts) == (2, 2)
    assert len(recovery.attempts) == 5


def test_named_exit_codes_always_recover_and_a_spec_error_never():
    recovery = Recovery(RecoveryPolicy(recover_on_exit_codes=(3,), backoff_s=0))
    for _ in range(5):
        assert recovery.retry_after(_app(3)) == 0
    assert recovery.error_restarts == 0, "a named exit code uses no error budget"
    assert recovery.retry_after(_app(1)) is None
    spec = _failed(None, Failure(kind=FailureClass.SPEC, reason="ErrImagePull"))
    assert Recovery(RecoveryPolicy(max_restarts_on_errors=9)).retry_after(spec) is None


def test_the_clusters_budget_ends_and_the_wait_doubles_up_to_its_cap():
    recovery = Recovery(RecoveryPolicy(max_restarts_on_preemption=4, backoff_s=1, max_backoff_s=3))
    assert [recovery.retry_after(_cluster()) for _ in range(5)] == [1, 2, 3, 3, None]
    assert "max_restarts_on_preemption=4" in recovery.refusal(_cluster())


def test_a_re_attach_counts_the_attempts_that_ended_before_it():
    recovery = Recovery(RecoveryPolicy(max_restarts_on_errors=1, backoff_s=0))
    earlier = JobStatus(job_id="j", state=JobState.FAILED, exit_code=1)
    recovery.seed([earlier, JobStatus(job_id="j-r1", state=JobState.STOPPED)])
    assert recovery.error_restarts == 1 and len(recovery.attempts) == 2
    assert recovery.retry_after(_app()) is None, "the crash did not refill the budget"


def test_a_bad_policy_is_refused_naming_the_field():
    with pytest.raises(InvalidJobSpec, match=r"recover_on_exit_codes: 0 is no failing exit code"):
        RecoveryPolicy(recover_on_exit_codes=(0,))
    with pytest.raises(InvalidJobSpec, match=r"infrastructure_logs: '\(' is not a regular"):
        RecoveryPolicy(infrastructure_logs=("(",))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec.recovery.max_restarts_on_errors"):
        JobSpec(entrypoint="x", recovery={"max_restarts_on_errors": -1})
    same = JobSpec(entrypoint="x").fingerprint()
    assert JobSpec(entrypoint="x", recovery=RecoveryPolicy(backoff_s=0)).fingerprint() == same, (
        "how a job is recovered is not what it does: a changed policy attaches to the same job"
    )


# -- real attempts on a real Ray cluster ----------------------------------------------------------

# Exits with the code of its attempt (PREFECT_NEMO_ATTEMPT), printing what it was given.
ATTEMPTS_JOB = """
import json, os, sys
attempt = int(os.environ["PREFECT_NEMO_ATTEMPT"])
print(json.dumps({"attempt": attempt, "previous": os.environ.get("PREFECT_NEMO_PREVIOUS_JOB_ID")}))
codes = json.loads(sys.argv[1])
if attempt < len(codes) and codes[attempt] == "nccl":
    print("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled system error")
    sys.exit(1)
print(f"the last line of attempt {attempt}")
sys.exit(codes[attempt] if attempt < len(codes) else 0)
"""


def _run(block: Any, spec: JobSpec) -> tuple[Any, Any, str]:
    since = datetime.now(UTC).isoformat()

    @flow
    def attempts():
        from prefect_nemo import run_job

        return run_job(spec, cluster=block)

    state = attempts(return_state=True)
    return state, state.state_details.flow_run_id, since


def _retrying(prefect_api: str, flow_run_id: Any, since: str, count: int) -> list[dict]:
    """The run's `retrying` events, oldest first, once `count` of them arrived (events are
    delivered in the background)."""

    def seen() -> list[dict]:
        events = flow_run_events(prefect_api, flow_run_id, since, until="prefect-nemo.job.retrying")
        found = [e for e in events if e["event"] == "prefect-nemo.job.retrying"]
        return found if len(found) >= count else []

    return wait_until(seen, timeout_s=30)


def _spec(tmp_path: Path, name: str, codes: list[Any], **policy: Any) -> JobSpec:
    (tmp_path / "job.py").write_text(ATTEMPTS_JOB)
    return JobSpec(
        entrypoint=f"python job.py '{json.dumps(codes)}'",
        name=name,
        working_dir=tmp_path,
        recovery=RecoveryPolicy(backoff_s=0, **policy),
    )


@pytest.mark.slow
def test_an_application_exit_1_fails_at_once_with_its_log_tail_and_no_resubmission(
    ray_head, prefect_api, ray_client, tmp_path
):
    state, flow_run_id, _ = _run(ray_head.block(), _spec(tmp_path, "app-exit-1", [1]))
    assert state.is_failed()
    with pytest.raises(JobFailed) as caught:
        state.result()
    message = str(caught.value)
    assert "[application: exit code 1]" in message
    assert "the last line of attempt 0" in message, "its log tail"
    assert "not retried: an application error, max_restarts_on_errors=0" in message
    result = caught.value.result
    assert result.failure.kind is APP and result.attempts == ()
    assert jobs_of_run(ray_client, flow_run_id) == [result.handle.job_id], "no -r1"


@pytest.mark.slow
def test_two_restarts_on_errors_make_three_attempts_chained_in_events_and_rows(
    ray_head, prefect_api, ray_client, tmp_path
):
    from prefect_nemo.tasks import reporting

    spec = _spec(tmp_path, "errors-budget", [1, 1, 1, 1], max_restarts_on_errors=2)
    state, flow_run_id, since = _run(ray_head.block(), spec)
    with pytest.raises(JobFailed) as caught:
        state.result()
    result = caught.value.result
    first = result.attempts[0].job_id
    assert [a.job_id for a in result.attempts] == [first, f"{first}-r1"]
    assert result.handle.job_id == f"{first}-r2", "exactly 2 restarts: 3 attempts"
    assert sorted(jobs_of_run(ray_client, flow_run_id)) == sorted([first, f"{first}-r1",
                                                                     f"{first}-r2"])  # fmt: skip
    assert "used all 2 of max_restarts_on_errors" in str(caught.value)

    retrying = _retrying(prefect_api, flow_run_id, since, count=2)
    assert [e["payload"]["next_job_id"] for e in retrying] == [f"{first}-r1", f"{first}-r2"]
    assert {e["payload"]["class"] for e in retrying} == {"application"}
    assert retrying[0]["payload"]["reason"] == "exit code 1"
    rows = {r["job_id"]: r for r in reporting.job_rows(str(flow_run_id))}
    assert rows[first]["retried_as"] == f"{first}-r1"
    assert rows[f"{first}-r1"]["retried_as"] == f"{first}-r2"
    assert rows[f"{first}-r2"]["failure"] == "application: exit code 1"


@pytest.mark.slow
def test_a_named_exit_code_and_an_nccl_error_resubmit_without_the_error_budget(
    ray_head, prefect_api, ray_client, tmp_path, caplog
):
    spec = _spec(tmp_path, "named-and-nccl", [3, "nccl", 0], recover_on_exit_codes=(3,))
    state, flow_run_id, since = _run(ray_head.block(), spec)
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    first = result.attempts[0].job_id
    assert result.handle.job_id == f"{first}-r2"
    assert [a.failure.kind for a in result.attempts] == [APP, INFRA]
    assert "NCCL error" in result.attempts[1].failure.reason
    # each attempt knew its number and its predecessor (to resume from its checkpoint)
    lines = [r.getMessage() for r in caplog.records]  # "[<job id>] <line>" in the task's log
    told = [json.loads(line.split("] ", 1)[1]) for line in lines if '] {"attempt"' in line]
    assert told == [
        {"attempt": 0, "previous": None},
        {"attempt": 1, "previous": first},
        {"attempt": 2, "previous": f"{first}-r1"},
    ]
    retrying = _retrying(prefect_api, flow_run_id, since, count=2)
    classes = [e["payload"]["class"] for e in retrying]
    assert classes == ["application", "infrastructure"]


@pytest.mark.slow
def test_run_jobs_recovers_each_job_on_its_own(ray_head, prefect_api, ray_client, tmp_path):
    """run_jobs waits for its jobs on one event loop (Supervisor.run_async): a job whose first
    attempt fails is resubmitted there, the others are not held back, and each result lists
    its own attempts."""
    from prefect_nemo import run_jobs

    spec = _spec(tmp_path, "batch-flaky", [1], max_restarts_on_errors=1)
    steady = JobSpec(entrypoint="true", name="batch-steady")

    @flow
    def batch():
        return run_jobs([spec, steady], cluster=ray_head.block())

    state = batch(return_state=True)
    flaky, ok = state.result()
    assert flaky.state is JobState.SUCCEEDED and ok.state is JobState.SUCCEEDED
    first = flaky.attempts[0].job_id
    assert flaky.handle.job_id == f"{first}-r1" and ok.attempts == ()
    flow_run_id = state.state_details.flow_run_id
    assert sorted(jobs_of_run(ray_client, flow_run_id)) == sorted(
        [first, f"{first}-r1", ok.handle.job_id]
    )


@pytest.mark.slow
def test_a_rerun_after_kill_9_in_the_middle_of_a_recovery_attaches_to_the_newest_attempt(
    ray_head, prefect_api, ray_client, tmp_path
):
    """ "Re-attach after kill -9 in the middle of a recovery attaches to the newest attempt
    (0 duplicates)": the flow process dies while the resubmitted attempt runs; a re-run of the
    experiment attaches to that attempt, counts the one before it, and submits nothing."""
    from tests.test_crash_safety import HERE, child_env

    experiment = f"recover-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, str(HERE / "crash_flows.py"), "recovering", experiment, "15"]
    env = child_env(ray_head, prefect_api)

    def experiment_jobs() -> dict[str, str]:
        prefix = f"experiment:{experiment}/"
        return {
            j.submission_id: j.status.value
            for j in ray_client.list_jobs()
            if (j.metadata or {}).get(META_KEY, "").startswith(prefix)
        }

    with open(tmp_path / "first.log", "w") as out:
        first = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        running = wait_until(
            lambda: next((j for j, s in experiment_jobs().items()
                          if j.endswith("-r1") and s == "RUNNING"), None),
            120,
        )  # fmt: skip
        assert running, (tmp_path / "first.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    original = running.removesuffix("-r1")
    assert f"JOB={running} ATTACHED=True ATTEMPTS={original}" in second.stdout
    assert experiment_jobs() == {original: "FAILED", running: "SUCCEEDED"}, "0 duplicates"


# -- a worker node lost under a Ray Jobs job ------------------------------------------------------

# Puts an actor on the doomed worker (its custom resource) on the first attempt, and says so;
# later attempts run on the head, as a job resuming on a smaller cluster would.
NODE_JOB = """
import os, sys, time, ray
ray.init()
first = os.environ["PREFECT_NEMO_ATTEMPT"] == "0"
@ray.remote(num_cpus=0, max_restarts=0)
class Step:
    def run(self):
        time.sleep(0.5)
        return ray.get_runtime_context().get_node_id()
# later attempts on the head: the lost node may still look alive for a moment (Ray marks it
# dead after missed heartbeats), and an actor placed there would die with it again
options = {"resources": {"doomed": 1}} if first else {"resources": {"head": 0.01}}
step = Step.options(**options).remote()
print("on node", ray.get(step.run.remote()), flush=True)
if first:
    print("READY", flush=True)
    while True:
        ray.get(step.run.remote())
print("done")
"""


# how long the first attempt may take to print READY on the doomed node (its node's start
# included): ~20 s on a quiet 2-core machine
READY_WITHIN_S = 240


@pytest.fixture(scope="module")
def fast_head() -> Iterator[LocalRayCluster]:
    """A head of the module's own whose GCS declares a silent node dead within ~3 s (Ray's
    default health check takes ~15 s), so that a node's loss is seen in a test's time."""
    knobs = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
             "RAY_health_check_timeout_ms": "1000"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in knobs}
    os.environ.update(knobs)
    try:
        head = start_local_ray(num_cpus=4, resources={"head": 1})
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    with head:
        yield head


@pytest.mark.slow
# the module's Ray head and a second node start on this test's clock: CI's busy 2 cores ran it
# past the default 300 s once (the whole test takes ~100 s on a quiet machine)
@pytest.mark.timeout(600)
def test_a_ray_worker_node_killed_under_a_job_is_infrastructure_and_the_job_resubmitted(
    fast_head, prefect_api, tmp_path
):
    client = fast_head.block().backend().client  # Ray's own, to look behind our back
    (tmp_path / "job.py").write_text(NODE_JOB)
    spec = JobSpec(entrypoint="python job.py", name="node-lost", working_dir=tmp_path,
                   recovery=RecoveryPolicy(backoff_s=0))  # fmt: skip
    killed: dict[str, str] = {}

    def kill_once_on_the_node(node: subprocess.Popen[bytes], flow_over: threading.Event) -> None:
        def ready() -> str | None:
            for job in client.list_jobs():
                if job.submission_id and "READY" in client.get_job_logs(job.submission_id):
                    return job.submission_id
            return None

        deadline = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < deadline and node.poll() is None:
            if first := ready():
                killed["job"] = first
                kill_session(node.pid)
                return
            time.sleep(0.5)
        # never on the doomed node: stop its jobs (the first loops there forever) until the
        # flow is over, so that the test says so rather than running into its timeout
        killed["gave_up"] = f"the node's exit code: {node.poll()}"
        while not flow_over.wait(1):
            for job in client.list_jobs():
                if job.submission_id and not job.status.is_terminal():
                    client.stop_job(job.submission_id)

    @flow
    def lose_a_node():
        from prefect_nemo import run_job

        return run_job(spec, cluster=fast_head.block())

    since = datetime.now(UTC).isoformat()
    with worker_node(fast_head, {"doomed": 1}) as node:
        flow_over = threading.Event()
        killer = threading.Thread(target=kill_once_on_the_node, args=(node, flow_over))
        killer.start()
        try:
            state = lose_a_node(return_state=True)
        finally:
            flow_over.set()
            killer.join(30)
    first = killed.get("job")
    assert first, f"the first attempt never reached the doomed node in {READY_WITHIN_S} s: {killed}"
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    assert result.handle.job_id == f"{first}-r1"
    (lost,) = result.attempts
    assert lost.job_id == first and lost.failure.kind is INFRA, lost
    (retrying,) = _retrying(prefect_api, state.state_details.flow_run_id, since, count=1)
    assert retrying["payload"]["class"] == "infrastructure"
    assert retrying["payload"]["next_job_id"] == f"{first}-r1"
