"""run_jobs' backpressure on the backends that push back, each real: the Ray Jobs API behind a
loopback gateway answering 429/503, and Slurm at a QOS submit limit (issue 16, item 2). The
Kubernetes API's 429 is in test_run_jobs. No timings are asserted."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from prefect_nemo import JobSpec, JobState, run_jobs
from prefect_nemo.testing.throttle_proxy import ThrottleProxy
from tests.conftest import wait_until

IN_CI = os.environ.get("CI", "").lower() == "true"


def _names(prefix: str, n: int) -> list[JobSpec]:
    return [JobSpec(entrypoint="true", name=f"{prefix}-{i}") for i in range(n)]


def test_ray_jobs_429_and_503_shrink_the_window_and_every_job_runs_once(
    ray_head: Any, ray_client: Any, prefect_api: str, caplog: pytest.LogCaptureFixture
):
    """RFC 6585 §4: "The 429 status code indicates that the user has sent too many requests in
    a given amount of time ("rate limiting") ... MAY include a Retry-After header indicating how
    long to wait before making a new request." RFC 9110 §15.6.4: 503 "indicates that the server
    is currently unable to handle the request due to a temporary overload ... The server MAY
    send a Retry-After header field". The Ray dashboard itself never answers either to a job
    submit; the gateway in front of it does (here a loopback one, the real Ray client and a
    real Ray behind it): each pushback halves run_jobs' window, the submit is retried after the
    Retry-After, and every job is submitted once and succeeds."""
    from prefect_nemo.blocks import RayJobsCluster

    prefix = f"pb-{uuid.uuid4().hex[:6]}"
    with ThrottleProxy(ray_head.dashboard_url, retry_after_s=0.5) as proxy:
        proxy.throttle("POST", "/api/jobs/", [429, 503, 429])
        block = RayJobsCluster(dashboard_url=proxy.url, auth_token=ray_head.token)

        @flow
        def pushed() -> list[Any]:
            return run_jobs(_names(prefix, 5), block, max_in_flight=4)

        with caplog.at_level(logging.WARNING):
            results = pushed()
    assert [r.state for r in results] == [JobState.SUCCEEDED] * 5
    assert proxy.pushed_back == 3
    assert "pushed back (429" in caplog.text and "pushed back (503" in caplog.text
    assert "at most 1 jobs in flight" in caplog.text  # 4 -> 2 -> 1 (at least three halvings)
    ours = [j.submission_id for j in ray_client.list_jobs() if j.submission_id.count(prefix)]
    assert len(ours) == 5 == len(set(ours)), ours


# -- Slurm ------------------------------------------------------------------------------------

QOS = "prefect-nemo-submit2"
# what sbatch prints past a QOS submit limit (slurm 22.05: the reason, then the error's text)
SBATCH_AT_LIMIT = (
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\n"
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit "
    "limit, user's size and/or time limits)\n"
)


def test_sbatch_at_a_submit_limit_is_pushback_and_a_size_limit_is_not():
    """Slurm's reasons for a refusal at a submit limit (QOSMaxSubmitJobPerUserLimit,
    AssocMaxSubmitJobLimit, QOSGrpSubmitJobsLimit, AssocGrpSubmitJobsLimit: "The job's QOS/
    association has reached ..." a limit that frees as jobs end) are Throttled; the same
    "violates accounting/QOS policy" error for a size limit (QOSMaxCpuPerJobLimit) stays a
    refusal naming the block field."""
    from types import SimpleNamespace

    from prefect_nemo.backends.nemo_run.slurm.accounting import sbatch_error
    from prefect_nemo.errors import InvalidJobSpec, Throttled

    def refusal(stderr: str) -> Exception:
        return sbatch_error(SimpleNamespace(result=SimpleNamespace(stderr=stderr, exited=1)), "c")

    for reason in (
        "QOSMaxSubmitJobPerUserLimit",
        "AssocMaxSubmitJobLimit",
        "QOSGrpSubmitJobsLimit",
    ):
        error = refusal(SBATCH_AT_LIMIT.replace("QOSMaxSubmitJobPerUserLimit", reason))
        assert isinstance(error, Throttled) and reason in str(error)
    size = refusal(SBATCH_AT_LIMIT.replace("QOSMaxSubmitJobPerUserLimit", "QOSMaxCpuPerJobLimit"))
    assert isinstance(size, InvalidJobSpec) and not isinstance(size, Throttled)


@pytest.mark.nemo_run
@pytest.mark.slow
def test_slurm_submit_limit_is_waited_out_and_every_job_runs(
    slurm: Any, tmp_path: Path, prefect_api: str, caplog: pytest.LogCaptureFixture
):
    """sacctmgr(1), QOS: "MaxSubmitJobsPerUser: Maximum number of jobs pending or running state
    at any time per user." slurm.conf(5): with AccountingStorageEnforce `limits`, "users can be
    limited by association"; sbatch past the limit exits with `QOSMaxSubmitJobPerUserLimit`
    and "Job violates accounting/QOS policy (job submit limit, ...)". Six jobs under a QOS of
    two: run_jobs takes the refusal as pushback (not a bad `qos` field), waits, submits again
    as the first jobs end, and every job runs."""
    enforce = slurm.run(["scontrol", "show", "config"], check=False).stdout
    if "limits" not in next((x for x in enforce.splitlines() if "StorageEnforce" in x), ""):
        reason = (
            "the running local Slurm was started without AccountingStorageEnforce=limits "
            "(slurmctld reads it only at start): stop it (python -m prefect_nemo.testing.slurm "
            "stop) so that the tests start it again"
        )
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    slurm.run(f"sacctmgr -n -P show qos {QOS} format=Name | grep -q . || sacctmgr -i add qos "
              f"{QOS} MaxSubmitJobsPerUser=2")  # fmt: skip
    slurm.run(["sacctmgr", "-i", "modify", "user", slurm.user, "set", f"qos+={QOS}"])
    known = ["scontrol", "show", "assoc_mgr", "flags=qos", f"qos={QOS}"]  # slurmdbd pushed it
    assert wait_until(lambda: f"QOS={QOS}(" in slurm.run(known, check=False).stdout, 30)
    block = _slurm_block(slurm, tmp_path, qos=QOS)
    prefix = f"qos-{uuid.uuid4().hex[:6]}"

    @flow
    def limited() -> list[Any]:
        specs = [JobSpec(entrypoint="sleep 1", name=f"{prefix}-{i}") for i in range(6)]
        return run_jobs(specs, block, max_in_flight=6)

    with caplog.at_level(logging.WARNING):
        results = limited()
    assert [r.state for r in results] == [JobState.SUCCEEDED] * 6
    assert "QOSMaxSubmitJobPerUserLimit" in caplog.text and "pushed back" in caplog.text

    def accounted() -> list[str]:  # slurmctld hands job records to slurmdbd a moment later
        names = slurm.run(
            ["sacct", "-X", "-n", "-P", "-S", "now-3600", "-o", "JobName%100", "--qos", QOS],
            check=False,
        ).stdout.split()
        return sorted(n for n in names if prefix in n)

    expected = sorted(r.handle.job_id for r in results)
    wait_until(lambda: len(accounted()) >= len(expected), 60)
    assert accounted() == expected, "each job submitted once"


def _slurm_block(slurm: Any, job_dir: Path, **fields: Any) -> Any:
    from tests.test_nemo_run_slurm import slurm_block  # NeMo-Run: imported where it is installed

    return slurm_block(slurm, job_dir).model_copy(update=fields)


@pytest.mark.nemo_run
@pytest.mark.slow
def test_many_slurm_jobs_at_once_stay_within_sshd_max_sessions(
    slurm: Any, tmp_path: Path, prefect_api: str
):
    """sshd_config(5), MaxSessions: "Specifies the maximum number of open shell, login or
    subsystem (e.g. sftp) sessions permitted per network connection ... The default is 10."
    Every job of a run_jobs call shares the one SSH connection to the login node (the local
    sshd keeps the default): 24 jobs submitted at once all run, none refused a session
    (paramiko's ChannelException 'Connect failed' before the bound)."""
    block = _slurm_block(slurm, tmp_path)
    prefix = f"ms-{uuid.uuid4().hex[:6]}"

    @flow
    def many() -> list[Any]:
        specs = [JobSpec(entrypoint="true", name=f"{prefix}-{i}") for i in range(24)]
        return run_jobs(specs, block, max_in_flight=24)

    assert [r.state for r in many()] == [JobState.SUCCEEDED] * 24


@pytest.mark.nemo_run
@pytest.mark.slow
def test_sessions_sshd_refuses_are_retried_even_when_paramiko_loses_the_reason(
    slurm: Any, monkeypatch: pytest.MonkeyPatch
):
    """sshd_config(5), MaxSessions: "The default is 10." Here our bound is lifted to 24, so
    sshd refuses sessions of 24 commands run at once on one connection, again and again.
    paramiko keeps one saved exception per connection (Transport.get_exception: "The exception
    (if any) is cleared after this call"): two refusals at once leave one thread with a bare
    SSHException "Unable to open channel." instead of its ChannelException. Both mean the
    command never started, so both are retried: every command runs once."""
    from concurrent.futures import ThreadPoolExecutor

    from prefect_nemo.backends.nemo_run.slurm import ssh as ssh_module

    monkeypatch.setattr(ssh_module, "MAX_SESSIONS", 24)
    conn = ssh_module.SafeSSH(
        host=slurm.host, port=slurm.port, user=slurm.user, identity=str(slurm.identity),
        identity_key=None, known_hosts=slurm.known_hosts.read_text(), connect_timeout_s=30,
        command_timeout_s=120, field_prefix="test",
    )  # fmt: skip
    try:
        for _ in range(3):  # the race needs refusals that coincide: give it a few rounds
            with ThreadPoolExecutor(24) as pool:
                outs = list(pool.map(lambda i: conn.run(f"echo run-{i}").stdout.strip(),
                                     range(24)))  # fmt: skip
            assert outs == [f"run-{i}" for i in range(24)]
    finally:
        conn.close()
