"""What a job's reports add up to: its latest step and metrics, its step rate and ETA, a
bounded history of each metric, and a chart of it (inline SVG in markdown). No Prefect here:
tasks/reporting.py publishes it. Memory is bounded whatever the job reports: MAX_METRICS
metrics, each keeping at most MAX_POINTS points (halved, every other one dropped, when full),
so a job of a million steps costs what a job of a thousand does.
"""

from __future__ import annotations

import math
from collections import deque
from html import escape
from typing import Any

from prefect_nemo.report import Report, encode_number, metrics_text

MAX_POINTS = 256  # per metric: a chart 480 px wide shows no more
MAX_METRICS = 32  # metrics kept per job; later names are counted, not kept
RATE_WINDOW_S = 60.0  # the step rate (and ETA) is measured over about the last minute
_CHART_W, _CHART_H, _PAD = 480, 120, 4
_LABEL = "#8a8a8a"  # the labels' grey: readable on the UI's light and dark themes


class Series:
    """One metric over steps, downsampled to at most `max_points` points (the latest kept)."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self.points: list[tuple[int, float]] = []
        self.stride = 1  # keep one point in `stride` of those reported
        self.last: tuple[int, float] | None = None
        self._since_kept = 0
        self.low, self.high = math.inf, -math.inf  # over every finite value, not just kept

    def add(self, step: int, value: float) -> None:
        """Take one value; the history keeps every stride-th, the latest always."""
        self.last = (step, value)
        if math.isfinite(value):
            self.low, self.high = min(self.low, value), max(self.high, value)
        self._since_kept += 1
        if self.points and self._since_kept < self.stride:
            return
        self._since_kept = 0
        self.points.append((step, value))
        if len(self.points) > self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def curve(self) -> list[tuple[int, float]]:
        """The kept points, then the latest if it was not kept."""
        if self.last is not None and (not self.points or self.points[-1] != self.last):
            return [*self.points, self.last]
        return list(self.points)


class JobProgress:
    """A job's reports so far: latest step, total and metrics; rate, ETA, history, chart."""

    def __init__(self) -> None:
        self.reports = 0
        self.step: int | None = None
        self.total: int | None = None
        self.metrics: dict[str, float] = {}
        self.metric_steps: dict[str, int] = {}  # the step each metric's latest value is of
        self.series: dict[str, Series] = {}
        self.dropped_metrics = 0  # names past MAX_METRICS
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, step)
        self.engine_eta_s: float | None = None  # the engine's own ETA, when it reports one

    def take(self, report: Report, now: float) -> None:
        """Add one report, made (received) at monotonic time `now`."""
        self.reports += 1
        self.engine_eta_s = report.eta_s
        if report.total is not None:
            self.total = report.total
        if report.step is not None:
            self.step = report.step
            self._sample(now, report.step)
        step = self.step if self.step is not None else self.reports
        for name, value in report.metrics.items():
            if name not in self.series:
                if len(self.series) >= MAX_METRICS:
                    self.dropped_metrics += 1
                    continue
                self.series[name] = Series()
            self.series[name].add(step, value)
            self.metrics[name] = value
            self.metric_steps[name] = step

    def _sample(self, now: float, step: int) -> None:
        samples = self._samples
        if samples and step < samples[-1][1]:
            samples.clear()  # the job restarted from an earlier step (a retry, a resume)
        if not samples or now - samples[-1][0] >= 1.0 or len(samples) == 1:
            samples.append((now, step))
        else:
            samples[-1] = (now, step)  # one sample a second: the window stays small
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()

    def percent(self) -> float | None:
        """Percent of total steps done (None without a total)."""
        if self.total is None or self.step is None:
            return None
        return min(100.0, 100.0 * self.step / self.total)

    def steps_per_s(self) -> float | None:
        """Steps a second over about the last minute (None before two steps in time)."""
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def eta_s(self) -> float | None:
        """Seconds until the last step: the engine's own estimate where its latest report
        has one (it knows its step times), else at the current rate (None without a total or
        rate)."""
        if self.engine_eta_s is not None:
            return self.engine_eta_s
        rate = self.steps_per_s()
        if rate is None or self.total is None or self.step is None:
            return None
        return max(0.0, (self.total - self.step) / rate)

    def describe(self) -> str:
        """One line: step k/N (p%), rate, ETA."""
        if self.step is None:
            return f"{self.reports} reports"
        text = f"step {self.step}" + (f"/{self.total}" if self.total else "")
        if (percent := self.percent()) is not None:
            text += f" ({percent:.1f}%)"
        if (rate := self.steps_per_s()) is not None:
            text += f", {rate:.3g} steps/s"
        if (eta := self.eta_s()) is not None:
            text += f", ETA {_duration(eta)}"
        return text

    def metrics_text(self, limit: int = 8) -> str:
        """The latest metrics as `name=value` pairs (the first `limit`)."""
        return metrics_text(self.metrics, limit)

    def payload(self) -> dict[str, Any]:
        """The event payload: step, total, percent, rate, ETA, metrics (JSON-safe numbers)."""
        rate, eta, percent = self.steps_per_s(), self.eta_s(), self.percent()
        return {
            "step": self.step,
            "total": self.total,
            "percent": round(percent, 2) if percent is not None else None,
            "steps_per_s": round(rate, 4) if rate is not None else None,
            "eta_s": round(eta, 1) if eta is not None else None,
            "metrics": {name: encode_number(value) for name, value in self.metrics.items()},
        }

    def table(self) -> list[dict[str, Any]]:
        """The metrics table: one row per metric, its latest value, step, min and max."""
        rows = []
        for name, value in self.metrics.items():
            series = self.series[name]
            seen = series.high >= series.low  # a finite value was seen
            rows.append({
                "metric": name,
                "value": encode_number(value),
                "step": self.metric_steps[name],
                "min": series.low if seen else None,
                "max": series.high if seen else None,
            })  # fmt: skip
        return rows

    def chart(self, title: str) -> str:
        """Markdown: the title, the progress line, and per metric an SVG line chart over
        steps with its latest value, min and max."""
        parts = [f"## {title}", "", escape(self.describe()), ""]
        for name, series in self.series.items():
            last = series.last
            latest = f"{last[1]:.6g} at step {last[0]}" if last else "none"
            seen = series.high >= series.low  # a finite value was seen
            span = f"min {series.low:.6g}, max {series.high:.6g}" if seen else ""
            parts += [f"### {escape(name)}", "", f"<div>{svg_line(series.curve(), name)}</div>", "",
                      f"latest {latest}" + (f"; {span}" if span else ""), ""]  # fmt: skip
        if self.dropped_metrics:
            parts.append(f"({self.dropped_metrics} values of metrics past the first "
                         f"{MAX_METRICS} were not kept)")  # fmt: skip
        return "\n".join(parts)


def svg_line(points: list[tuple[int, float]], label: str) -> str:
    """A small line chart of (step, value) points as one line of SVG (no blank lines: it stays
    one markdown HTML block; no style attributes: the Prefect UI's sanitizer drops them).
    Non-finite values are left out of the line."""
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    w, h, pad = _CHART_W, _CHART_H, _PAD
    text = f'font-size="10" fill="{_LABEL}"'
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" role="img" aria-label="{escape(label)}">'
            f'<rect width="{w}" height="{h}" fill="none" stroke="#d0d0d0"/>')  # fmt: skip
    if not finite:
        return head + f'<text x="{pad}" y="{h // 2}" {text}>no finite values</text></svg>'
    s0, s1 = finite[0][0], finite[-1][0]
    lo, hi = min(v for _, v in finite), max(v for _, v in finite)
    xspan, yspan = (s1 - s0) or 1, (hi - lo) or 1.0
    top, bottom = pad + 14, h - pad - 14  # room for the labels
    coords = " ".join(
        f"{pad + (s - s0) / xspan * (w - 2 * pad):.1f},"
        f"{bottom - (v - lo) / yspan * (bottom - top):.1f}"
        for s, v in finite
    )
    return (
        head
        + f'<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="{coords}"/>'
        + f'<text x="{pad}" y="{pad + 10}" {text}>{hi:.4g}</text>'
        + f'<text x="{pad}" y="{h - pad}" {text}>{lo:.4g} · step {s0}</text>'
        + f'<text x="{w - pad}" y="{h - pad}" {text} text-anchor="end">'
        + f"step {s1}</text></svg>"
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
