"""NeMo-Run's Slurm executor against a real Slurm (slurmctld, slurmd, slurmdbd, munge) through
NeMo-Run's SSH tunnel to a real sshd: success, failure, cancel, afterok, re-run, secrets."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from pydantic import SecretStr

from prefect_nemo import (
    AuthenticationFailed,
    DependencyFailed,
    InvalidJobSpec,
    JobAlreadyExists,
    JobFailed,
    JobSpec,
    JobState,
    JobTimedOut,
    run_job,
    start_experiment,
    stop_job,
    submit_job,
    wait_for_job,
)
from prefect_nemo.backends.nemo_run import slurm as slurm_backend
from prefect_nemo.backends.nemo_run.slurm import ssh
from prefect_nemo.blocks.slurm import SlurmCluster
from prefect_nemo.placement import PlacementSpec
from tests.test_secrets import _events_of_flow_run, _logs_of_flow_run

pytestmark = [pytest.mark.nemo_run, pytest.mark.slow]

ENV_CANARY = "canary-slurm-env-5be1c9"
QUICK = ["-o", "/dev/null", "--wrap", "true"]  # a job sbatch'ed by hand (as a crashed run left it)
ALL_STATES = "BF,CA,CD,DL,F,NF,OOM,PD,PR,R,RQ,RS,RV,S,TO"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The block's remote job dir: the sshd runs here, so it is also a local path to scan."""
    return tmp_path_factory.mktemp("slurm-jobs")


def slurm_block(slurm, job_root: Path) -> SlurmCluster:
    """A SlurmCluster block holding the key itself (secret) and the sshd's known_hosts."""
    return SlurmCluster(
        host=slurm.host,
        port=slurm.port,
        user=slurm.user,
        identity_key=SecretStr(slurm.identity.read_text()),
        known_hosts=slurm.known_hosts.read_text(),
        job_dir=str(job_root),
        account=slurm.account,
        partition=slurm.partition,
        time="00:05:00",
        max_poll_interval_s=0.5,
        stop_timeout_s=30,
        # jobs run on this machine: give them this environment's python (numpy for the demo)
        setup_lines=f"export PATH={Path(sys.executable).parent}:$PATH",
    )


@pytest.fixture
def block(slurm, job_root: Path, prefect_api: str) -> SlurmCluster:
    return slurm_block(slurm, job_root)


def sacct_by_name(slurm, name: str) -> list[dict[str, str]]:
    """Every sacct allocation row of jobs named `name` (all time)."""
    fields = ("JobID", "JobName", "State", "ExitCode", "Start", "End", "Reason")
    # every state (with -S alone sacct lists only jobs that ran; -s needs -E)
    window = ["-S", "2020-01-01", "-E", "now", "-s", ALL_STATES]
    out = slurm.run(
        ["sacct", "-X", "-n", "-P", *window, "--name", name, "-o", ",".join(fields)], check=False
    )
    return [dict(zip(fields, line.split("|"), strict=False)) for line in out.stdout.splitlines()]


def sacct_job_names(slurm) -> list[str]:
    """The job name of every sacct allocation row (all time, every state)."""
    window = ["-S", "2020-01-01", "-E", "now", "-s", ALL_STATES]
    out = slurm.run(["sacct", "-X", "-n", "-P", *window, "-o", "JobName%200"], check=False)
    return out.stdout.split()


def wait_rows(slurm, name: str, state: str, timeout_s: float = 30) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        rows = sacct_by_name(slurm, name)
        if rows and all(r["State"].startswith(state) for r in rows):
            return rows
        time.sleep(0.3)
    # what squeue says of every job (reason, node) tells a full partition from a slow scheduler
    queue = slurm.run(["squeue", "-a", "-o", "%i %j %P %T %r %N"], check=False).stdout
    raise AssertionError(f"{name} not {state} in sacct: {rows}\nsqueue:\n{queue}")


def test_success_streams_logs_and_honours_cpu_only(block, slurm, job_root, caplog):
    caplog.set_level(logging.INFO)
    name = unique("ok")

    @flow
    def pipeline():
        spec = JobSpec(
            entrypoint="echo hello from $(hostname) $GREETING; "
            "echo gpus=${SLURM_GPUS_PER_NODE:-none}",
            name=name,
            env={"GREETING": "it's a 'quoted' value"},
            placement=PlacementSpec(nodes=1, gpus_per_node=0, cpus_per_node=1),
        )
        return run_job(spec, cluster=block)

    started = time.monotonic()
    result = pipeline()
    took = time.monotonic() - started
    assert result.state is JobState.SUCCEEDED and result.exit_code == 0
    assert result.start_time and result.end_time
    assert "hello from" in caplog.text and "it's a 'quoted' value" in caplog.text
    assert "gpus=none" in caplog.text
    job_id = result.handle.job_id
    rows = wait_rows(slurm, job_id, "COMPLETED")
    assert len(rows) == 1
    script = next(job_root.rglob(f"{job_id}_sbatch.sh")).read_text()
    assert "--gpus-per-node" not in script, "gpus_per_node=0 must ask for no GPUs"
    assert f"--job-name={job_id}" in script
    print(f"run_job through the tunnel, submit to end: {took:.1f}s")


def test_a_job_streamed_before_srun_starts_still_streams_its_own_output(
    block, slurm, caplog
):
    """The batch script logs its setup to the batch log; the job's own output goes to the srun
    log, which srun makes only once it starts. A stream that began in the batch log (here its
    setup lines sleep 4 s) and then counted its offset into the srun log read nothing of a
    short srun log, and the end's full read (the srun log, shorter than what was streamed)
    added nothing: CI's preempted job lost "run 0" and "run 1" so."""
    caplog.set_level(logging.INFO)
    slow_setup = block.model_copy(update={"setup_lines": block.setup_lines + "\nsleep 4"})
    name = unique("late")

    @flow
    def pipeline():
        return run_job(JobSpec(entrypoint="echo own-output-line", name=name), cluster=slow_setup)

    result = pipeline()
    assert result.state is JobState.SUCCEEDED
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.endswith("] own-output-line") for line in lines), lines[-20:]
    assert not any("+ sleep 4" in line for line in lines), "the batch log is not the job's log"


def test_failure_raises_with_the_log_tail(block, slurm):
    name = unique("bad")

    @flow
    def pipeline():
        return run_job(
            JobSpec(entrypoint="echo about to fail; echo detail >&2; exit 7", name=name),
            cluster=block,
        )

    with pytest.raises(JobFailed) as info:
        pipeline()
    result = info.value.result
    assert result.state is JobState.FAILED and result.exit_code == 7
    assert "about to fail" in str(info.value) and "about to fail" in result.log_tail
    assert wait_rows(slurm, result.handle.job_id, "FAILED")[0]["ExitCode"] == "7:0"


def test_cancel_is_confirmed_in_sacct(block, slurm):
    name = unique("long")

    @flow
    def pipeline():
        handle = submit_job(JobSpec(entrypoint="sleep 300", name=name), cluster=block)
        deadline = time.monotonic() + 30
        while block.backend().find(handle.job_id).state is not JobState.RUNNING:
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.3)
        return stop_job(handle, cluster=block)

    started = time.monotonic()
    result = pipeline()
    assert result.state is JobState.STOPPED
    rows = wait_rows(slurm, result.handle.job_id, "CANCELLED")
    assert len(rows) == 1
    print(f"submit, start, scancel, confirmed: {time.monotonic() - started:.1f}s")


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A file the test creates to let a job finish, and the shell that waits for it (the sshd
    runs on this machine, so the job sees the test's files); created at teardown anyway, so a
    failed test leaves no job waiting."""
    go = tmp_path / f"go-{uuid.uuid4().hex[:6]}"
    yield go, f"while [ ! -e {go} ]; do sleep 0.2; done"
    go.touch()


def release_once_named(slurm, job_root: Path, upstream: str, go: Path) -> None:
    """Touch `go` (letting the gated upstream job end) once a downstream's sbatch script, written
    before its sbatch, names the upstream in `--dependency=afterok`: the downstream was then
    submitted while the upstream had not ended, however slow the machine."""
    # the upstream waits on the gate, so squeue has it
    slurm_id = slurm.run(["squeue", "-h", "-n", upstream, "-o", "%i"]).stdout.strip()
    assert slurm_id.isdigit(), slurm_id

    def release() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
            f"--dependency=afterok:{slurm_id}" in path.read_text()
            for path in job_root.rglob("*_sbatch.sh")
        ):
            time.sleep(0.2)
        go.touch()

    threading.Thread(target=release, daemon=True).start()


def test_afterok_downstream_waits_then_runs(block, slurm, job_root, gate):
    up_name, down_name = unique("up"), unique("down")
    go, wait_go = gate

    @flow
    def pipeline():
        up = submit_job(JobSpec(entrypoint=f"{wait_go}; echo up done", name=up_name), cluster=block)
        started = time.monotonic()
        down = submit_job(
            JobSpec(entrypoint="echo down ran", name=down_name), cluster=block, after=[up]
        )
        submit_s = time.monotonic() - started
        # queued at once, held by Slurm (not by Prefect) until the upstream succeeds
        pending = block.backend().find(down.job_id)
        go.touch()
        results = [wait_for_job(h, cluster=block) for h in (up, down)]
        return pending, results, submit_s

    pending, (up, down), submit_s = pipeline()
    # job_reason_codes: "Dependency — This job has a dependency on another job that has not
    # been satisfied": it waits in Slurm's queue (QUEUED), not for resources
    assert pending.state is JobState.QUEUED and pending.queue.reason == "Dependency", pending
    assert up.succeeded and down.succeeded
    assert down.start_time >= up.end_time
    script = next(job_root.rglob(f"{down.handle.job_id}_sbatch.sh")).read_text()
    up_sid = wait_rows(slurm, up.handle.job_id, "COMPLETED")[0]["JobID"]
    assert f"--dependency=afterok:{up_sid}" in script
    print(f"submit_job with an afterok dependency through the tunnel: {submit_s:.2f}s")


def test_afterok_failed_upstream_cancels_downstream_and_says_why(block, slurm, job_root, gate):
    up_name, down_name = unique("upfail"), unique("never")
    go, wait_go = gate

    @flow
    def waits(up, down):
        with pytest.raises(JobFailed):
            wait_for_job(up, cluster=block)
        with pytest.raises(JobFailed) as info:
            wait_for_job(down, cluster=block)
        return str(info.value)

    @flow
    def submits():
        up = submit_job(JobSpec(entrypoint=f"{wait_go}; exit 1", name=up_name), cluster=block)
        release_once_named(slurm, job_root, up.job_id, go)
        down = submit_job(
            JobSpec(
                entrypoint="echo must not run",
                name=down_name,
                env={"TOKEN": SecretStr(ENV_CANARY)},
            ),
            cluster=block,
            after=[up],
        )
        return up, down

    up, down = submits()
    message = waits(up, down)
    assert "never ran" in message and "afterok" in message, message
    rows = wait_rows(slurm, down.job_id, "CANCELLED")
    assert rows[0]["Start"] in ("Unknown", "None", "") or rows[0]["Start"] == rows[0]["End"]
    downstream_dir = next(job_root.rglob(f"prefect-nemo_{down.job_id}"))
    assert not list(downstream_dir.rglob("log-*.out")), "the downstream job never ran"
    assert not (downstream_dir / ".secret-env").exists(), "its secret file is removed"

    # once the upstream is known to have failed, nothing more is even submitted
    @flow
    def too_late():
        return submit_job(
            JobSpec(entrypoint="true", name=unique("late")), cluster=block, after=[up]
        )

    with pytest.raises(DependencyFailed, match=r"ended FAILED.*nothing was submitted"):
        too_late()


def test_timeout_stops_the_job(block, slurm):
    name = unique("slow")

    @flow
    def pipeline():
        return run_job(JobSpec(entrypoint="sleep 120", name=name, timeout_s=3), cluster=block)

    with pytest.raises(JobTimedOut) as info:
        pipeline()
    assert info.value.result.state is JobState.STOPPED
    assert len(wait_rows(slurm, info.value.result.handle.job_id, "CANCELLED")) == 1


def test_rerun_attaches_instead_of_submitting_again(block, slurm):
    experiment = unique("exp")

    @flow
    def pipeline():
        start_experiment(experiment)
        return run_job(JobSpec(entrypoint="echo once", name="only"), cluster=block)

    first = pipeline()
    slurm_backend._slurm_ids.clear()  # as a new process would: found again through the cluster
    second = pipeline()
    assert not first.attached and second.attached
    assert first.handle.job_id == second.handle.job_id
    assert len(wait_rows(slurm, first.handle.job_id, "COMPLETED")) == 1


def test_bad_input_fails_before_anything_is_submitted(block, slurm, job_root):
    before = sorted(p.name for p in job_root.rglob("*"))
    for spec, field in [
        (JobSpec(entrypoint="true", resources={"custom": {"TPU": 1}}), "resources.custom"),
        (JobSpec(entrypoint="true", resources={"gpus": 0.5}), "resources.gpus"),
        (JobSpec(entrypoint="true", runtime_env={"pip": ["x"]}), "runtime_env"),
        (
            JobSpec(entrypoint="true", placement=PlacementSpec(node_labels={"zone": "!a"})),
            "placement",
        ),
        # block time 00:05:00 is sbatch --time: Slurm would kill the job at 5 min
        (JobSpec(entrypoint="true", timeout_s=3600), "timeout_s=3600 exceeds SlurmCluster"),
    ]:

        @flow
        def pipeline(spec=spec):
            return run_job(spec, cluster=block)

        with pytest.raises(InvalidJobSpec, match=field.replace(".", r"\.")):
            pipeline()
    assert sorted(p.name for p in job_root.rglob("*")) == before


def test_sbatch_refusal_names_the_block_field(block, slurm, job_root):
    for update, field in [
        ({"account": "no-such-account"}, "SlurmCluster.account"),
        ({"partition": "no-such-partition"}, "SlurmCluster.partition"),
    ]:
        wrong = block.model_copy(update=update)
        name = unique("refused")

        @flow
        def pipeline(wrong=wrong, name=name):
            return run_job(JobSpec(entrypoint="true", name=name), cluster=wrong)

        with pytest.raises(InvalidJobSpec, match=rf"sbatch refused the job.*{field}"):
            pipeline()
        assert not list(job_root.rglob(f"prefect-nemo_*{name}*")), "the claim is released"
        # the Slurm job name is the job id, which contains the spec name
        assert not [n for n in sacct_job_names(slurm) if name in n], "nothing was submitted"


def test_missing_or_rejected_key_is_a_clear_error(block, slurm, tmp_path):
    missing = block.model_copy(update={"identity_key": None, "identity": str(tmp_path / "nope")})
    with pytest.raises(AuthenticationFailed, match=r"SlurmCluster\.identity=.*cannot be read"):
        missing.backend().check_access()

    other = tmp_path / "other_key"
    slurm.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)])
    rejected = block.model_copy(update={"identity_key": SecretStr(other.read_text())})
    with pytest.raises(AuthenticationFailed, match=r"rejected the SSH key.*identity_key"):
        rejected.backend().check_access()

    not_a_key = block.model_copy(update={"identity_key": None, "identity": str(other) + ".pub"})
    with pytest.raises(AuthenticationFailed, match="not a private key"):
        not_a_key.backend().check_access()

    wrong_host = block.model_copy(
        update={"known_hosts": f"[{slurm.host}]:{slurm.port} " + _some_other_host_key(tmp_path)}
    )
    with pytest.raises(AuthenticationFailed, match="known_hosts"):
        wrong_host.backend().check_access()


def _some_other_host_key(tmp_path: Path) -> str:
    import subprocess

    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kind, data = (tmp_path / "host_key.pub").read_text().split()[:2]
    return f"{kind} {data}"


def test_secrets_appear_nowhere(block, slurm, job_root, prefect_api, caplog, capfd):
    from prefect_nemo.backends.nemo_run.isolation import home_texts

    caplog.set_level(logging.DEBUG)
    since = datetime.now(UTC).isoformat()
    key_text = block.identity_key.get_secret_value()
    key_lines = [ln for ln in key_text.splitlines() if len(ln) > 20 and "PRIVATE" not in ln]

    @flow
    def leaky():
        run_job(
            JobSpec(
                entrypoint="echo token=$TOKEN; echo len=${#TOKEN}; exit 3",
                name="leaky",
                env={"TOKEN": SecretStr(ENV_CANARY), "PLAIN": "visible"},
            ),
            cluster=block,
        )

    state = leaky(return_state=True)
    with pytest.raises(JobFailed) as info:
        state.result()
    error = info.value
    assert "token=**********" in str(error) and f"len={len(ENV_CANARY)}" in str(error)
    flow_run_id = state.state_details.flow_run_id
    job_id = error.result.handle.job_id
    haystacks = {
        "exception": str(error) + repr(error.result) + "".join(traceback.format_exception(error)),
        "caplog": caplog.text,
        "stdout/stderr": "".join(capfd.readouterr()),
        "block": repr(block) + str(block) + block.model_dump_json(),
    }
    with get_client(sync_client=True) as client:
        haystacks["prefect logs"] = _logs_of_flow_run(client, flow_run_id, until=job_id)
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        haystacks["artifacts"] = json.dumps([a.model_dump(mode="json") for a in artifacts])
        haystacks["flow run"] = client.read_flow_run(flow_run_id).model_dump_json()
    haystacks["events"] = _events_of_flow_run(prefect_api, since, flow_run_id)
    for path, text in home_texts().items():
        haystacks[f"NEMORUN_HOME {path}"] = text
    job_output = [p for p in job_root.rglob(f"log-{job_id}_*.out")]
    assert ENV_CANARY in job_output[0].read_text(), "the job got the secret (and printed it)"
    for path in job_root.rglob("*"):
        if path.is_file() and path not in job_output:  # all but what the job itself printed
            haystacks[f"job dir {path}"] = path.read_text(errors="ignore")
    assert any("sbatch.sh" in where for where in haystacks), "the scan saw the job dir"
    assert "prefect-nemo.job.failed" in haystacks["events"]
    for where, text in haystacks.items():
        for canary in (ENV_CANARY, key_text.strip(), *key_lines):
            assert canary not in text, f"a secret leaked into {where}"


def test_cross_experiment_dependency_goes_to_slurm_as_afterok(block, slurm, job_root, gate):
    prep_name, sft_name = unique("prep"), unique("sft")
    go, wait_go = gate

    @flow
    def prep():
        start_experiment(prep_name)
        spec = JobSpec(entrypoint=f"{wait_go}; echo prepared", name="prep")
        return submit_job(spec, cluster=block)

    @flow
    def sft():
        experiment = start_experiment(sft_name, depends_on=[prep_name], poll_s=0.5)
        release_once_named(slurm, job_root, prep_handle.job_id, go)
        return run_job(
            JobSpec(entrypoint="echo trained", name="sft"), cluster=block, after=[experiment]
        )

    prep_handle = prep()  # returns as soon as the prep job is queued

    result = sft()
    prep_row = wait_rows(slurm, prep_handle.job_id, "COMPLETED")[0]
    sft_row = wait_rows(slurm, result.handle.job_id, "COMPLETED")[0]
    assert result.succeeded
    assert sft_row["Start"] >= prep_row["End"], (prep_row, sft_row)
    script = next(job_root.rglob(f"{result.handle.job_id}_sbatch.sh")).read_text()
    assert f"--dependency=afterok:{prep_row['JobID']}" in script


def test_slurm_pipeline_prep_then_sft_with_native_dependency(block, slurm, job_root, tmp_path):
    from flows.slurm_pipeline import slurm_pipeline

    # Jobs are submitted held (sbatch --hold) and released by the test once both are queued:
    # SFT is then queued while prep has not run, so only Slurm (afterok) can order them.
    # the flow's SFT has timeout_s=4h: the block's sbatch --time must allow it
    held = block.model_copy(update={"additional_parameters": {"hold": True}, "time": "05:00:00"})
    block_name, name = unique("hpc"), unique("nemo")
    held.save(block_name)
    outputs: dict = {}

    def run() -> None:
        try:
            outputs.update(
                slurm_pipeline(
                    cluster=f"slurm-cluster/{block_name}", run_dir=str(tmp_path / "run"), name=name
                )
            )
        except BaseException as exc:  # shown by the assertions below
            outputs["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    queued: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 180
        while len(queued) < 2:
            assert thread.is_alive(), f"the pipeline ended early: {outputs}"
            assert time.monotonic() < deadline, f"prep and SFT were not both queued: {queued}"
            for line in slurm.run(["squeue", "-h", "-o", "%i|%j"]).stdout.splitlines():
                sid, _, job = line.partition("|")
                for step in ("prep", "sft"):
                    if job.startswith(f"{name}-{step}"):
                        queued[step] = sid
            time.sleep(0.3)
    finally:
        slurm.run(["scontrol", "release", *queued.values()], check=False)
        thread.join(300)
    assert outputs and "error" not in outputs, outputs
    assert outputs["sft"]["examples"] > 100 and outputs["sft"]["accuracy"] == 1.0
    assert outputs["sft"]["gpus"] == "0", "CPU-only: no GPUs asked for"
    prep = wait_rows(slurm, outputs["prep"]["job_id"], "COMPLETED")[0]
    sft = wait_rows(slurm, outputs["sft"]["job_id"], "COMPLETED")[0]
    assert sft["Start"] >= prep["End"] and prep["JobID"] == queued["prep"]
    script = next(job_root.rglob(f"{outputs['sft']['job_id']}_sbatch.sh")).read_text()
    assert f"--dependency=afterok:{prep['JobID']}" in script


def test_slurm_time_formats():
    seconds = slurm_backend._slurm_seconds
    for text, want in [
        ("30", 1800),
        ("30:15", 1815),
        ("01:00:00", 3600),
        ("2-03", (2 * 24 + 3) * 3600),
        ("2-03:04", (2 * 24 + 3) * 3600 + 4 * 60),
        ("1-00:00:01", 86401),
        ("UNLIMITED", None),
    ]:
        assert seconds(text, "SlurmCluster.time") == want, text
    with pytest.raises(InvalidJobSpec, match=r"SlurmCluster\.time='1:2:3:4' is not a Slurm time"):
        seconds("1:2:3:4", "SlurmCluster.time")


def test_native_dependency_needs_the_same_job_dir(block):
    handle = block.backend().handle("up-1")
    assert block.backend().depends_natively_on(handle)
    other = block.model_copy(update={"job_dir": block.job_dir + "-other"}).backend()
    assert not other.depends_natively_on(handle), "its id is looked up in the other job dir"


def test_job_that_left_squeue_without_id_file_is_found_in_sacct(block, slurm, job_root):
    """A submitter that died after sbatch, before writing slurm_job_id: once the job has left
    squeue, a re-run still finds it (sacct by name) and does not take the claim over."""
    backend = block.backend()
    job_id = unique("orphan")
    backend.claim(job_id, {"k": "v"})
    sid = slurm.run(
        ["sbatch", "--parsable", "-A", slurm.account, "-p", slurm.partition, "-J", job_id, *QUICK]
    ).stdout.strip()
    wait_rows(slurm, job_id, "COMPLETED")
    status = backend.find(job_id)
    assert status is not None and status.state is JobState.SUCCEEDED
    assert status.metadata.get("k") == "v"
    claim = Path(backend.remote_dir(job_id))
    assert not (claim / "slurm_job_id").exists()
    old = time.time() - slurm_backend.STALE_CLAIM_S - 60  # the claim looks abandoned
    os.utime(claim, (old, old))
    with pytest.raises(JobAlreadyExists):
        backend.claim(job_id, {"k": "other"})
    assert (claim / "slurm_job_id").read_text() == sid, "the job's id is kept"
    assert json.loads((claim / "meta.json").read_text()) == {"k": "v"}


def test_a_job_is_submitted_in_one_ssh_command(block, slurm, job_root, monkeypatch):
    """Claim, the job's files (its secret env file 0600 among them), NeMo-Run's sbatch and
    Slurm's id: one SSH session per job, as a bare sbatch needs (issue 30); a second submit
    of the id is refused in one more and changes nothing."""
    import paramiko

    backend = block.backend()
    backend.check_access()
    opened: list[str] = []
    real = paramiko.Transport.open_session

    def counted(self, *args, **kwargs):
        opened.append("session")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(paramiko.Transport, "open_session", counted)
    job_id = unique("one-trip")
    spec = JobSpec(entrypoint="true", name=job_id, env={"TOKEN": SecretStr(ENV_CANARY)})
    backend.submit(spec, job_id, {"k": "v"})
    assert len(opened) == 1, "claim, files, sbatch and record in one command"
    claim = Path(backend.remote_dir(job_id))
    sid = (claim / "slurm_job_id").read_text()
    assert sid.isdigit() and json.loads((claim / "meta.json").read_text())["k"] == "v"
    assert (claim / f"{job_id}_sbatch.sh").exists()
    assert not (claim / ".upload.tgz").exists()
    with pytest.raises(JobAlreadyExists):
        backend.submit(spec, job_id, {"k": "other"})
    assert len(opened) == 2
    assert (claim / "slurm_job_id").read_text() == sid, "the job's id is kept"
    assert json.loads((claim / "meta.json").read_text())["k"] == "v"
    rows = wait_rows(slurm, job_id, "COMPLETED")
    assert [r["JobID"] for r in rows] == [sid], "sbatch'ed once"
    assert not (claim / ".secret-env").exists(), "the job sourced and deleted it"


def test_release_cancels_a_job_sbatch_already_took(block, slurm, job_root):
    """An interrupt after sbatch accepted the job: release cancels it before removing its dir."""
    backend = block.backend()
    job_id = unique("interrupted")
    backend.claim(job_id, {})
    slurm.run(
        ["sbatch", "--hold", "-A", slurm.account, "-p", slurm.partition, "-J", job_id, *QUICK]
    )
    backend.release(job_id)
    assert not Path(backend.remote_dir(job_id)).exists()
    assert [r["State"].split()[0] for r in wait_rows(slurm, job_id, "CANCELLED")] == ["CANCELLED"]


def test_close_keeps_the_shared_connection_which_closes_at_exit(block):
    """A backend's close() leaves the SSH connection the block's other backends share on
    purpose; the pool's close (registered for interpreter exit) ends it and paramiko's
    transport thread, and a later call reconnects."""
    first, second = block.backend(), block.backend()
    first.check_access()
    transport = first._ssh.session().client.get_transport()
    first.close()
    first.close()
    second.check_access()
    assert transport.is_alive(), "closing one backend keeps the shared connection"
    ssh.close_all()
    transport.join(5)
    assert not transport.is_alive()
    second.check_access()


def test_a_job_printing_10000_lines_and_exiting_at_once_loses_none(
    block, prefect_api, caplog, tmp_path, monkeypatch
):
    """Issue 29: "A job that prints 10,000 lines and exits at once: all 10,000 reach the task log
    and the saved file", on Slurm (tests/test_saved_logs.py has it on Ray Jobs). The job's
    output is buffered: it all lands in the srun log at exit, after the last poll that saw it
    RUNNING."""
    import re
    import stat

    from prefect_nemo.log_files import LOGS_DIR_ENV
    from prefect_nemo.tasks.reporting import job_rows
    from tests.conftest import job_events

    lines = 10_000
    monkeypatch.setenv(LOGS_DIR_ENV, str(tmp_path / "logs"))
    caplog.set_level(logging.INFO)
    spec = JobSpec(
        entrypoint=f"python -c \"[print(f'line {{n:05d}}') for n in range({lines})]\"",
        name=unique("ten-thousand"),
    )

    @flow
    def printing_flow():
        return run_job(spec, cluster=block)

    started = time.monotonic()
    state = printing_flow(return_state=True)
    result = state.result()
    took = time.monotonic() - started
    assert result.state is JobState.SUCCEEDED
    job_id, flow_run_id = result.handle.job_id, str(state.state_details.flow_run_id)
    expected = [f"line {n:05d}" for n in range(lines)]

    path = tmp_path / "logs" / flow_run_id / f"{job_id}.log"
    saved = [s for s in path.read_text().splitlines() if re.fullmatch(r"line \d{5}", s)]
    assert saved == expected, f"{len(saved)} of {lines} lines saved"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    in_task_log = [
        m.removeprefix(f"[{job_id}] ")
        for r in caplog.records
        if (m := r.getMessage()).startswith(f"[{job_id}] line ")
    ]
    assert in_task_log == expected, f"{len(in_task_log)} of {lines} lines in the task log"
    (row,) = [r for r in job_rows(flow_run_id) if r["job_id"] == job_id]
    assert row["log"] == str(path)
    events = job_events(prefect_api, result.handle.resource_id, "prefect-nemo.job.succeeded")
    (ended,) = [e for e in events if e["event"] == "prefect-nemo.job.succeeded"]
    assert ended["payload"]["log"] == str(path)
    print(f"slurm saved_log_lines={len(saved)} task_log_lines={len(in_task_log)} took_s={took:.1f}")
