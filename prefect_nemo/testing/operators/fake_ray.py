"""A Ray Jobs API without Ray, for scale tests: jobs "run" on a clock, no process is started.

`FakeRay` answers the calls the KubeRay simulator makes (submit, info, list, stop, logs) and,
as a service proxy handler of the loopback API server, the HTTP endpoints our KubeRay backend
reaches through the head Service (`/api/version`, `/api/jobs/<id>`, `.../stop`, `.../logs`).
An entrypoint `sleep <s>` runs for s seconds (else `duration_s`) and succeeds; one containing
`exit <n>` with n != 0 fails. A thousand jobs cost a dict entry each.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from ray.job_submission import JobStatus

_SLEEP = re.compile(r"\bsleep\s+([0-9.]+)")
_EXIT = re.compile(r"\bexit\s+(\d+)")
RAY_VERSION = "2.50.0"


@dataclass
class FakeJob:
    """One job: the attributes of Ray's JobDetails the simulator reads."""

    submission_id: str
    entrypoint: str
    start_time: int  # ms
    run_s: float
    exit_code: int
    stopped_at: int | None = None
    metadata: dict[str, str] | None = None

    @property
    def job_id(self) -> str:
        return self.submission_id

    @property
    def end_time(self) -> int | None:
        if self.stopped_at is not None:
            return self.stopped_at
        end = self.start_time + int(self.run_s * 1000)
        return end if time.time() * 1000 >= end else None

    @property
    def status(self) -> JobStatus:
        if self.stopped_at is not None:
            return JobStatus.STOPPED
        if self.end_time is None:
            return JobStatus.RUNNING
        return JobStatus.SUCCEEDED if self.exit_code == 0 else JobStatus.FAILED

    @property
    def message(self) -> str:
        status = self.status
        if status is JobStatus.FAILED:
            return f"Job entrypoint command failed with exit code {self.exit_code}"
        if status is JobStatus.STOPPED:
            return "Job was intentionally stopped."
        return "Job finished successfully." if status is JobStatus.SUCCEEDED else ""

    def details(self) -> dict[str, Any]:
        return {
            "type": "SUBMISSION", "job_id": None, "submission_id": self.submission_id,
            "status": self.status.value, "entrypoint": self.entrypoint, "message": self.message,
            "start_time": self.start_time, "end_time": self.end_time,
            "metadata": self.metadata or {}, "runtime_env": {},
            "driver_exit_code": self.exit_code if self.status is JobStatus.FAILED else None,
        }  # fmt: skip


class FakeRay:
    """In-memory Ray Jobs (see the module docstring); thread-safe."""

    def __init__(self, duration_s: float = 5.0) -> None:
        self.duration_s = duration_s
        self._jobs: dict[str, FakeJob] = {}
        self._lock = threading.Lock()

    # -- what the simulator calls (JobSubmissionClient's names) -----------------------------

    def submit_job(self, *, entrypoint: str, submission_id: str, **kwargs: Any) -> str:
        with self._lock:
            if submission_id in self._jobs:
                raise RuntimeError(f"Job with submission_id {submission_id} already exists.")
            sleep = _SLEEP.search(entrypoint)
            code = _EXIT.search(entrypoint)
            self._jobs[submission_id] = FakeJob(
                submission_id, entrypoint, int(time.time() * 1000),
                float(sleep.group(1)) if sleep else self.duration_s,
                int(code.group(1)) if code else 0, metadata=kwargs.get("metadata"),
            )  # fmt: skip
        return submission_id

    def get_job_info(self, job_id: str) -> FakeJob:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        return job

    def get_job_status(self, job_id: str) -> JobStatus:
        return self.get_job_info(job_id).status

    def list_jobs(self) -> list[FakeJob]:
        with self._lock:
            return list(self._jobs.values())

    def stop_job(self, job_id: str) -> bool:
        job = self.get_job_info(job_id)
        with self._lock:
            if job.status is not JobStatus.RUNNING:
                return False
            job.stopped_at = int(time.time() * 1000)
        return True

    def get_job_logs(self, job_id: str) -> str:
        job = self.get_job_info(job_id)
        return f"fake run of: {job.entrypoint}\n"

    def running(self) -> list[str]:
        """Ids of the jobs still running (what a test asserts is empty after a cancel)."""
        return [j.submission_id for j in self.list_jobs() if j.status is JobStatus.RUNNING]

    # -- the HTTP side, as a service proxy handler ------------------------------------------

    def handle(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        """Answer the Ray Jobs HTTP endpoints our backend uses through the service proxy."""
        parts = [p for p in path.split("?", 1)[0].split("/") if p]
        try:
            if parts == ["api", "version"]:
                return _json(200, {"version": "4", "ray_version": RAY_VERSION, "ray_commit": ""})
            if len(parts) >= 3 and parts[:2] == ["api", "jobs"]:
                job_id, rest = parts[2], parts[3:]
                if method == "GET" and not rest:
                    return _json(200, self.get_job_info(job_id).details())
                if method == "POST" and rest == ["stop"]:
                    return _json(200, {"stopped": self.stop_job(job_id)})
                if method == "GET" and rest == ["logs"]:
                    return _json(200, {"logs": self.get_job_logs(job_id)})
        except RuntimeError as exc:
            return _json(404, {"detail": str(exc)})
        return _json(404, {"detail": f"not served by the fake Ray: {method} {path}"})


def _json(code: int, payload: Any) -> tuple[int, dict[str, str], bytes]:
    return code, {"Content-Type": "application/json"}, json.dumps(payload).encode()
