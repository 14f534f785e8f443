"""Ray's "Running entrypoint" line kept out of a job's own lines (prefect_nemo.backends.ray_logs).

Ray's job supervisor writes that line through a buffered file it hands to the job's process
before flushing it (ray/dashboard/modules/job/job_supervisor.py, `_exec_entrypoint`: the
`logs_file.write(f"Running entrypoint for job {self._job_id}: {self._entrypoint}\\n")` reaches
the file when its `with open(logs_path, "a")` block closes, after `subprocess.Popen(...,
stdout=logs_file)`). The texts below are what CI's real KubeRay run read back."""

from __future__ import annotations

import pytest

from prefect_nemo.backends import ray_logs

JOB = "marvellous-quokka-ten-thousand-lin-eaf97708"
ENTRYPOINT = "seq -f 'line %05g' 0 9999"
RAY_LINE = f"Running entrypoint for job {JOB}: {ENTRYPOINT}\n"
JOB_LINES = "".join(f"line {n:05d}\n" for n in range(2600, 2610))
# as CI read it: Ray's line landed 6 characters into "line 02606"
CUT = JOB_LINES.replace("line 02606\n", "line 0" + RAY_LINE + "2606\n")
WANTED = JOB_LINES.replace("line 02606\n", RAY_LINE + "line 02606\n")


def test_rays_line_that_cut_a_job_line_goes_in_front_of_it() -> None:
    assert ray_logs.cut_at(CUT, JOB) == CUT.index("Running")
    assert ray_logs.mended(CUT, JOB, ENTRYPOINT) == WANTED
    assert len(ray_logs.mended(CUT, JOB, ENTRYPOINT)) == len(CUT), "offsets keep their meaning"


def test_rays_line_at_a_line_start_or_absent_is_left_as_it_is() -> None:
    for text in (RAY_LINE + JOB_LINES, JOB_LINES, WANTED, ""):
        assert ray_logs.cut_at(text, JOB) is None
        assert ray_logs.mended(text, JOB, ENTRYPOINT) is text


def test_an_entrypoint_with_newlines_is_moved_whole() -> None:
    entrypoint = "echo a &&\necho b"
    ray_line = f"Running entrypoint for job {JOB}: {entrypoint}\n"
    cut = "one\ntw" + ray_line + "o\nthree\n"
    assert ray_logs.mended(cut, JOB, entrypoint) == "one\n" + ray_line + "two\nthree\n"


def test_text_that_only_looks_like_rays_line_is_not_moved() -> None:
    text = f"x Running entrypoint for job {JOB}: something else\n"
    assert ray_logs.mended(text, JOB, ENTRYPOINT) is text


def _streamed(chunks: list[str], entrypoint: str = ENTRYPOINT) -> tuple[str, int]:
    """What a LineMender passes on for these chunks, and how often it asked the entrypoint."""
    mender, out, asked = ray_logs.LineMender(JOB), [], 0
    for chunk in chunks:
        out.append(mender.feed(chunk))
        if mender.wants_entrypoint:
            asked += 1
            mender.entrypoint = entrypoint
            out.append(mender.feed(""))
    out.append(mender.flush())
    return "".join(out), asked


@pytest.mark.parametrize("text", [CUT, RAY_LINE + JOB_LINES, JOB_LINES + "no newline at the end"])
def test_a_streamed_log_split_anywhere_comes_out_as_the_whole_one_mended(text: str) -> None:
    wanted = ray_logs.mended(text, JOB, ENTRYPOINT)
    for cut in range(len(text) + 1):
        got, asked = _streamed([text[:cut], text[cut:]])
        assert got == wanted, cut
        assert asked == (1 if text is CUT else 0), "the entrypoint is asked only for a cut line"
    assert _streamed(list(text))[0] == wanted, "one character at a time"


def test_the_stream_passes_complete_lines_at_once_and_holds_only_an_unfinished_one() -> None:
    mender = ray_logs.LineMender(JOB)
    assert mender.feed("line 00000\nline 00001\nline 0") == "line 00000\nline 00001\n"
    assert mender.feed("0002\n") == "line 00002\n"
    assert mender.feed(RAY_LINE) == RAY_LINE
    assert mender.feed("after Ray's line, as it comes") == "after Ray's line, as it comes"


def test_the_stream_stops_looking_for_rays_line_after_its_first_mebibyte() -> None:
    mender = ray_logs.LineMender(JOB)
    big = "x" * ray_logs.LineMender.LOOK_CHARS  # one unfinished line, no Ray line in it
    assert mender.feed(big) == big
    assert mender.feed("rest") == "rest"
