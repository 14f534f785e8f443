"""Issue 17 end to end, against a real Prefect server (`prefect server start`, stopped and started
again on its database), a real local Ray head with token auth, and plain flow scripts in child
processes: the Prefect server down mid-run (items 4, 5), `prefect flow-run cancel` of a
script-started run (item 3), a stop the cluster could not confirm finished by the sweeper
(item 1's stop-pending rule). The scenarios live in `prefect_nemo.testing.chaos*` (`make chaos`
runs them at the issue's sizes and prints what they measured)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from prefect_nemo.jobs import JobState, OwnedJob
from prefect_nemo.tasks.sweeper import LEASE_S, Beat, Evidence, judge
from prefect_nemo.testing.chaos import Engines, cancel_script_run, stop_pending, wait_until
from prefect_nemo.testing.chaos_server import server_down, server_down_past_budget
from prefect_nemo.testing.prefect_server import PrefectServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A restartable Prefect server of this module's own."""
    with PrefectServer(tmp_path_factory.mktemp("outages-server")) as server:
        yield server


@pytest.fixture(scope="module")
def ray_head(own_ray_head: Any) -> Any:
    """A head of this module's own (conftest's `own_ray_head`): its chaos sweeps judge every job."""
    return own_ray_head


@pytest.fixture(scope="module")
def engines(
    server: PrefectServer, ray_head: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """The module's Prefect server, the session's Ray head."""
    yield Engines(server, ray_head, tmp_path_factory.mktemp("outages"))


def _explain(result: dict[str, Any]) -> str:
    lines = [f"{k}={v}" for k, v in result.items() if k != "output"]
    return "\n".join([*lines, "--- script ---", result.get("output") or ""])


@pytest.mark.slow
def test_a_prefect_server_restart_mid_run_loses_no_event_and_no_log_line(engines: Engines) -> None:
    """Issue 17 item 4: "A flow waiting on jobs survives a restart of the Prefect server (down for
    20 s): jobs keep running, logs and states catch up when it is back, nothing is submitted
    twice"; item 5: "No event or log line is lost to a Prefect API outage within the outage
    budget: events and logs that could not be delivered are kept and delivered when the API
    returns (in order, each once), and a trigger waiting for prefect-nemo.job.* ... fires after
    the outage". Prefect's event model: an event's `id` is the "Client-provided identifier of
    this event" (docs.prefect.io, Events), so an event sent again after an outage is the same
    event. Two of the four jobs end while the server is down."""
    result = server_down(engines, down_s=20, count=4)
    why = _explain(result)
    assert result["exit_code"] == 0 and result["final_state"] == "COMPLETED", why
    assert result["duplicates"] == 0 and result["succeeded"] == 4, why
    assert result["events_emitted"] >= 4 * 3, why  # submitted, running, succeeded at least
    assert result["events_present"] == result["events_emitted"], why
    assert result["log_lines_present"] == result["log_lines_expected"], why
    assert result["log_lines_seen"] == result["log_lines_expected"], "a line twice: " + why
    assert result["lines_during_outage"] > 0, "the outage must fall while lines were made"
    assert result["trigger_fired_after_outage"], why


@pytest.mark.slow
def test_a_prefect_server_down_past_the_budget_fails_the_run_and_stops_its_jobs(
    engines: Engines,
) -> None:
    """Issue 17 item 4: "beyond a budget the flow fails with a clear error and stops its jobs"
    ($PREFECT_NEMO_API_OUTAGE_BUDGET_S): the jobs are STOPPED on Ray while the server is still
    down, and the run, once the server is back, is Failed naming the outage."""
    result = server_down_past_budget(engines, down_s=14, budget_s=3, count=2)
    why = _explain(result)
    assert result["stopped_s_after_outage"] is not None, "jobs not STOPPED during the outage"
    assert result["job_states"] == ["STOPPED", "STOPPED"], why
    assert result["exit_code"] != 0 and result["final_state"] == "FAILED", why
    assert "Prefect API has been unreachable" in result["state_message"], why


@pytest.mark.slow
def test_prefect_flow_run_cancel_of_a_script_run_stops_its_jobs_and_ends_cancelled(
    engines: Engines,
) -> None:
    """Issue 17 item 3: "After our cancel watch stops the jobs, the flow run's final state is
    Cancelled (with a message that names the stopped jobs), for script-started runs"; must
    hold: "`prefect flow-run cancel` of a script-started run: all jobs STOPPED <= 10 s and the
    flow run Cancelled". Prefect: "When requesting cancellation, the flow run moves to a
    'Cancelling' state" and it is the monitoring process (a worker, a runner) that ends it;
    a script has none, so ours must (docs.prefect.io, How to cancel running workflows)."""
    result = cancel_script_run(engines, count=3)
    why = _explain(result)
    assert result["cli_exit_code"] == 0, why
    assert result["stopped_s"] <= 30, why  # the 10 s is measured by `make chaos`
    assert result["final_state"] == "CANCELLED", why
    for job_id in result["job_ids"]:
        assert job_id in result["state_message"], why


@pytest.mark.slow
def test_a_stop_the_cluster_could_not_confirm_is_finished_by_the_sweeper(engines: Engines) -> None:
    """Issue 17 item 1: "a stop we asked for but could not confirm (backend unreachable) is
    recorded and finished by the sweeper once the backend answers again"; must hold: "Ray
    dashboard down 25 s with budget 5 s and stop timeout 5 s: the job is STOPPED within 60 s
    of the dashboard's return (by the sweeper), not left to finish"."""
    result = stop_pending(engines, down_s=25, budget_s=5, stop_timeout_s=5)
    why = _explain(result)
    assert result["exit_code"] != 0, why
    assert result["states_when_task_failed"] == ["RUNNING"], "the stop must not have happened"
    assert result["said_not_confirmed"], why  # "asked to stop but is still unknown after 5s"
    assert result["stop_pending_events"] == 1, why
    assert result["final_states"] == ["STOPPED"], why
    assert result["stopped_after_return_s"] is not None and result["stopped_after_return_s"] <= 60
    assert result["swept"] and all("never confirmed" in w for _, w, _ in result["swept"]), why


def test_a_heartbeat_lease_rules_over_the_submission_sign() -> None:
    """Issue 17 must hold: "kill -9 ... no retry: 0 jobs of the killed run still running
    sweep_grace_s + 60 s after the kill". A run killed 10 s after it submitted, whose
    heartbeats granted a 30 s lease: dead when that lease ran out, not LEASE_S (90 s) after
    the submission (which would leave the job running past grace + 60 s)."""
    now = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    killed = now - timedelta(seconds=50)
    job = OwnedJob(job_id="job-1", state=JobState.RUNNING, flow_run_id="run-a",
                   submitted_at=killed - timedelta(seconds=10))  # fmt: skip
    beat = Beat(killed, killed + timedelta(seconds=30))
    run = SimpleNamespace(state=SimpleNamespace(type=__import__(
        "prefect.client.schemas.objects", fromlist=["StateType"]).StateType.RUNNING))  # fmt: skip
    evidence = Evidence(now, {("c", "job-1"): beat}, {"run-a": beat}, {}, {"run-a": run})
    verdict = judge("b", "c", job, evidence, grace_s=10.0, lease_s=LEASE_S)
    assert verdict.stop and "stopped saying it is alive" in verdict.why, verdict


def test_a_heartbeat_goes_before_a_backlog_and_only_the_newest_is_kept(prefect_api: str) -> None:
    """Issue 17 item 1: a run proves it is alive with "a lease/heartbeat the run renews while it
    waits on jobs"; a heartbeat that waits behind a backlog of log lines comes too late for its
    lease (the sweeper then stops a live run's jobs). Against the real API: the newest of two
    heartbeats goes in the second batch at the latest, behind 1,200 queued log lines."""
    from prefect.client.orchestration import get_client
    from prefect.events import Event

    from prefect_nemo.tasks._outbox import Outbox
    from prefect_nemo.tasks.sweeper import read_events

    sent: list[str] = []

    class Recording(Outbox):
        def _send(self, batch: list[Any], clients: Any) -> None:
            super()._send(batch, clients)
            sent.append(batch[0].kind if batch[0].kind != "event" else batch[0].value.event)

    box, since = Recording(), datetime.now(UTC)
    run = f"test-{since.timestamp()}"
    for i in range(1200):
        box.log({"name": "t", "level": 20, "message": f"line {i}", "timestamp": since.isoformat()})
    for n in (1, 2):
        box.beat(Event(event="prefect-nemo.run.heartbeat", payload={"n": n},
                       resource={"prefect.resource.id": f"prefect-nemo.run.{run}"}))  # fmt: skip
    assert box.flush(timeout_s=60)
    assert "prefect-nemo.run.heartbeat" in sent[:2], sent

    def stored() -> list[int]:  # the server persists events a moment after it takes them
        with get_client(sync_client=True) as client:
            found = read_events(client, since, name=["prefect-nemo.run.heartbeat"])
        ours = [e for e in found if e["resource"]["prefect.resource.id"].endswith(run)]
        return [e["payload"]["n"] for e in ours]

    assert wait_until(stored, 30, "the heartbeat stored") == [2], "only the newest unsent goes"


def test_a_held_write_waits_for_its_time_and_goes_at_once_on_flush(prefect_api: str) -> None:
    """Issue 16 (3): "the progress artifact and the job table should be updated at most every
    ~1-2 s, not per job". The outbox holds a write made with `after_s` apart: a job's end
    (`settle`) does not wait for it, while the run's end (`flush`) sends it at once, so the
    last state of a table is never lost. Against the real API (the log line is delivered)."""
    from prefect_nemo.tasks._outbox import Outbox

    box, written = Outbox(), []
    box.call(written.append, after_s=3600)
    now = datetime.now(UTC).isoformat()
    box.log({"name": "t", "level": 20, "message": "a line", "timestamp": now})
    box.settle(outage_budget_s=60, quick_s=30)
    assert written == [] and box.pending() == 1, "settle delivered the line, not the held write"
    assert box.flush(timeout_s=30)
    assert len(written) == 1 and box.pending() == 0


def test_our_events_carry_the_related_resources_prefects_emit_event_attaches(
    prefect_api: str,
) -> None:
    """Prefect's `emit_event` attaches "the run context's related resources" in its worker
    (`related_resources_from_run_context`: flow run, task run, flow, deployment, work queue and
    pool, every tag). Our events go through the outbox, which looks the flow run's part up once
    per flow run and adds each task run itself: the same list, in the same order, as Prefect's
    own emit_event gives an event made in the same task, stored by the real server."""
    import uuid

    from prefect import flow, tags, task
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event

    from prefect_nemo.tasks._outbox import outbox
    from prefect_nemo.tasks.reporting import emit
    from prefect_nemo.tasks.sweeper import read_events

    since, mark = datetime.now(UTC), uuid.uuid4().hex[:8]

    @task(tags=["task-tag", "b-tag"])
    def report(i: int) -> None:
        for who, send in (("ours", emit), ("prefects", emit_event)):
            send(f"test.related.{who}", {"prefect.resource.id": f"test.{mark}.{who}.{i}"})

    @flow
    def reporting() -> None:
        for i in range(2):  # the second task run: the flow run's part comes from the cache
            report(i)

    with tags("a-tag"):
        reporting()
    assert outbox.flush(timeout_s=30)

    def stored() -> dict[str, list[tuple[str, str]]]:
        with get_client(sync_client=True) as client:
            found = read_events(client, since, name=["test.related.ours", "test.related.prefects"])
        return {e["resource"]["prefect.resource.id"]: [
            (r["prefect.resource.id"], r["prefect.resource.role"]) for r in e["related"]
        ] for e in found if mark in e["resource"]["prefect.resource.id"]}  # fmt: skip

    got = wait_until(lambda: len(stored()) == 4 and stored(), 30, "the events stored")
    for i in range(2):
        ours, prefects = got[f"test.{mark}.ours.{i}"], got[f"test.{mark}.prefects.{i}"]
        assert ours == prefects, (ours, prefects)
        roles = [role for _, role in ours]
        assert roles[:3] == ["flow-run", "task-run", "flow"], ours
        assert [r for r, role in ours if role == "tag"] == [
            "prefect.tag.a-tag", "prefect.tag.b-tag", "prefect.tag.task-tag"]  # fmt: skip
    assert got[f"test.{mark}.ours.0"][1] != got[f"test.{mark}.ours.1"][1], "each its task run"


def test_an_outbox_that_has_sent_sees_the_api_go_at_its_next_send(server: PrefectServer) -> None:
    """Issue 17 item 4: "beyond a budget the flow fails with a clear error and stops its jobs";
    the budget reads `outbox.unreachable_for()`. Prefect's client retries a refused connection
    by itself once it has connected ("Only retry ConnectError after we've successfully
    connected once ... resilience during server restarts", prefect/client/base.py) up to
    PREFECT_CLIENT_MAX_RETRIES (5) times, 2**n s apart: a minute before the outbox saw a
    failure. Its thread, kept alive by a held artifact write, kept that connected client, so a
    14 s outage went unseen (the past-the-budget run above ran on for 275 s). Against the real
    server: an outbox that delivered and holds a write says the API is unreachable within
    seconds of the server's stop, and that it answers once back, the held write still held."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.tasks._outbox import Outbox

    box, held = Outbox(), []

    def line(message: str) -> dict[str, Any]:
        return {"name": "t", "level": 20, "message": message,
                "timestamp": datetime.now(UTC).isoformat()}  # fmt: skip

    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        box.call(held.append, after_s=3600)  # keeps the sending thread (and its client) alive
        box.log(line("before"))
        wait_until(lambda: box.delivered == 1, 30, "the first line delivered")
        server.stop()
        try:
            box.log(line("during"))
            wait_until(lambda: box.unreachable_for() > 0, 5, "the outbox to see the outage")
        finally:
            server.start()
        wait_until(lambda: box.unreachable_for() == 0, 30, "the outbox to see the API back")
        assert box.delivered == 2 and held == [], "the line went, the held write still waits"
        assert box.flush(timeout_s=30) and len(held) == 1
