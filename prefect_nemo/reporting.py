"""How jobs show up in Prefect: one log line per state change, an event per change, and one table
artifact per flow run listing its jobs. Every text passes through the redactor first."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.events import emit_event

from prefect_nemo.jobs import JobHandle, JobState, JobStatus
from prefect_nemo.redaction import Redactor

EVENT_PREFIX = "prefect-nemo.job"
MESSAGE_CHARS = 300


def job_resource(handle: JobHandle) -> dict[str, str]:
    """The Prefect event resource that stands for a job."""
    return {
        "prefect.resource.id": handle.resource_id,
        "prefect.resource.name": handle.job_id,
        "prefect-nemo.backend": handle.backend,
        "prefect-nemo.cluster": handle.cluster,
    }


@dataclass
class _JobTable:
    """The rows of one flow run's job table and the artifact that shows them."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    artifact_id: UUID | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_tables: dict[str, _JobTable] = {}
_tables_lock = threading.Lock()


def _table_for(flow_run_id: str) -> _JobTable:
    with _tables_lock:
        return _tables.setdefault(flow_run_id, _JobTable())


def job_rows(flow_run_id: str) -> list[dict[str, Any]]:
    """The job table rows recorded in this process for a flow run (for summaries and tests)."""
    table = _table_for(flow_run_id)
    with table.lock:
        return [dict(r) for r in table.rows.values()]


class JobReporter:
    """Reports one job's life into the current Prefect run."""

    def __init__(
        self,
        handle: JobHandle,
        *,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        redact: Redactor,
        flow_run_id: str | None,
    ) -> None:
        self.handle = handle
        self.logger = logger
        self.redact = redact
        self.flow_run_id = flow_run_id
        self._last_state: JobState | None = None

    def submitted(self, *, attached: bool, drift: str | None = None) -> None:
        """Record that the job was submitted (or re-attached to)."""
        verb = "attached to existing" if attached else "submitted"
        link = self.handle.links.get("dashboard", "")
        self.logger.info(f"{verb} job {self.handle.job_id} on {self.handle.cluster} {link}")
        if drift:
            self.logger.warning(self.redact(drift))
        self._emit("attached" if attached else "submitted", {"attached": attached})
        self._upsert_row(state="PENDING", attached=attached)

    def changed(self, status: JobStatus) -> None:
        """Record a new observation; logs and emits only when the state actually changed."""
        if status.state is self._last_state:
            return
        self._last_state = status.state
        message = self.redact(status.message)[:MESSAGE_CHARS]
        line = f"job {self.handle.job_id} is {status.state.value}"
        if status.state.is_terminal() and message:
            line += f": {message.splitlines()[0]}"
        level = logging.ERROR if status.state is JobState.FAILED else logging.INFO
        self.logger.log(level, line)
        self._emit(
            status.state.value.lower(),
            {"state": status.state.value, "message": message, "exit_code": status.exit_code},
        )
        self._upsert_row(
            state=status.state.value,
            started=status.start_time,
            ended=status.end_time,
            message=message.splitlines()[0] if message else "",
        )

    def _emit(self, what: str, payload: dict[str, Any]) -> None:
        try:
            emit_event(
                event=f"{EVENT_PREFIX}.{what}",
                resource=job_resource(self.handle),
                payload={"job_id": self.handle.job_id, "links": self.handle.links, **payload},
            )
        except Exception as exc:  # reporting must never break the job itself
            self.logger.debug(f"could not emit event: {exc}")

    def _upsert_row(self, **fields: Any) -> None:
        if self.flow_run_id is None:
            return
        table = _table_for(self.flow_run_id)
        with table.lock:
            row = table.rows.setdefault(
                self.handle.job_id,
                {
                    "job_id": self.handle.job_id,
                    "backend": self.handle.backend,
                    "state": "",
                    "duration_s": None,
                    "dashboard": self.handle.links.get("dashboard", ""),
                    "attached": False,
                    "message": "",
                },
            )
            started, ended = fields.pop("started", None), fields.pop("ended", None)
            row.update(fields)
            if started is not None:
                end = ended or datetime.now(UTC)
                row["duration_s"] = round((end - started).total_seconds(), 2)
            try:
                self._write_artifact(table)
            except Exception as exc:
                self.logger.debug(f"could not update the job table artifact: {exc}")

    def _write_artifact(self, table: _JobTable) -> None:
        rows = list(table.rows.values())
        with get_client(sync_client=True) as client:
            if table.artifact_id is None:
                # the flow run's artifact, not the first task's: it lists every job of the run
                artifact = client.create_artifact(
                    ArtifactCreate(
                        type="table",
                        data=json.dumps(rows),
                        description="Jobs started by this flow run (prefect-nemo).",
                        flow_run_id=UUID(self.flow_run_id),
                    )
                )
                table.artifact_id = artifact.id
            else:
                client.update_artifact(table.artifact_id, ArtifactUpdate(data=json.dumps(rows)))
