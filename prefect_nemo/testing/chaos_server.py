"""Chaos scenarios of the Prefect server itself (issue 17 items 4 and 5): stopped mid-run and
started again on the same database, within the outage budget and past it. See `chaos.py`."""

from __future__ import annotations

import contextlib
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect_nemo.jobs import META_KEY
from prefect_nemo.testing.chaos import (
    JOB_EVENTS,
    Engines,
    client,
    counting,
    events,
    flow_run_of,
    parse_time,
    running,
    terminal,
    wait_until,
)
from prefect_nemo.testing.prefect_server import PrefectServer


def server_down(engines: Engines, down_s: float = 20.0, count: int = 4) -> dict[str, Any]:
    """A script waits on `count` Ray jobs; the Prefect server is stopped for `down_s` and started
    again on the same database. Half the jobs end during the outage, half after. Measures
    duplicates, final states, the job events and log lines present in the API against what the
    run emitted, and whether an automation waiting for every `prefect-nemo.job.succeeded`
    fired after the outage."""
    key = f"down-{uuid.uuid4().hex[:6]}"
    # 2 lines a second; the shortest job outlasts the others' start (staggered under load)
    lines = [int(2 * (down_s * f + 10)) for f in (0.4, 0.8, 1.3, 1.6)][:count]
    lines += [lines[-1]] * (count - len(lines))
    automation = _succeeded_automation(engines.server, key, count)
    started = datetime.now(UTC)
    script = engines.script(key, [counting(n, n * 0.5) for n in lines])
    try:
        jobs = wait_until(lambda: _started(engines, key, count), 180, f"{count} started jobs")
        time.sleep(2)  # some lines reach the API before the outage
        down_at, down = datetime.now(UTC), time.monotonic()  # SIGINT: it stops answering at once
        engines.server.stop()
        time.sleep(max(0.0, down_s - (time.monotonic() - down)))
        up_at = datetime.now(UTC)
        engines.server.start()
        outage_s = time.monotonic() - down  # until it answered again
        code = script.wait(down_s + max(lines) + 240)
    finally:
        script.kill()
        engines.stop_all(key)
    run_id = flow_run_of(jobs)
    out = script.output()
    with client(engines.server) as c:
        state = c.read_flow_run(uuid.UUID(run_id)).state
        emitted = script.emitted()
        ids = {x["id"] for x in emitted}

        def stored() -> set[str]:
            return ids & {e["id"] for e in events(c, started, JOB_EVENTS)}

        with contextlib.suppress(AssertionError):  # the server stores events a moment later
            wait_until(lambda: stored() == ids, 30, "every job event stored", every=1)
        present = stored()
        logs = _job_log_lines(c, run_id)
        fired = _automation_fired(c, automation, started)
    job_states = engines.states(key)
    expected = {j.submission_id: [f"line-{i}" for i in range(1, n + 1)]
                for j, n in zip(sorted(jobs, key=lambda j: j.submission_id), _by_name(jobs, lines),
                                strict=True)}  # fmt: skip
    present_lines = sum(
        len(expected[job]) for job in expected if logs.get(job, []) == expected[job]
    )
    during = [e for e in emitted if e["event"].endswith(".succeeded")]
    return {
        "exit_code": code,
        "outage_s": outage_s,
        "final_state": state.type.value if state else "NONE",
        "state_message": state.message if state else "",
        "jobs": len(job_states),
        "duplicates": len(job_states) - count,
        "succeeded": job_states.count("SUCCEEDED"),
        "events_emitted": len(emitted),
        "events_present": len(present),
        "succeeded_events_emitted": len(during),
        "log_lines_expected": sum(len(v) for v in expected.values()),
        "log_lines_present": present_lines,
        "log_lines_seen": sum(len(v) for v in logs.values()),
        "lines_during_outage": _lines_between(engines.server, run_id, down_at, up_at),
        "trigger_fired_after_outage": fired is not None and fired > up_at,
        "trigger_fired_s_after_return": (fired - up_at).total_seconds() if fired else None,
        "output": out[-3000:],
    }


def server_down_past_budget(
    engines: Engines, down_s: float = 20.0, budget_s: float = 5.0, count: int = 2
) -> dict[str, Any]:
    """The Prefect server stays down past $PREFECT_NEMO_API_OUTAGE_BUDGET_S: the run must stop
    its jobs (confirmed on Ray while the server is still down) and fail naming the outage."""
    key = f"budget-{uuid.uuid4().hex[:6]}"
    script = engines.script(key, ["sleep 300"] * count,
                            PREFECT_NEMO_API_OUTAGE_BUDGET_S=str(budget_s))  # fmt: skip
    try:
        jobs = wait_until(lambda: running(engines, key, count), 120, f"{count} RUNNING jobs")
        down = time.monotonic()  # SIGINT: it stops answering at once
        engines.server.stop()
        stopped = None
        with contextlib.suppress(AssertionError):
            wait_until(lambda: engines.states(key) == ["STOPPED"] * count, down_s, "STOPPED")
            stopped = time.monotonic() - down
        time.sleep(max(0.0, down_s - (time.monotonic() - down)))
        engines.server.start()
        code = script.wait(240)
    finally:
        script.kill()
        engines.stop_all(key)
    run_id = flow_run_of(jobs)
    with client(engines.server) as c:
        state = wait_until(lambda: terminal(c, run_id), 60, "the flow run to end")
    return {
        "exit_code": code,
        "stopped_s_after_outage": stopped,
        "job_states": engines.states(key),
        "final_state": state.type.value,
        "state_message": state.message or "",
        "output": script.output()[-3000:],
    }


def _started(engines: Engines, key: str, count: int) -> list[Any] | None:
    """The run's jobs once `count` of them are RUNNING or over."""
    jobs = engines.jobs(key)
    ok = len(jobs) == count and all(j.status.value != "PENDING" for j in jobs)
    return jobs if ok else None


def _by_name(jobs: list[Any], lines: list[int]) -> list[int]:
    """The line count of each job (job j<i> got lines[i]), in submission-id order."""
    named = {j.submission_id: lines[int(j.metadata[META_KEY].rsplit("/j", 1)[1])] for j in jobs}
    return [named[k] for k in sorted(named)]


def _succeeded_automation(server: PrefectServer, key: str, count: int) -> uuid.UUID:
    """An automation (on the real server) that fires once `count` jobs of run key `key` sent
    `prefect-nemo.job.succeeded`."""
    from prefect.events.actions import DoNothing
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    automation = AutomationCore(
        name=f"all-succeeded-{key}",
        trigger=EventTrigger(
            expect={"prefect-nemo.job.succeeded"},
            match={"prefect.resource.name": f"{key}*"},
            posture=Posture.Reactive,
            threshold=count,
            within=timedelta(hours=1),
        ),
        actions=[DoNothing()],
    )
    with client(server) as c:
        return c.create_automation(automation)


def _automation_fired(c: Any, automation: uuid.UUID, since: datetime) -> datetime | None:
    """When the automation fired (its `prefect.automation.triggered` event), if it did."""

    def fired() -> datetime | None:
        for event in events(c, since, "prefect.automation.triggered"):
            if event["resource"]["prefect.resource.id"] == f"prefect.automation.{automation}":
                return parse_time(event["occurred"])
        return None

    with contextlib.suppress(AssertionError):
        return wait_until(fired, 60, "the automation to fire", every=2)
    return None


def _job_logs(c: Any, run_id: str) -> list[Any]:
    """Every log line of the flow run in the API, oldest first."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    found: list[Any] = []
    flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run_id)]))
    while batch := c.read_logs(log_filter=flt, limit=200, offset=len(found)):
        found += batch
    return found


def _job_log_lines(c: Any, run_id: str) -> dict[str, list[str]]:
    """job id -> the lines of its own log in the flow run's log, in order."""
    lines: dict[str, list[str]] = {}
    for log in _job_logs(c, run_id):
        if log.message.startswith("[") and "] line-" in log.message:
            job, line = log.message[1:].split("] ", 1)
            lines.setdefault(job, []).append(line)
    return lines


def _lines_between(server: PrefectServer, run_id: str, start: datetime, end: datetime) -> int:
    """How many job log lines were made while the server was down."""
    with client(server) as c:
        return sum(1 for log in _job_logs(c, run_id)
                   if "] line-" in log.message and start <= log.timestamp <= end)  # fmt: skip
