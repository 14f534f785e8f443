"""Every job's log kept on disk as it streams, readable after its cluster is gone. No Prefect here.

One file per job, `<logs dir>/<flow run id or 'no-flow-run'>/<job id>.log`: each line is
redacted and written through as it arrives (memory stays bounded by the file buffer, whatever
the log's length), the file readable by its owner only. A wait streams a job's log from its
top, so the file is rewritten when its first line arrives again (a re-attach, a task retry): it
holds the log once, never twice; a wait that reads no line (the cluster gone by then) leaves the
file as it was.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TextIO

from prefect_nemo.redaction import Redactor

#: Overrides the folder jobs' logs are saved under (default: ./.prefect-nemo/logs).
LOGS_DIR_ENV = "PREFECT_NEMO_LOGS_DIR"
NO_FLOW_RUN = "no-flow-run"

log = logging.getLogger(__name__)


def logs_dir(flow_run_id: str | None = None) -> Path:
    """Where the jobs of a flow run save their logs: $PREFECT_NEMO_LOGS_DIR, else the project's
    ``.prefect-nemo/logs`` (beside the CLI's other state), then the flow run's id."""
    env = os.environ.get(LOGS_DIR_ENV)
    root = Path(env).expanduser() if env else Path(".prefect-nemo", "logs")
    return root.absolute() / (flow_run_id or NO_FLOW_RUN)


class LogFile:
    """One job's saved log: `write` each line as it arrives, `close` once the log was read to
    its end. Lines are redacted before they reach the disk. Not thread-safe: the log stream
    hands it one line at a time. A disk error stops the saving, never the job's wait."""

    def __init__(self, path: Path, redact: Redactor) -> None:
        self.path = path
        self._redact = redact
        self._file: TextIO | None = None
        self.lines = 0  # lines written by this wait
        self.failed = False

    def write(self, line: str) -> None:
        """Append one line (the first one of this wait rewrites the file from the top)."""
        if self.failed:
            return
        try:
            if self._file is None:
                self._file = self._open()
            self._file.write(self._redact(line) + "\n")
        except OSError as exc:
            self._give_up(exc)
            return
        self.lines += 1

    def close(self) -> None:
        """Flush and close the file (no-op if no line came)."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as exc:
                self._give_up(exc)

    def _give_up(self, exc: OSError) -> None:
        log.warning("could not save the log to %s (%s); the rest is not saved", self.path, exc)
        self.failed = True
        self.close()

    def _open(self) -> TextIO:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # created 0600 (logs may hold what a job printed about its data); an older file keeps
        # its mode only if it is ours to rewrite, so set it again
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        return open(fd, "w", encoding="utf-8", errors="replace")  # closed in close()
