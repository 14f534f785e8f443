"""Reliability scenarios against the real engines (issue 17): a restartable Prefect server
(`PrefectServer`), a real local Ray head with token auth, plain flow scripts run as child
processes (`chaos_flows.py`), and what users do to them: stop the Prefect server mid-run,
`prefect flow-run cancel` a script-started run, take the Ray dashboard away while a stop is
asked for, kill -9 a run and sweep.

Each scenario returns what it measured as a dict (the tests assert on it, `bench/chaos.py`
prints it as key=value lines); none asserts anything itself.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from prefect_nemo.jobs import META_FLOW_RUN, META_KEY
from prefect_nemo.local_ray import LocalRayCluster
from prefect_nemo.testing.prefect_server import PrefectServer

T = TypeVar("T")
JOB_EVENTS = "prefect-nemo.job."


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, every: float = 0.5) -> T:
    """The first truthy value of predicate(), or AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := predicate():
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(every)


@contextlib.contextmanager
def client(server: PrefectServer) -> Iterator[Any]:
    """A sync Prefect client of this server (whatever the process's settings say)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        with get_client(sync_client=True) as c:
            yield c


@dataclass
class Engines:
    """What the scenarios run against, and where they write their files."""

    server: PrefectServer
    ray: LocalRayCluster
    workdir: Path

    def ray_client(self) -> Any:
        return self.ray.block().backend().client

    def jobs(self, key: str) -> list[Any]:
        """Ray's own view of the jobs submitted under run key `key`."""
        return [j for j in self.ray_client().list_jobs()
                if (j.metadata or {}).get(META_KEY, "").startswith(f"run-key:{key}/")]  # fmt: skip

    def states(self, key: str) -> list[str]:
        return sorted(j.status.value for j in self.jobs(key))

    def script(
        self, key: str, entrypoints: list[str], block: dict[str, Any] | None = None, **env: str
    ) -> Script:
        """Start the chaos flow as a plain script with run key `key` (job ids start with it)."""
        name = f"{key}-{uuid.uuid4().hex[:4]}"  # a re-run of the same key gets its own files
        log, events = self.workdir / f"{name}.log", self.workdir / f"{name}.events"
        full_env = {
            **self.server.env(),
            "PYTHONUNBUFFERED": "1",
            "PREFECT_NEMO_RUN_KEY": key,
            "PREFECT_NEMO_HEARTBEAT_S": "2",
            "CHAOS_RAY_URL": self.ray.dashboard_url,
            "CHAOS_RAY_TOKEN": self.ray.token or "",
            "CHAOS_BLOCK": json.dumps(block or {}),
            "CHAOS_EVENTS_FILE": str(events),
            **env,
        }
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "prefect_nemo.testing.chaos_flows", *entrypoints],
                env=full_env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return Script(proc, log, events)

    def stop_all(self, key: str) -> None:
        """Stop what a scenario left running (cleanup, not a measurement)."""
        ray = self.ray_client()
        for job in self.jobs(key):
            if job.status.value in ("PENDING", "RUNNING"):
                with contextlib.suppress(Exception):
                    ray.stop_job(job.submission_id)


@dataclass
class Script:
    """A running flow script."""

    proc: subprocess.Popen[bytes]
    log: Path
    events: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def emitted(self) -> list[dict[str, str]]:
        """The job events the run emitted (written as they were made)."""
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line]

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the flow script ran past {timeout_s:g}s:\n"
                                 + self.output()[-4000:]) from None  # fmt: skip

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def running(engines: Engines, key: str, count: int) -> list[Any] | None:
    """The run's jobs once `count` of them are RUNNING."""
    jobs = engines.jobs(key)
    ok = len(jobs) == count and all(j.status.value == "RUNNING" for j in jobs)
    return jobs if ok else None


def flow_run_of(jobs: list[Any]) -> str:
    """The one flow run that submitted these jobs."""
    owners = {(j.metadata or {}).get(META_FLOW_RUN) for j in jobs}
    if len(owners) != 1:
        raise AssertionError(f"jobs of {len(owners)} flow runs: {owners}")
    return str(owners.pop())


def counting(lines: int, seconds: float) -> str:
    """An entrypoint that prints line-1..line-<lines> over about `seconds`."""
    pause = seconds / lines
    return f"for i in $(seq 1 {lines}); do echo line-$i; sleep {pause:.2f}; done"


def events(c: Any, since: datetime, prefix: str) -> list[dict[str, Any]]:
    """Every event whose name starts with `prefix` since `since`."""
    from prefect_nemo.tasks.sweeper import read_events

    return read_events(c, since, prefix=[prefix])


def terminal(c: Any, run_id: str) -> Any:
    state = c.read_flow_run(uuid.UUID(run_id)).state
    return state if state is not None and state.is_final() else None


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# ---------------------------------------------------------------------------------------------
# `prefect flow-run cancel` of a script-started run (issue 17 item 3)


def cancel_script_run(engines: Engines, count: int = 3) -> dict[str, Any]:
    """A plain script waits on `count` running jobs; `prefect flow-run cancel <id>` (the real
    CLI). Measures the seconds from the CLI's return until Ray says every job is STOPPED, and
    the flow run's final state and message."""
    key = f"cancel-{uuid.uuid4().hex[:6]}"
    script = engines.script(key, ["sleep 300"] * count)
    try:
        jobs = wait_until(lambda: running(engines, key, count), 120, f"{count} RUNNING jobs")
        run_id = flow_run_of(jobs)
        prefect = str(Path(sys.executable).parent / "prefect")
        cli = subprocess.run([prefect, "flow-run", "cancel", run_id], env=engines.server.env(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        asked = time.monotonic()
        wait_until(lambda: engines.states(key) == ["STOPPED"] * count, 60, "STOPPED", every=0.1)
        stopped_s = time.monotonic() - asked
        code = script.wait(120)
    finally:
        script.kill()
        engines.stop_all(key)
    with client(engines.server) as c:
        state = wait_until(lambda: terminal(c, run_id), 60, "the flow run to end")
    return {
        "cli_exit_code": cli.returncode,
        "cli_output": (cli.stdout + cli.stderr)[-500:],
        "stopped_s": stopped_s,
        "exit_code": code,
        "final_state": state.type.value,
        "state_message": state.message or "",
        "job_ids": sorted(j.submission_id for j in jobs),
        "output": script.output()[-3000:],
    }


# ---------------------------------------------------------------------------------------------
# A stop the cluster could not confirm (issue 17 item 1's stop-pending rule)


def stop_pending(
    engines: Engines, down_s: float = 25.0, budget_s: float = 5.0, stop_timeout_s: float = 5.0
) -> dict[str, Any]:
    """The Ray dashboard (behind a TcpProxy) goes away for `down_s` while a script waits on a
    job; with an unreachable budget and a stop timeout shorter than that, the task fails and
    its stop is not confirmed. Once the dashboard is back, the sweeper (run every few seconds
    from here, another process) must stop the job; measures how long after the return."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.blocks.ray_jobs import RayJobsCluster
    from prefect_nemo.tasks.sweeper import STOP_PENDING_EVENT, sweep
    from prefect_nemo.testing.proxy import TcpProxy

    key = f"pending-{uuid.uuid4().hex[:6]}"
    port = int(engines.ray.dashboard_url.rsplit(":", 1)[1])
    started = datetime.now(UTC)
    limits = {"unreachable_budget_s": budget_s, "stop_timeout_s": stop_timeout_s}
    with TcpProxy("127.0.0.1", port) as proxy:
        script = engines.script(key, ["sleep 150"], block=limits, CHAOS_RAY_URL=proxy.url)
        try:
            jobs = wait_until(lambda: running(engines, key, 1), 120, "a RUNNING job")
            proxy.go_down()
            cut = time.monotonic()
            code = script.wait(down_s + 60)
            exited_s = time.monotonic() - cut
            state_at_return = engines.states(key)
            time.sleep(max(0.0, down_s - (time.monotonic() - cut)))
            proxy.come_back()
            back = time.monotonic()
            block = RayJobsCluster(dashboard_url=proxy.url, auth_token=engines.ray.token, **limits)
            verdicts: list[Any] = []
            with temporary_settings(updates={PREFECT_API_URL: engines.server.api_url}):
                while engines.states(key) != ["STOPPED"] and time.monotonic() - back < 90:
                    # the cluster may hold other runs' jobs (a shared test cluster): ours only
                    verdicts += [v for v in sweep([block]) if v.stop and v.job_id.startswith(key)]
                    time.sleep(2)
            stopped_s = time.monotonic() - back if engines.states(key) == ["STOPPED"] else None
        finally:
            script.kill()
            engines.stop_all(key)
    with client(engines.server) as c:
        pending = [e for e in events(c, started, STOP_PENDING_EVENT)
                   if e["resource"]["prefect.resource.name"] == jobs[0].submission_id]  # fmt: skip
    return {
        "exit_code": code,
        "exited_s_after_cut": exited_s,
        "states_when_task_failed": state_at_return,
        "stop_pending_events": len(pending),
        "stopped_after_return_s": stopped_s,
        "final_states": engines.states(key),
        "swept": [(v.job_id, v.why, v.outcome) for v in verdicts],
        "said_not_confirmed": "asked to stop but is still" in script.output(),
        "output": script.output()[-3000:],
    }


# ---------------------------------------------------------------------------------------------
# kill -9 of a plain script, then the sweeper (issue 17 item 1)


def kill9(engines: Engines, count: int = 6, grace_s: float = 20.0) -> dict[str, Any]:
    """kill -9 of a script waiting on `count` running jobs. No retry: the sweeper (run every 5 s
    from here, another process; the deployment's schedule runs it every 60 s) must leave none
    of the killed run's jobs running `grace_s + 60` s after the kill. A re-run of the script
    (same run key) within the grace: it attaches to all of them and the sweeper stops none."""
    import os
    import signal

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.blocks.ray_jobs import RayJobsCluster
    from prefect_nemo.tasks.sweeper import sweep

    block = RayJobsCluster(dashboard_url=engines.ray.dashboard_url,
                           auth_token=engines.ray.token, sweep_grace_s=grace_s)  # fmt: skip
    fields = {"sweep_grace_s": grace_s}
    lost, again = f"lost-{uuid.uuid4().hex[:6]}", f"again-{uuid.uuid4().hex[:6]}"
    scripts: list[Script] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: engines.server.api_url}):
            # 1. killed, nobody runs it again
            scripts.append(first := engines.script(lost, ["sleep 600"] * count, block=fields))
            wait_until(lambda: running(engines, lost, count), 180, f"{count} RUNNING jobs")
            os.kill(first.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            early = [v for v in sweep([block]) if v.stop and v.job_id.startswith(lost)]
            deadline = killed + grace_s + 60
            while engines.states(lost).count("RUNNING") and time.monotonic() < deadline:
                sweep([block])
                time.sleep(5)
            left = engines.states(lost).count("RUNNING")
            stopped_after = None if left else time.monotonic() - killed
            # 2. killed, and the same script run again within the grace
            scripts.append(victim := engines.script(again, ["sleep 600"] * count, block=fields))
            jobs = wait_until(lambda: running(engines, again, count), 180, f"{count} RUNNING")
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            scripts.append(retry := engines.script(again, ["sleep 600"] * count, block=fields))
            wait_until(lambda: "SUBMITTED" in retry.output(), 120, "the re-run to start")
            attached = wait_until(lambda: _attached(retry, count), 120, "the re-run to attach")
            time.sleep(max(0.0, grace_s + 10 - (time.monotonic() - killed)))  # past the grace
            ids = {j.submission_id for j in jobs}
            swept = [v for v in sweep([block]) if v.stop and v.job_id in ids]
            still = sorted(j.submission_id for j in engines.jobs(again)
                           if j.status.value == "RUNNING")  # fmt: skip
    finally:
        for script in scripts:
            script.kill()
        engines.stop_all(lost)
        engines.stop_all(again)
    return {
        "early_stops": len(early),
        "left_running": left,
        "stopped_after_s": stopped_after,
        "retry_attached": attached,
        "retry_stopped": len(swept),
        "retry_same_jobs": still == sorted(ids),
        "retry_duplicates": len(engines.jobs(again)) - count,
    }


def _attached(script: Script, count: int) -> int | None:
    """How many jobs the run attached to, once it attached to `count`."""
    found = sum(1 for e in script.emitted() if e["event"] == "prefect-nemo.job.attached")
    return found if found >= count else None
