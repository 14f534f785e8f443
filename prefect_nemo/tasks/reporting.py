"""How work shows up in Prefect: one event emitter, the run's log, and the job reporter that
the lifecycle pushes each job's life to (its artifacts are written by `artifacts.py`). Every
text passes the redactor first.

One failure policy for all of it: reporting never fails the work it reports on, and loses
nothing to an API outage. Events, the job's log lines and artifact writes go through the one
outbox (`_outbox.py`), which keeps them in order until the API takes them.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.blocks.core import Block
from prefect.client.schemas.actions import ArtifactCreate, LogCreate
from prefect.events import Event
from prefect.filesystems import WritableFileSystem
from prefect.utilities.asyncutils import run_coro_as_sync

from prefect_nemo.jobs import DryRun, Failure, JobHandle, JobState, JobStatus, QueueInfo
from prefect_nemo.redaction import Redactor
from prefect_nemo.report import Report
from prefect_nemo.tasks._outbox import outbox
from prefect_nemo.tasks._run import RunContext, api_outage_budget_s
from prefect_nemo.tasks.artifacts import JobCharts, RunTable, RunUsage
from prefect_nemo.usage import JobShape, JobUsage, RollUp
from prefect_nemo.watcher import JobClock

JOB_EVENT_PREFIX = "prefect-nemo.job"
MESSAGE_CHARS = 300
# A job's `progress` event (and its summary line in the task's log) at most this often; the
# newest report goes out when the job ends. Automations see a report within this delay.
PROGRESS_EVENT_S = 5.0


def emit(
    event: str,
    resource: Mapping[str, str],
    payload: Mapping[str, Any] | None = None,
    related: list[dict[str, str]] | None = None,
) -> None:
    """Emit a Prefect event (with the calling run's related resources, like Prefect's own
    emit_event); delivered through API outages, never failing the caller."""
    outbox.event(
        Event(
            event=event,
            resource=dict(resource),
            payload=dict(payload or {}),
            related=related or [],
        )
    )


def say(run: RunContext, level: int, message: str) -> None:
    """One line into the run's log: on the console at once, into the Prefect API through the
    outbox (kept through outages, so no line is lost)."""
    run.logger.log(level, message, extra={"send_to_api": False})
    if run.flow_run_id is None:
        return
    outbox.log(
        LogCreate(
            name=getattr(getattr(run.logger, "logger", None), "name", "prefect_nemo"),
            level=level,
            message=message,
            timestamp=datetime.now(UTC),
            flow_run_id=UUID(run.flow_run_id),
            task_run_id=UUID(run.task_run_id) if run.task_run_id else None,
        ).model_dump(mode="json")
    )


# ---------------------------------------------------------------------------------------------
# Jobs


_job_table = RunTable("Jobs started by this flow run (prefect-nemo).")
_usage = RunUsage()


def usage_rolled_up(flow_run_id: str) -> tuple[RollUp, RollUp | None]:
    """The GPU-hours of a flow run's ended jobs and of its experiment's, recorded in this
    process: (the flow run's roll-up, its experiment's or None)."""
    return _usage.rolled_up(flow_run_id)


def job_rows(flow_run_id: str) -> list[dict[str, Any]]:
    """The job table rows recorded in this process for a flow run."""
    return _job_table.rows(flow_run_id)


def job_resource(handle: JobHandle) -> dict[str, str]:
    """The Prefect event resource that stands for a job."""
    return {
        "prefect.resource.id": handle.resource_id,
        "prefect.resource.name": handle.job_id,
        "prefect-nemo.backend": handle.backend,
        "prefect-nemo.cluster": handle.cluster,
    }


class JobReporter:
    """Reports jobs into the current Prefect run: the `lifecycle.JobObserver` of our tasks.

    One log line (but none for a job we just submitted turning PENDING: its "submitted" line
    said so) and one `prefect-nemo.job.<state>` event per state change (`queued` carries
    the queue, the scheduler's reason and place; `preempted` and `admitted` mark the ways into
    and out of the queue, with the wait), a row per job in the run's job table, the job's log
    lines in the task's log, and its teardown tracked by the run while it is live. The job's
    reports (prefect_nemo.report) become its JobCharts artifacts and `progress` events (at
    most one every PROGRESS_EVENT_S, the newest at the end), a stall a `stalled` event.
    """

    def __init__(
        self,
        run: RunContext,
        redact: Redactor,
        *,
        settle: bool = True,
        log_storage: str | None = None,
    ) -> None:
        self.run = run
        self.redact = redact
        self.settle = settle  # off: the caller settles the outbox itself (run_jobs, once for many)
        self.log_storage = log_storage  # the storage block saved logs are copied into, if any
        self._log_links: dict[str, str] = {}  # job -> where its saved log is
        self._last_state: dict[str, JobState] = {}
        self._preemptions: dict[str, int] = {}  # job -> preemptions its events have told
        self._announced: set[str] = set()  # jobs whose "submitted" line was logged
        # reports arrive on the log pump's thread: events made there carry this run's related
        # resources (flow run, task run, deployment) from the context the task made us in
        self._context = contextvars.copy_context()
        self._charts: dict[str, JobCharts] = {}
        self._progress_lock = threading.Lock()
        self._progress_sent: dict[str, float] = {}  # job -> when its last progress event went
        self._progress_due: set[str] = set()  # jobs whose newest report no event carried yet

    def submitted(
        self,
        handle: JobHandle,
        *,
        attached: bool,
        drift: str | None,
        shape: JobShape | None = None,
    ) -> None:
        """Log, emit `submitted`/`attached` (with the job's GPUs, where known: the sweeper
        prices the jobs of a run that died by them), add the job's row."""
        verb = "attached to existing" if attached else "submitted"
        if not attached:
            self._announced.add(handle.job_id)
        link = handle.links.get("dashboard", "")
        say(self.run, logging.INFO, f"{verb} job {handle.job_id} on {handle.cluster} {link}")
        if drift:
            say(self.run, logging.WARNING, self.redact(drift))
        payload: dict[str, Any] = {"attached": attached}
        if shape is not None:
            payload["shape"] = shape.model_dump(mode="json")
        self._emit(handle, "attached" if attached else "submitted", payload)
        self._row(handle, {"state": "PENDING", "attached": attached})
        self.run.own(handle)

    def live(self, handle: JobHandle, stop: Callable[[], str]) -> None:
        """The run stops the job if it ends another way than success while we wait."""
        self.run.track(_work_key(handle), stop)
        self.run.own(handle)

    def changed(
        self,
        handle: JobHandle,
        status: JobStatus,
        clock: JobClock | None,
        usage: JobUsage | None = None,
    ) -> None:
        """Log and emit only when the state changed (a queued job's new place in its queue
        only updates its row); on the way into and out of a queue also `preempted` /
        `admitted`; update the row. An ended job's usage goes into its event, its row and the
        run's GPU-hours artifact."""
        previous = self._last_state.get(handle.job_id)
        queue = status.queue
        preempted = self._new_preemptions(handle, status, previous, clock)
        if previous is status.state:
            if status.state is JobState.QUEUED and queue is not None:
                self._row(handle, _queue_fields(queue, clock))
            for _ in range(preempted):  # preempted and running again between two polls
                self._emit(handle, "preempted", self._state_payload(status))
            return
        if previous is not None and previous.is_waiting() and _it_ran(status):
            # seen waiting, then ended: it ran between two polls. Say RUNNING (and admitted)
            # first, so an automation on `running` sees every job that ran
            ran = status.model_copy(
                update={"state": JobState.RUNNING, "message": "ran between two polls",
                        "end_time": None, "exit_code": None}
            )  # fmt: skip
            self.changed(handle, ran, clock)
        self._last_state[handle.job_id] = status.state
        if status.state.is_terminal():
            self._last_progress(handle)  # its whole log was read: the last report goes first
            self.run.release(handle)
        payload = self._state_payload(status)
        message: str = payload["message"]
        line = f"job {handle.job_id} is {status.state.value}"
        if status.state is JobState.QUEUED and queue is not None:
            line += f" {self.redact(queue.describe())}"
        elif status.state.is_terminal() and message:
            line += f": {message.splitlines()[0]}"
        level = logging.ERROR if status.state is JobState.FAILED else logging.INFO
        if not (previous is None and status.state is JobState.PENDING and handle.job_id in
                self._announced):  # fmt: skip
            say(self.run, level, line)  # a new job's "submitted" line says it is pending
        if status.failure is not None:
            payload["failure"] = status.failure.model_dump(mode="json")
        if status.state.is_terminal() and handle.job_id in self._log_links:
            payload["log"] = self._log_links[handle.job_id]
        if clock is not None and clock.queued_s():
            payload["queue_wait_s"] = round(clock.queued_s(), 3)
        if usage is not None:
            payload["usage"] = usage.model_dump(mode="json")
            experiment = self.redact(self.run.experiment) if self.run.experiment else None
            job, state = self.redact(handle.job_id), status.state.value
            if usage.nodes * usage.gpus_per_node > 0:  # a CPU job gets no GPU-hours table
                _usage.add(self.run.flow_run_id, experiment, job, state, usage)
        self._emit(handle, status.state.value.lower(), payload)
        for _ in range(preempted):
            self._emit(handle, "preempted", payload)
        if previous is JobState.QUEUED and not status.state.is_terminal():
            waited = clock.last_wait_s if clock is not None else None
            self._emit(handle, "admitted", {**payload, "this_wait_s": waited})
        fields: dict[str, Any] = {
            "state": status.state.value,
            "message": message.splitlines()[0] if message else "",
        }
        if status.failure is not None:
            fields["failure"] = status.failure.describe()
        if queue is not None:
            fields.update(_queue_fields(queue, clock))
        elif clock is not None and clock.queued_s():
            fields["queue_wait_s"] = round(clock.queued_s(), 1)
        if status.start_time is not None:
            end = status.end_time or datetime.now(UTC)
            fields["duration_s"] = round((end - status.start_time).total_seconds(), 2)
        if usage is not None:
            fields.update(
                gpus=f"{usage.nodes} x {usage.gpus_per_node:g}", run_s=usage.run_s,
                gpu_hours=round(usage.gpu_hours, 4), cost=usage.cost,
            )  # fmt: skip
        self._row(handle, fields)

    def _state_payload(self, status: JobStatus) -> dict[str, Any]:
        """What every state event says: the state, its message (redacted, cut), the exit code
        and, while queued, where and why."""
        payload: dict[str, Any] = {
            "state": status.state.value,
            "message": self.redact(status.message)[:MESSAGE_CHARS],
            "exit_code": status.exit_code,
        }
        if status.queue is not None:
            payload["queue"] = self._queue_payload(status.queue)
        return payload

    def _new_preemptions(
        self, handle: JobHandle, status: JobStatus, previous: JobState | None,
        clock: JobClock | None,
    ) -> int:
        """How many preemptions this status shows that no `preempted` event told yet: as the
        clock counts them (it also takes the engine's count of requeues, which sees those
        between two polls); without a clock, a step from RUNNING back into the queue."""
        if clock is None:
            return int(status.state is JobState.QUEUED and previous is JobState.RUNNING)
        told = self._preemptions.get(handle.job_id, 0)
        self._preemptions[handle.job_id] = max(told, clock.preemptions)
        return max(0, clock.preemptions - told)

    def _queue_payload(self, queue: QueueInfo) -> dict[str, Any]:
        data = queue.model_dump(mode="json")
        data["reason"] = self.redact(queue.reason)[:MESSAGE_CHARS]
        return data

    def log(self, handle: JobHandle, line: str) -> None:
        """One line of the job's log, into the task's log."""
        say(self.run, logging.INFO, self.redact(f"[{handle.job_id}] {line}"))

    def progress(self, handle: JobHandle, report: Report) -> None:
        """A report of the job: into its artifacts; a `progress` event and a summary line in
        the task's log unless one went less than PROGRESS_EVENT_S ago (then the next report
        after that, or the job's end, carries it). Metric names are redacted first: a secret
        escaped into JSON or HTML would no longer match the redactor (numbers cannot hold
        one; the outputs are redacted once more anyway)."""
        names = {self.redact(name): value for name, value in report.metrics.items()}
        report = Report(report.step, report.total, names)
        with self._progress_lock:
            charts = self._charts.get(handle.job_id)
            if charts is None:
                charts = self._charts[handle.job_id] = JobCharts(handle, self.run, self.redact)
            now = time.monotonic()
            due = now - self._progress_sent.get(handle.job_id, -math.inf) >= PROGRESS_EVENT_S
            if due:
                self._progress_sent[handle.job_id] = now
                self._progress_due.discard(handle.job_id)
            else:
                self._progress_due.add(handle.job_id)
        charts.take(report)
        if due:
            self._progress_event(handle, charts)

    def _progress_event(self, handle: JobHandle, charts: JobCharts) -> None:
        payload, text = charts.summary()
        say(self.run, logging.INFO, self.redact(f"job {handle.job_id}: {text}"))
        self._context.copy().run(self._emit, handle, "progress", self.redact.deep(payload))

    def _last_progress(self, handle: JobHandle) -> None:
        """The newest report, if no event carried it yet (the job ended: nothing follows)."""
        with self._progress_lock:
            due = handle.job_id in self._progress_due
            self._progress_due.discard(handle.job_id)
            charts = self._charts.get(handle.job_id)
        if due and charts is not None:
            self._progress_event(handle, charts)

    def stalled(self, handle: JobHandle, silent_s: float, last: Report | None) -> None:
        """Said as a warning and emitted as `prefect-nemo.job.stalled` (with the last report)."""
        said = f"its last report: {last.describe()}" if last else "it never reported"
        say(
            self.run,
            logging.WARNING,
            self.redact(f"job {handle.job_id} said nothing for {silent_s:.0f}s: stalled; {said}"),
        )
        last_report = None
        if last is not None:  # step and total as null when unknown, as the payload always said
            last_report = {"step": last.step, "total": last.total, **last.as_json()}
        self._emit(
            handle, "stalled",
            {"silent_s": round(silent_s, 1), "last_report": self.redact.deep(last_report)},
        )  # fmt: skip

    def log_saved(self, handle: JobHandle, path: Path) -> None:
        """The job's log is saved (redacted) in `path`: copied into the log storage block if
        the cluster block names one, and linked from the job's row and terminal event (the
        copy, or the local file if there is none or the copy failed)."""
        link = str(path)
        if self.log_storage is not None:
            try:
                link = store_log(self.log_storage, path)
            except Exception as exc:  # reporting never fails the work: the local file stays
                say(
                    self.run,
                    logging.WARNING,
                    self.redact(
                        f"could not copy the log of job {handle.job_id} into storage block "
                        f"{self.log_storage} ({exc}); it is kept in {path}"
                    ),
                )
        self._log_links[handle.job_id] = link
        self._row(handle, {"log": link})

    def ended(self, handle: JobHandle) -> None:
        """The wait is over: nothing to stop on the run's behalf any more; what was reported
        reaches the API before the task hands its result to Prefect (the newest progress
        event too; the artifacts' last writes by the flow run's end at the latest)."""
        self._last_progress(handle)
        self.run.untrack(_work_key(handle))
        if self.settle and self.run.flow_run_id is not None:
            # Prefect's own state change that follows (the task run's end) gives up after about
            # a minute of retries: a job that ends while the Prefect server is down hands its
            # result back once the server is there to take it (within the outage budget)
            outbox.settle(api_outage_budget_s())

    def retrying(
        self, handle: JobHandle, failure: Failure, *, next_job_id: str, attempt: int, delay_s: float
    ) -> None:
        """Said as a warning, emitted as `prefect-nemo.job.retrying` (the class, the reason,
        the node, the next attempt's id) on the failed attempt, and chained in its row."""
        why = self.redact(failure.describe())
        say(
            self.run,
            logging.WARNING,
            f"job {handle.job_id} failed ({why}): resubmitting as {next_job_id} "
            f"(attempt {attempt + 1}) in {delay_s:g}s",
        )
        self._emit(
            handle,
            "retrying",
            {
                "class": failure.kind.value,
                "reason": self.redact(failure.reason)[:MESSAGE_CHARS],
                "node": failure.node,
                "attempt": attempt,
                "next_job_id": next_job_id,
                "delay_s": delay_s,
            },
        )
        self._row(handle, {"failure": why, "retried_as": next_job_id})

    def unstopped(self, handle: JobHandle, message: str) -> None:
        """A stop not confirmed: said, and recorded as `prefect-nemo.job.stop-pending` for the
        sweeper to finish once the cluster answers again. The run stops vouching for the job
        first: a heartbeat naming it after the record would tell the sweeper to keep it."""
        self.run.release(handle)
        say(self.run, logging.ERROR, self.redact(message))
        self._emit(handle, "stop-pending", {"message": self.redact(message)[:MESSAGE_CHARS]})

    def _emit(self, handle: JobHandle, what: str, payload: dict[str, Any]) -> None:
        emit(
            f"{JOB_EVENT_PREFIX}.{what}",
            job_resource(handle),
            {"job_id": handle.job_id, "links": handle.links, **payload},
        )

    def _row(self, handle: JobHandle, fields: dict[str, Any]) -> None:
        _job_table.update(
            self.run.flow_run_id,
            {handle.job_id: fields},
            defaults=lambda: {
                "job_id": handle.job_id,
                "backend": handle.backend,
                "state": "",
                "duration_s": None,
                "dashboard": handle.links.get("dashboard", ""),
                "attached": False,
                "message": "",
                "failure": "",  # its class and reason, once it FAILED
                "retried_as": "",  # the next attempt's id, when its recovery resubmitted it
                "gpus": "",  # nodes x GPUs per node, run time, GPU-hours, cost: once it ended
                "run_s": None,
                "gpu_hours": None,
                "cost": None,
                "log": "",
            },
        )


def store_log(storage: str, path: Path) -> str:
    """Copy a saved log file into a Prefect storage block (a WritableFileSystem, named
    '<block type>/<name>') as <flow run dir>/<file name>; returns where the copy is. The file is
    already redacted; it is read whole once, at the job's end. Called on a thread with no
    event loop (the wait's), also from an async task (run_jobs)."""
    block = _done(Block.load(storage))
    if not isinstance(block, WritableFileSystem):
        raise TypeError(f"{storage} is a {type(block).__name__}, not a writable file system")
    where = _done(block.write_path(f"{path.parent.name}/{path.name}", path.read_bytes()))
    return str(where) if where else f"{storage}:{path.parent.name}/{path.name}"


def _done(value: Any) -> Any:
    """What a Prefect sync-or-async method gave: in an async task's context (run_jobs) it
    returns a coroutine even on a thread with no event loop, which is run to its end here."""
    return run_coro_as_sync(value) if inspect.iscoroutine(value) else value


def _it_ran(status: JobStatus) -> bool:
    """An ended job ran if it succeeded or its entrypoint exited (a start time alone does not
    tell: Ray sets it on submission)."""
    return status.state is JobState.SUCCEEDED or (
        status.state is JobState.FAILED and status.exit_code is not None
    )


def _queue_fields(queue: QueueInfo, clock: JobClock | None) -> dict[str, Any]:
    """A queued job's row fields: where it waits, why, its place, how long it has waited."""
    fields: dict[str, Any] = {
        "queue": queue.queue or "",
        "queue_reason": queue.reason[:MESSAGE_CHARS],
        "queue_position": queue.position,
        # Slurm's backfill estimate comes after the job is first seen queued (its first event)
        "queue_estimated_start": queue.estimated_start,
    }
    if clock is not None:
        fields["queue_wait_s"] = round(clock.queued_s(), 1)
        fields["preemptions"] = clock.preemptions
    return fields


def _work_key(handle: JobHandle) -> str:
    return f"job {handle.job_id}"


def dry_run_reported(run: RunContext, dry: DryRun) -> DryRun:
    """Log what a dry run rendered and show it as a markdown artifact of the run."""
    text = dry.yaml
    say(
        run,
        logging.INFO,
        f"dry run: job {dry.job_id} would be sent to {dry.cluster} ({dry.backend}); nothing "
        f"was submitted:\n{text}",
    )
    if run.flow_run_id is None:
        return dry
    artifact = ArtifactCreate(
        type="markdown",
        data=(
            f"## Dry run of job `{dry.job_id}`\n\nNothing was submitted to {dry.cluster} "
            f"({dry.backend}). What would be sent:\n\n```yaml\n{text}```\n"
        ),
        description=f"Dry run of {dry.job_id} (prefect-nemo)",
        flow_run_id=UUID(run.flow_run_id),
    )
    outbox.call(lambda client: client.create_artifact(artifact))
    return dry
