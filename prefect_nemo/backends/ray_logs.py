"""A Ray job's log as the job wrote it: Ray's own "Running entrypoint" line kept out of its lines.

Ray's job supervisor writes `Running entrypoint for job <id>: <entrypoint>` into the job's log
file through a buffered Python file, and hands the same file to the job's process before that
buffer is flushed (`_exec_entrypoint` in ray/dashboard/modules/job/job_supervisor.py: the line is
written when its `with open(...)` block closes, after `Popen`). A job that prints at once can
therefore have Ray's line land inside one of its own: seen in CI as
`line 0Running entrypoint for job <id>: seq -f 'line %05g' 0 9999` followed by `2606`.

Ray writes its line with one `write` of a few hundred bytes, so wherever its start is in the
file, all of it is. `mended` moves it to the start of the line it cut. It changes only that
line and what follows it up to the end of Ray's line, and keeps the text's length, so an offset
into the mended log of a complete line before it means the same in the raw log and in any later,
longer read of it. `LineMender` does the same to a log that arrives in chunks.
"""

from __future__ import annotations


def marker(job_id: str) -> str:
    """How Ray's line starts."""
    return f"Running entrypoint for job {job_id}: "


def ray_line(job_id: str, entrypoint: str) -> str:
    """Ray's whole line, as its supervisor writes it."""
    return f"{marker(job_id)}{entrypoint}\n"


def cut_at(text: str, job_id: str) -> int | None:
    """Where Ray's line starts inside one of the job's lines, or None (absent, or at a line's
    start, where it cuts nothing)."""
    at = text.find(marker(job_id))
    return at if at > 0 and text[at - 1] != "\n" else None


def mended(text: str, job_id: str, entrypoint: str) -> str:
    """`text` with Ray's line moved to the start of the line it cut (unchanged when it cut
    none, or when what follows the marker is not Ray's whole line)."""
    at, line = cut_at(text, job_id), ray_line(job_id, entrypoint)
    if at is None or not text.startswith(line, at):
        return text
    start = text.rfind("\n", 0, at) + 1
    return text[:start] + line + text[start:at] + text[at + len(line) :]


class LineMender:
    """`mended` for a log read in chunks: each `feed` returns the complete lines it can vouch
    for and holds the last, unfinished one back, until Ray's line has been seen (or the first
    `LOOK_CHARS` of the log went by without it: Ray writes it as the job starts).

    When Ray's line cut one of the job's, the job's entrypoint is needed to know where Ray's
    line ends (an entrypoint may hold newlines): `wants_entrypoint` says so; the caller sets
    `entrypoint` and feeds "" again.
    """

    LOOK_CHARS = 1 << 20

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.entrypoint: str | None = None
        self._marker = marker(job_id)
        self._held = ""
        self._looked = 0  # characters fed so far
        self._done = False

    @property
    def wants_entrypoint(self) -> bool:
        return (
            not self._done
            and self.entrypoint is None
            and cut_at(self._held, self.job_id) is not None
        )

    def feed(self, chunk: str) -> str:
        """The text that can go on now."""
        if self._done:
            return chunk
        text, self._looked = self._held + chunk, self._looked + len(chunk)
        at = text.find(self._marker)
        if at < 0 and self._looked < self.LOOK_CHARS:
            end = text.rfind("\n") + 1
            self._held = text[end:]
            return text[:end]
        if at > 0 and text[at - 1] != "\n":  # Ray's line cut one of the job's
            entrypoint = self.entrypoint
            if entrypoint is None or len(text) < at + len(ray_line(self.job_id, entrypoint)):
                self._held = text  # until the entrypoint is known and Ray's line is all here
                return ""
            text = mended(text, self.job_id, entrypoint)
        self._done, self._held = True, ""
        return text

    def flush(self) -> str:
        """What is still held (the stream ended)."""
        text, self._held = self._held, ""
        return text
