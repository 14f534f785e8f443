"""Every job's log saved as it streams (issue 29, "Logs to the last line, kept after teardown"):
the saver alone, and the shared log pump feeding it. No cluster, no server."""

from __future__ import annotations

import stat
import time
import tracemalloc
from pathlib import Path

import pytest

from prefect_nemo import log_files, redaction
from prefect_nemo.jobs import JobHandle, JobState, JobStatus
from prefect_nemo.lifecycle import QuietObserver, Supervisor, WaitPolicy, _LogStream
from prefect_nemo.log_files import LOGS_DIR_ENV, NO_FLOW_RUN, LogFile, logs_dir
from prefect_nemo.logs import log_pump
from prefect_nemo.redaction import MASK, Redactor

SECRET = "s3cr3t-token-9d41"


def test_writing_10000_lines_keeps_memory_bounded(tmp_path: Path) -> None:
    """ "every job's whole log is saved as it streams (bounded memory ...)": lines are written
    through, none kept: after 10,000 lines of ~120 characters (1.2 MB) what the saver and the
    redactor still hold is far less than the log. Counted by where it was allocated: in a
    session with a Prefect server and Ray alive, the process-wide peak counts their threads."""
    saved = LogFile(tmp_path / "j.log", Redactor([SECRET]))
    line = "x" * 110
    saved.write("warm-up")  # the file and its buffer exist before we measure
    tracemalloc.start()
    try:
        for n in range(10_000):
            saved.write(f"{n:06d} {line}")
        ours = [tracemalloc.Filter(True, m.__file__) for m in (log_files, redaction)]
        held = sum(t.size for t in tracemalloc.take_snapshot().filter_traces(ours).traces)
    finally:
        tracemalloc.stop()
    saved.close()
    text = (tmp_path / "j.log").read_text()
    assert len(text) > 1_000_000
    assert held < 64 * 1024, f"{held} bytes held after writing {len(text)} bytes"
    assert text.splitlines()[1:] == [f"{n:06d} {line}" for n in range(10_000)]


def test_the_file_is_its_owners_only_and_holds_no_secret(tmp_path: Path) -> None:
    """ "secrets must never reach files on disk": each line is redacted before it is written;
    the folder is 0700, the file 0600 (also when an older, wider file is rewritten)."""
    folder = tmp_path / "logs" / "flow-run"
    path = folder / "job.log"
    folder.mkdir(parents=True)
    path.write_text("old\n")
    path.chmod(0o644)
    saved = LogFile(path, Redactor([SECRET]))
    saved.write(f"token={SECRET} in the middle")
    saved.write(SECRET)
    saved.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = path.read_bytes()
    assert SECRET.encode() not in data
    assert data.decode().splitlines() == [f"token={MASK} in the middle", MASK]
    fresh = tmp_path / "new" / "deeper" / "job.log"
    LogFile(fresh, Redactor()).write("a")
    assert stat.S_IMODE(fresh.parent.stat().st_mode) == 0o700


def test_a_new_wait_rewrites_the_file_and_one_that_reads_nothing_keeps_it(tmp_path: Path) -> None:
    """A re-attach streams the log from its top again: the file holds it once, not twice; a
    wait that read no line (the cluster gone) leaves the earlier file as it was."""
    path = tmp_path / "job.log"
    for _ in range(2):
        saved = LogFile(path, Redactor())
        for n in range(3):
            saved.write(f"line {n}")
        saved.close()
    assert path.read_text() == "line 0\nline 1\nline 2\n"
    LogFile(path, Redactor()).close()
    assert path.read_text() == "line 0\nline 1\nline 2\n"


def test_logs_dir_is_per_flow_run_under_the_project_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LOGS_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert logs_dir("abc") == tmp_path / ".prefect-nemo" / "logs" / "abc"
    assert logs_dir(None) == tmp_path / ".prefect-nemo" / "logs" / NO_FLOW_RUN
    monkeypatch.setenv(LOGS_DIR_ENV, str(tmp_path / "elsewhere"))
    assert logs_dir("abc") == tmp_path / "elsewhere" / "abc"


class _Streamed:
    """A backend whose log stream broke off mid-line; its full read has the whole log, the
    last line with no newline (printed right before exit)."""

    def __init__(self, whole: str, streamed: int) -> None:
        self.whole, self.streamed = whole, streamed

    async def tail_logs(self, job_id: str):  # type: ignore[no-untyped-def]
        yield self.whole[: self.streamed // 2]
        yield self.whole[self.streamed // 2 : self.streamed]

    def logs(self, job_id: str) -> str:
        return self.whole


class _Seen(QuietObserver):
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.saved: list[Path] = []

    def log(self, handle: JobHandle, line: str) -> None:
        self.lines.append(line)

    def log_saved(self, handle: JobHandle, path: Path) -> None:
        self.saved.append(path)


def test_the_followed_lines_and_the_read_after_the_end_are_saved_once_each(tmp_path: Path) -> None:
    """ "the driver / pod log is read to its end after the terminal state (a line printed right
    before exit always arrives)": what the stream delivered is not sent again, the full read
    after the end sends the rest (the half line the stream cut, the last line without its
    newline), the task log and the file get every line once, in order, secrets masked."""
    lines = [f"line {n:05d}" for n in range(1000)] + [f"uses {SECRET}", "last words"]
    whole = "\n".join(lines)  # no newline after the last line
    backend = _Streamed(whole, streamed=len(whole) // 2 + 3)  # cut in the middle of a line
    seen = _Seen()
    supervisor = Supervisor(
        backend,  # type: ignore[arg-type]
        WaitPolicy(log_dir=tmp_path),
        seen,
        redact=Redactor([SECRET]),
    )
    handle = JobHandle(backend="fake", cluster="here", job_id="job-1")
    stream = _LogStream(supervisor, handle)
    stream._follower = log_pump.follow(backend, "job-1", stream._sink, is_done=lambda: True)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while len(seen.lines) < 500 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 < len(seen.lines) < len(lines), "the stream delivered a part"
    stream.update(JobStatus(job_id="job-1", state=JobState.SUCCEEDED))
    assert seen.lines == lines  # the observer redacts its own copy (JobReporter.log)
    assert seen.saved == [tmp_path / "job-1.log"]
    saved = seen.saved[0].read_text().splitlines()
    assert saved == [*lines[:-2], f"uses {MASK}", "last words"]
    stream.close()
    assert seen.saved == [tmp_path / "job-1.log"], "told once"


def test_without_a_log_dir_nothing_is_saved(tmp_path: Path) -> None:
    backend = _Streamed("a\nb\n", streamed=0)
    seen = _Seen()
    supervisor = Supervisor(backend, WaitPolicy(), seen)  # type: ignore[arg-type]
    stream = _LogStream(supervisor, JobHandle(backend="fake", cluster="here", job_id="j"))
    stream.update(JobStatus(job_id="j", state=JobState.FAILED))
    assert seen.lines == ["a", "b"] and seen.saved == []


def test_a_log_not_streamed_is_read_whole_once_it_ended_into_the_file_alone(
    tmp_path: Path,
) -> None:
    """ "every job's whole log is saved": a wait that does not follow the log (run_jobs'
    default) reads it once when the job ended, into the file, not the task log; that read is
    `whole` (a failed job's tail needs no second read)."""
    backend = _Counted(f"a\nuses {SECRET}\nlast")
    seen = _Seen()
    policy = WaitPolicy(log_dir=tmp_path, stream_logs=False)
    supervisor = Supervisor(backend, policy, seen, redact=Redactor([SECRET]))  # type: ignore[arg-type]
    stream = _LogStream(supervisor, JobHandle(backend="fake", cluster="here", job_id="j"))
    stream.update(JobStatus(job_id="j", state=JobState.RUNNING))
    assert backend.reads == 0, "not followed"
    stream.update(JobStatus(job_id="j", state=JobState.FAILED))
    stream.close()
    assert backend.reads == 1 and stream.whole == backend.whole
    assert seen.lines == [] and seen.saved == [tmp_path / "j.log"]
    assert (tmp_path / "j.log").read_text() == f"a\nuses {MASK}\nlast\n"


def test_a_stopped_job_not_streamed_is_saved_and_one_that_never_ran_reads_nothing(
    tmp_path: Path,
) -> None:
    backend = _Counted("a\nb\n")
    seen = _Seen()
    supervisor = Supervisor(backend, WaitPolicy(log_dir=tmp_path, stream_logs=False), seen)  # type: ignore[arg-type]
    never = _LogStream(supervisor, JobHandle(backend="fake", cluster="here", job_id="never"))
    never.update(JobStatus(job_id="never", state=JobState.QUEUED))
    never.close()  # e.g. its queue timeout stopped it
    assert backend.reads == 0 and seen.saved == []
    stopped = _LogStream(supervisor, JobHandle(backend="fake", cluster="here", job_id="stopped"))
    stopped.update(JobStatus(job_id="stopped", state=JobState.RUNNING))
    stopped.close()  # a timeout stopped it: its log is read as a followed one's would be
    assert backend.reads == 1 and seen.saved == [tmp_path / "stopped.log"]
    assert (tmp_path / "stopped.log").read_text() == "a\nb\n"


class _Counted:
    """A backend whose log is read whole only, counting the reads."""

    def __init__(self, whole: str) -> None:
        self.whole, self.reads = whole, 0

    def logs(self, job_id: str) -> str:
        self.reads += 1
        return self.whole


def test_a_succeeded_job_not_streamed_is_not_read(tmp_path: Path) -> None:
    """run_jobs' default: a job that succeeded costs no log read (its request budget)."""
    backend = _Counted("a\n")
    seen = _Seen()
    supervisor = Supervisor(backend, WaitPolicy(log_dir=tmp_path, stream_logs=False), seen)  # type: ignore[arg-type]
    stream = _LogStream(supervisor, JobHandle(backend="fake", cluster="here", job_id="ok"))
    stream.update(JobStatus(job_id="ok", state=JobState.RUNNING))
    stream.update(JobStatus(job_id="ok", state=JobState.SUCCEEDED))
    stream.close()
    assert backend.reads == 0 and seen.saved == [] and not (tmp_path / "ok.log").exists()
