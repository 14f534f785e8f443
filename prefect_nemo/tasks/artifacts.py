"""The artifacts a run keeps up to date in Prefect: the run's tables, progress and GPU-hours,
and each job's progress, metrics table and charts. Each is one artifact rewritten in place, its
writes coalesced and sent through the outbox (`_outbox.py`), so a burst of changes costs one
write and an API outage loses none."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from uuid import UUID

from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

from prefect_nemo.jobs import JobHandle
from prefect_nemo.progress import JobProgress
from prefect_nemo.redaction import Redactor
from prefect_nemo.report import Report
from prefect_nemo.tasks._outbox import outbox
from prefect_nemo.tasks._run import RunContext
from prefect_nemo.usage import JobUsage, RollUp, roll_up


class _CoalescedWrites:
    """One artifact per key (a flow run, or a job's artifact kind), rewritten in place. A write
    is queued only when none is waiting already, at most one every MIN_WRITE_S per key, and it
    serializes the state current when it is sent: a thousand changes between two sends cost
    one write (a thousand rows rewritten per job would compete with the UI for the API), and
    the last state is always the one written (the run's end flushes the outbox)."""

    MIN_WRITE_S = 1.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # keys with a write waiting in the outbox
        self._artifacts: dict[str, UUID] = {}
        self._written: dict[str, float] = {}  # key -> when its last write was sent

    def _changed(self, key: str) -> None:
        """Queue a write of the key's artifact unless one is waiting. Call with _lock held."""
        if key in self._pending:
            return
        self._pending.add(key)
        since = time.monotonic() - self._written.get(key, -self.MIN_WRITE_S)
        outbox.call(lambda client: self._write(client, key), after_s=self.MIN_WRITE_S - since)

    def _data(self, key: str) -> tuple[str, Any, str]:
        """(artifact type, data, description) as they are now. Called with _lock held."""
        raise NotImplementedError

    def _owner(self, key: str) -> tuple[str, str | None]:
        """The flow run and task run the key's artifact belongs to: here the key is the flow
        run (the flow run's artifact, not one task's: it covers everything of the run)."""
        return key, None

    def _write(self, client: Any, key: str) -> None:
        """Create the key's artifact, or rewrite it (the outbox runs writes in order)."""
        with self._lock:
            self._pending.discard(key)
            self._written[key] = time.monotonic()
            kind, data, description = self._data(key)
        artifact_id = self._artifacts.get(key)
        if artifact_id is None:
            flow_run_id, task_run_id = self._owner(key)
            artifact = client.create_artifact(
                ArtifactCreate(
                    type=kind,
                    data=data,
                    description=description,
                    flow_run_id=UUID(flow_run_id),
                    task_run_id=UUID(task_run_id) if task_run_id else None,
                )
            )
            self._artifacts[key] = artifact.id
        else:
            client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))


class RunTable(_CoalescedWrites):
    """One table artifact per flow run, rewritten in place as its rows change."""

    def __init__(self, description: str) -> None:
        super().__init__()
        self.description = description
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}  # flow run -> row id -> row

    def rows(self, flow_run_id: str) -> list[dict[str, Any]]:
        """The rows recorded in this process for a flow run (for summaries and tests)."""
        with self._lock:
            return [dict(row) for row in self._rows.get(flow_run_id, {}).values()]

    def update(
        self,
        flow_run_id: str | None,
        changes: Mapping[str, Mapping[str, Any]],
        *,
        defaults: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        """Merge each row's fields (by row id) into the table, a new row starting from
        `defaults()`, and have the artifact rewritten. No-op outside a flow run."""
        if flow_run_id is None:
            return
        with self._lock:
            table = self._rows.setdefault(flow_run_id, {})
            for row_id, fields in changes.items():
                table.setdefault(row_id, defaults()).update(fields)
            self._changed(flow_run_id)

    def _data(self, flow_run_id: str) -> tuple[str, Any, str]:
        rows = list(self._rows.get(flow_run_id, {}).values())
        return "table", json.dumps(rows, default=str), self.description


class RunProgress(_CoalescedWrites):
    """One progress artifact per flow run (percent done), its description saying k/N and how
    the rest are doing (e.g. "4 running, 984 queued")."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self._counts: dict[str, tuple[int, int, str]] = {}  # flow run -> (done, total, detail)

    def update(self, flow_run_id: str | None, done: int, total: int, detail: str = "") -> None:
        """Record k of N done (and a word on the others) and have the artifact rewritten.
        No-op outside a flow run."""
        if flow_run_id is None:
            return
        with self._lock:
            self._counts[flow_run_id] = (done, total, detail)
            self._changed(flow_run_id)

    def _data(self, flow_run_id: str) -> tuple[str, Any, str]:
        done, total, detail = self._counts[flow_run_id]
        percent = 100.0 * done / total if total else 100.0
        others = f"; {detail}" if detail else ""
        return "progress", percent, f"{done}/{total} {self.what}{others} (prefect-nemo)"


class JobCharts(_CoalescedWrites):
    """What a job's reports show in Prefect: a progress artifact (percent done; step rate and
    ETA in its description), a table of the latest metrics and a markdown chart of each
    metric over steps, all of the job's task run, each rewritten in place at most every
    MIN_WRITE_S (a job reporting 200 times a second costs one write of each per period)."""

    MIN_WRITE_S = 5.0

    def __init__(self, handle: JobHandle, run: RunContext, redact: Redactor) -> None:
        super().__init__()
        self.handle, self.run, self.redact = handle, run, redact
        self.progress = JobProgress()

    def take(self, report: Report) -> None:
        """Add a report and have the artifacts it changes rewritten (in a flow run)."""
        with self._lock:
            self.progress.take(report, time.monotonic())
            if self.run.flow_run_id is None:
                return
            if self.progress.percent() is not None:
                self._changed("progress")
            if report.metrics:
                self._changed("table")
                self._changed("markdown")

    def summary(self) -> tuple[dict[str, Any], str]:
        """The event payload and the one-line summary of the reports so far."""
        with self._lock:
            text = f"{self.progress.describe()}; {self.progress.metrics_text()}".rstrip("; ")
            return self.progress.payload(), text

    def _owner(self, key: str) -> tuple[str, str | None]:
        assert self.run.flow_run_id is not None  # take() writes nothing outside a flow run
        return self.run.flow_run_id, self.run.task_run_id

    def _data(self, key: str) -> tuple[str, Any, str]:
        job, progress = self.handle.job_id, self.progress
        if key == "progress":
            return (
                "progress",
                progress.percent() or 0.0,
                self.redact(f"job {job}: {progress.describe()} (prefect-nemo)"),
            )
        if key == "table":
            table = json.dumps(progress.table())
            return "table", self.redact(table), f"Latest metrics of job {job} (prefect-nemo)"
        chart = progress.chart(f"Metrics of job `{job}`")
        return "markdown", self.redact(chart), f"Metrics of job {job} over steps (prefect-nemo)"


class RunUsage(_CoalescedWrites):
    """One markdown artifact per flow run: each ended job's GPU-hours, and the roll-up of the
    flow run and of its experiment (every flow run of that experiment this process saw: a
    parent flow's subflows, a retry), wasted GPU-hours apart."""

    def __init__(self) -> None:
        super().__init__()
        self._jobs: dict[str, dict[str, tuple[str, JobUsage]]] = {}  # run -> job -> (state, use)
        self._experiment: dict[str, str] = {}  # flow run -> its experiment

    def add(
        self, flow_run_id: str | None, experiment: str | None, job: str, state: str,
        usage: JobUsage,
    ) -> None:  # fmt: skip
        """Record an ended job's usage (a job seen ending twice counts once) and have the
        artifacts it changes rewritten. No-op outside a flow run."""
        if flow_run_id is None:
            return
        with self._lock:
            self._jobs.setdefault(flow_run_id, {})[job] = (state, usage)
            if experiment:
                self._experiment[flow_run_id] = experiment
            for run in self._runs_of(experiment) | {flow_run_id}:
                self._changed(run)

    def rolled_up(self, flow_run_id: str) -> tuple[RollUp, RollUp | None]:
        """(the flow run's roll-up, its experiment's or None), as recorded in this process."""
        with self._lock:
            experiment = self._experiment.get(flow_run_id)
            of_experiment = self._sum(self._runs_of(experiment)) if experiment else None
            return self._sum({flow_run_id}), of_experiment

    def _runs_of(self, experiment: str | None) -> set[str]:
        return {run for run, name in self._experiment.items() if experiment and name == experiment}

    def _sum(self, runs: set[str]) -> RollUp:
        return roll_up(usage for run in runs for _, usage in self._jobs.get(run, {}).values())

    def _data(self, flow_run_id: str) -> tuple[str, Any, str]:
        lines = [
            "## GPU-hours of this flow run", "",
            "| job | state | nodes x GPUs | queue wait s | run s | GPU-hours | cost | wasted |",
            "|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for job, (state, u) in sorted(self._jobs.get(flow_run_id, {}).items()):
            lines.append(
                f"| `{job}` | {state} | {u.nodes} x {u.gpus_per_node:g} | {u.queue_wait_s:.1f} "
                f"| {u.run_s:.1f} | {u.gpu_hours:.4f} | {_money(u.cost)} | "
                f"{'yes' if u.wasted else ''} |"
            )
        rows = [("this flow run", self._sum({flow_run_id}))]
        experiment = self._experiment.get(flow_run_id)
        if experiment:
            rows.append((f"experiment `{experiment}`", self._sum(self._runs_of(experiment))))
        lines += [
            "", "| roll-up | jobs | GPU-hours | of which wasted | cost | of which wasted |",
            "|---|---|---|---|---|---|",
        ]  # fmt: skip
        for what, total in rows:
            lines.append(
                f"| {what} | {total.jobs} | {total.gpu_hours:.4f} | "
                f"{total.wasted_gpu_hours:.4f} | {_money(total.cost)} | "
                f"{_money(total.wasted_cost)} |"
            )
        lines += ["", "Wasted: GPU-hours of jobs that ended FAILED or STOPPED."]
        description = "GPU-hours of this flow run's jobs (prefect-nemo)"
        return "markdown", "\n".join(lines) + "\n", description


def _money(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"
