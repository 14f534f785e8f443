"""The NeMo-Run backend base on NeMo-Run's real LocalExecutor (real local processes): the
Backend protocol, submit-or-attach, Prefect-level dependencies, and the side-effect guards."""

from __future__ import annotations

import logging
import os
import time
import uuid

import pytest
from prefect import flow
from pydantic import SecretStr

from prefect_nemo import DependencyFailed, InvalidJobSpec, JobFailed, JobSpec, JobState, run_job
from prefect_nemo.backends.nemo_run.isolation import home_texts, nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.local import NemoRunLocalBackend
from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.lifecycle import stop_and_confirm, submit_or_attach
from prefect_nemo.placement import PlacementSpec

pytestmark = pytest.mark.nemo_run

CANARY = "canary-local-8c1f0e"


class NemoRunLocal(ClusterBlock):
    """Test block: jobs as local processes through NeMo-Run's LocalExecutor."""

    _block_type_slug = "test-nemo-run-local"

    def backend(self) -> NemoRunLocalBackend:
        """The local backend."""
        return NemoRunLocalBackend()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def wait_terminal(backend: NemoRunLocalBackend, job_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.find(job_id)
        if status is not None and status.state.is_terminal():
            return status
        time.sleep(0.2)
    raise AssertionError(f"{job_id} did not end: {backend.find(job_id)}")


def test_protocol_success_failure_logs_and_secret_env():
    backend = NemoRunLocalBackend()
    spec = JobSpec(
        entrypoint='echo "greeting=$GREETING"; echo "len=${#TOKEN}"',
        env={"GREETING": "hello world", "TOKEN": SecretStr(CANARY)},
    )
    job_id = unique("ok")
    handle = backend.submit(spec, job_id, {"prefect_nemo.key": "x"})
    assert handle.job_id == job_id and handle.backend == "nemo-run-local"
    status = wait_terminal(backend, job_id)
    assert status.state is JobState.SUCCEEDED
    assert backend.find(job_id).metadata["prefect_nemo.key"] == "x"
    log = backend.logs(job_id)
    assert "greeting=hello world" in log and f"len={len(CANARY)}" in log
    for path, text in home_texts().items():
        assert CANARY not in text, f"secret written to {path}"

    failing = unique("bad")
    backend.submit(JobSpec(entrypoint="echo boom; exit 4"), failing, {})
    assert wait_terminal(backend, failing).state is JobState.FAILED
    assert "boom" in backend.logs(failing)


def test_stop_is_confirmed_and_resubmit_attaches():
    backend = NemoRunLocalBackend()
    spec = JobSpec(entrypoint="sleep 120", name="sleeper")
    scope = f"experiment:{unique('exp')}"
    first = submit_or_attach(backend, spec, scope=scope, key="sleeper")
    second = submit_or_attach(backend, spec, scope=scope, key="sleeper")
    assert not first.attached and second.attached
    assert first.handle.job_id == second.handle.job_id
    status = stop_and_confirm(backend, first.handle.job_id, timeout_s=30)
    assert status is not None and status.state is JobState.STOPPED
    # a stopped attempt is over: the next one gets the next id
    third = submit_or_attach(backend, spec, scope=scope, key="sleeper")
    assert not third.attached and third.handle.job_id == f"{first.handle.job_id}-r1"
    stop_and_confirm(backend, third.handle.job_id, timeout_s=30)


def test_bad_input_names_the_field():
    backend = NemoRunLocalBackend()
    for spec, field in [
        (
            JobSpec(entrypoint="true", placement=PlacementSpec(nodes=2, strategy="spread")),
            "placement.nodes",
        ),
        (JobSpec(entrypoint="true", runtime_env={"pip": ["x"]}), "runtime_env"),
        (JobSpec(entrypoint="true", label_selector={"a": "b"}), "label_selector"),
    ]:
        with pytest.raises(InvalidJobSpec, match=field.replace(".", r"\.")):
            backend.validate(spec)


def test_nemo_run_home_is_isolated_and_the_root_logger_kept():
    from prefect_nemo.nemo_run_home import nemorun_home

    nr = nemo_run()
    assert os.path.abspath(nr.config.get_nemorun_home()) == str(nemorun_home())
    assert os.environ["NEMORUN_HOME"] == str(nemorun_home())
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    from nemo_run.core.frontend.console.api import configure_logging

    with root_logger_kept():
        configure_logging(level="DEBUG")  # what Experiment / RayCluster / RayJob do
        assert (list(root.handlers), root.level) != before
    assert (list(root.handlers), root.level) == before
    NemoRunLocalBackend().submit(JobSpec(entrypoint="true"), unique("quiet"), {})
    assert (list(root.handlers), root.level) == before


@pytest.mark.slow
def test_run_job_and_prefect_level_dependencies(prefect_api, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    block = NemoRunLocal(max_poll_interval_s=0.5)
    marker = tmp_path / "order.txt"

    @flow
    def ordered():
        from prefect_nemo import submit_job

        up = submit_job(JobSpec(entrypoint=f"sleep 2; echo up >> {marker}", name="up"), block)
        # the local executor has no native dependencies: run_job waits for `up` itself
        down = run_job(JobSpec(entrypoint=f"echo down >> {marker}", name="down"), block, after=[up])
        return down

    assert ordered().succeeded
    assert marker.read_text().split() == ["up", "down"]
    assert "waiting for upstream job" in caplog.text

    @flow
    def broken():
        from prefect_nemo import submit_job, wait_for_job

        up = submit_job(JobSpec(entrypoint="exit 1", name="up"), block)
        try:
            wait_for_job(up, block)
        except JobFailed as exc:
            result = exc.result
        return run_job(JobSpec(entrypoint=f"touch {tmp_path}/ran", name="down"), block,
                       after=[result])  # fmt: skip

    with pytest.raises(DependencyFailed, match=r"ended FAILED.*not submitted"):
        broken()
    assert not (tmp_path / "ran").exists()


def test_the_docs_nemo_run_example_keeps_nemo_runs_files_where_documented(tmp_path):
    """The docs say NeMo-Run's home is ./.prefect-nemo/nemo-run (docs/guides/nemo-run.md);
    NeMo-Run reads its home (NEMORUN_HOME) once, when it is first imported. The imports of the
    NeMo-Run tasks guide's example (docs/guides/nemo-run-tasks.md), run as they stand in a fresh
    interpreter, must leave it there, not in ~/.nemo_run: `import prefect_nemo` claims the home,
    and the example imports it first."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs" / "guides"
    assert "`./.prefect-nemo/nemo-run`" in (docs / "nemo-run.md").read_text()
    section = (docs / "nemo-run-tasks.md").read_text()
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    imports = [line for line in example.splitlines()
               if re.match(r"(import|from) ", line) and "my_project" not in line]  # fmt: skip
    assert any("nemo_run" in line for line in imports), "the example no longer imports nemo_run"
    code = "\n".join([*imports, "print(run.config.get_nemorun_home())"])
    env = {k: v for k, v in os.environ.items()
           if k not in ("NEMORUN_HOME", "PREFECT_NEMO_NEMORUN_HOME")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    home = out.stdout.strip().splitlines()[-1]
    assert Path(home) == tmp_path / ".prefect-nemo" / "nemo-run", f"NeMo-Run's home is {home}"
