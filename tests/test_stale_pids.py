"""A pid written to a state file names our process only while that process lives: after a
reboot, or once it is long gone, the same number names something else. Nothing we start by a
recorded pid may signal such a process (a stale Slurm state.json once SIGTERMed the Ray
dashboard agent of the test run's shared head, which took its raylet down with it)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_nemo import cli
from prefect_nemo.testing import slurm


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of someone else's that now holds the recorded pid, leading its own session
    (as a `ray start` head or a Ray agent does)."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_slurm_state_naming_another_process_is_not_our_supervisor(
    bystander: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    state = {"supervisor_pid": bystander.pid, "state_dir": str(tmp_path), "ready": True}
    assert not slurm._supervisor_alive(state)
    assert not slurm._supervisor_alive(None)
    assert not slurm._supervisor_alive({**state, "supervisor_pid": 0})


def test_a_slurm_state_names_a_supervisor_only_for_its_own_state_dir(tmp_path: Path) -> None:
    """The supervisor's command line is `slurm.py _supervise <spec>`, its spec naming its state
    dir: one for another state dir (or a prefix of it) is not the one recorded.

    The stand-in is asked only once it runs: Popen returns when the child's exec has closed its
    close-on-exec pipe, which the kernel does (begin_new_exec) before it sets up the new
    program's arguments (create_elf_tables), so for a moment /proc/<pid>/cmdline reads empty
    (seen: 2 of 1,000 spawns on a busy machine; this test failed so twice in CI-like runs)."""
    spec = json.dumps({"state_dir": str(tmp_path / "slurm")})
    # a stand-in with the supervisor's arguments that says when it runs
    script = "import sys, time; print('running', flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", script, "_supervise", spec],
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"running\n"
        assert slurm._supervisor_alive({"supervisor_pid": proc.pid,
                                        "state_dir": str(tmp_path / "slurm")})  # fmt: skip
        assert not slurm._supervisor_alive({"supervisor_pid": proc.pid,
                                            "state_dir": str(tmp_path / "slur")})  # fmt: skip
    finally:
        proc.kill()
        proc.wait()


def test_server_stop_leaves_a_process_that_took_the_recorded_pid_alone(
    bystander: subprocess.Popen[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cli.STATE_DIR.mkdir()
    cli.SERVER_FILE.write_text(json.dumps(
        {"pid": bystander.pid, "api_url": "http://127.0.0.1:4200/api",
         "ui_url": "http://127.0.0.1:4200"}
    ))  # fmt: skip
    cli.stop_prefect_server()
    assert bystander.poll() is None, "the bystander was signalled"
    assert not cli.SERVER_FILE.exists()
