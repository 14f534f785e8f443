"""The real local Slurm cluster the Slurm backend is tested against: jobs submitted through the
loopback sshd with the generated key, accounting in sacct, cancel, and afterok dependencies."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from prefect_nemo.testing.slurm import LocalSlurm

pytestmark = pytest.mark.slow


def ssh(slurm: LocalSlurm, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run a command on the cluster through its sshd, as a remote user would."""
    return subprocess.run(
        slurm.ssh_command(shlex.join(args)),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def sbatch(slurm: LocalSlurm, script: str, out: Path, *options: str) -> str:
    """Submit a batch script through ssh; its job id."""
    body = "#!/bin/bash\n" + script
    result = ssh(
        slurm,
        "sbatch",
        "--parsable",
        f"--account={slurm.account}",
        f"--partition={slurm.partition}",
        f"--output={out}",
        *options,
        stdin=body,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def pending_reason(slurm: LocalSlurm, job_id: str) -> str:
    """squeue's state and reason for a queued job, e.g. 'PENDING Dependency'."""
    return slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"]).stdout.strip()


def test_job_through_ssh_completes_with_its_output(slurm: LocalSlurm, tmp_path: Path) -> None:
    job_id = sbatch(slurm, "echo hello from $SLURM_JOB_ID on $(hostname -s)\n", tmp_path / "o")

    row = slurm.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"))

    assert (row["State"], row["ExitCode"]) == ("COMPLETED", "0:0")
    assert row["Account"] == slurm.account
    # slurmdbd fills the partition in a moment after the state
    _wait_for(lambda: slurm.job(job_id)["Partition"] == slurm.partition)
    assert (tmp_path / "o").read_text() == f"hello from {job_id} on {slurm.node}\n"


def test_a_command_over_ssh_runs_in_the_clusters_home_not_the_machine_users(
    slurm: LocalSlurm,
) -> None:
    """bash sources ~/.bashrc for a command sent over ssh (Debian's SSH_SOURCE_BASHRC): the
    session's home is the cluster's own, so what the machine's user keeps there (here: `pyenv
    init`, ~100 processes per command) is not run for every command our backend sends."""
    done = ssh(slurm, "sh", "-c", 'echo "$HOME"; test -e "$HOME/.bashrc" || echo none')
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(slurm.state_dir / "home"), "none"]


def test_failing_job_is_failed_with_its_exit_code(slurm: LocalSlurm, tmp_path: Path) -> None:
    job_id = sbatch(slurm, "echo about to fail\nexit 3\n", tmp_path / "o")

    row = slurm.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"))

    assert (row["State"], row["ExitCode"]) == ("FAILED", "3:0")
    assert (tmp_path / "o").read_text() == "about to fail\n"


def test_scancel_stops_the_running_job(slurm: LocalSlurm, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    job_id = sbatch(slurm, f"echo $$ > {pid_file}\nexec sleep 300\n", tmp_path / "o")
    slurm.wait_job(job_id, ("RUNNING",))
    _wait_for(pid_file.exists)
    pid = int(pid_file.read_text())
    assert _alive(pid)

    assert ssh(slurm, "scancel", job_id).returncode == 0

    row = slurm.wait_job(job_id, ("CANCELLED",))
    assert row["State"].startswith("CANCELLED")
    _wait_for(lambda: not _alive(pid))  # the job's process is really gone, not just marked


def test_afterok_holds_the_second_job_until_the_first_completes(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    first = sbatch(slurm, f"while [ ! -e {gate} ]; do sleep 0.2; done\n", tmp_path / "1")
    second = sbatch(slurm, "echo second ran\n", tmp_path / "2", f"--dependency=afterok:{first}")
    slurm.wait_job(first, ("RUNNING",))

    assert pending_reason(slurm, second) == "PENDING Dependency"

    gate.touch()
    assert slurm.wait_job(first, ("COMPLETED",))["State"] == "COMPLETED"
    assert slurm.wait_job(second, ("COMPLETED", "FAILED", "CANCELLED"))["State"] == "COMPLETED"
    assert (tmp_path / "2").read_text() == "second ran\n"


def test_a_job_depending_on_a_failed_one_never_runs(slurm: LocalSlurm, tmp_path: Path) -> None:
    first = sbatch(slurm, "exit 1\n", tmp_path / "1")
    second = sbatch(slurm, "echo must not run\n", tmp_path / "2", f"--dependency=afterok:{first}")
    slurm.wait_job(first, ("FAILED",))

    _wait_for(lambda: pending_reason(slurm, second) == "PENDING DependencyNeverSatisfied")

    assert ssh(slurm, "scancel", second).returncode == 0
    assert slurm.wait_job(second, ("CANCELLED",))["State"].startswith("CANCELLED")
    assert not (tmp_path / "2").exists()


def test_an_unknown_account_is_refused_at_submit(slurm: LocalSlurm) -> None:
    result = ssh(slurm, "sbatch", "--account=no-such-account", "--wrap=true")

    assert result.returncode != 0
    assert "Invalid account" in result.stderr


def test_a_second_start_attaches_and_its_stop_leaves_the_cluster_running(
    slurm: LocalSlurm,
) -> None:
    with LocalSlurm(state_dir=slurm.state_dir) as again:
        assert not again.owned
        assert again.port == slurm.port

    assert slurm.run(["scontrol", "ping"], check=False).returncode == 0
    assert ssh(slurm, "true").returncode == 0


@pytest.mark.nemo_run
def test_nemo_run_ssh_tunnel_connects_with_the_key_and_no_prompt(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    from prefect_nemo.backends.nemo_run.isolation import nemo_run

    run = nemo_run()  # the one way in: NEMORUN_HOME is set before NeMo-Run reads it
    from nemo_run.core.tunnel.rsync import rsync

    job_dir = tmp_path / "jobs"
    tunnel = run.SSHTunnel(
        host=slurm.host,
        port=slurm.port,
        user=slurm.user,
        identity=str(slurm.identity),
        job_dir=str(job_dir),
    )

    def no_prompt(*args: object) -> str:
        raise AssertionError("NeMo-Run asked for a password")

    tunnel.auth_handler = no_prompt
    tunnel.fallback_auth_handler = no_prompt
    try:
        tunnel.setup()  # connects, then mkdir -p job_dir over ssh
        assert tunnel.session is not None and tunnel.session.is_connected
        assert job_dir.is_dir()
        assert slurm.partition in tunnel.run("sinfo -h -o %P").stdout
        # NeMo-Run's rsync shells out to ssh, which checks the host key in ~/.ssh/known_hosts
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "train.py").write_text("print('hi')\n")
        rsync(tunnel.session, str(tmp_path / "src") + "/", str(job_dir / "code"))
        assert (job_dir / "code" / "train.py").read_text() == "print('hi')\n"
    finally:
        tunnel.cleanup()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(0.2)
