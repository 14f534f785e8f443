"""Report progress and metrics from inside a job, to the Prefect flow that runs it.

Standard library only (no Prefect, nothing to install): a job imports it from the installed
package, or ships this one file with its code. Each call prints one line to stdout, which
every backend's log already carries to the flow (Ray Jobs, KubeRay, Kubeflow Trainer, Slurm,
Lepton, DGX Cloud, local); there the line becomes a progress artifact, a metrics table, a
chart per metric and rate-limited `prefect-nemo.job.progress` events.

    from prefect_nemo.report import progress
    progress(step=120, total=1000, loss=0.31, lr=2e-5)

prints `@@prefect-nemo.report {"step": 120, "total": 1000, "metrics": {"loss": 0.31, ...}}`.
Metrics are numbers; NaN and infinities travel as the strings "nan", "inf", "-inf" (the JSON
stays valid, and an automation can match a NaN loss). For PyTorch Lightning and NeMo, add
`progress_callback()` to the trainer's callbacks.

On Kubeflow Trainer with its `TrainJobStatus` feature on, the controller also gives each trainer
container the address of its status server (KUBEFLOW_TRAINER_SERVER_URL, with a CA and a token
file): `progress` then also posts the report there, at most once every STATUS_POST_S seconds and
on the last step, and the controller stores it as the TrainJob's `status.trainerStatus` (KEP-2779:
"Currently, users need to inspect logs to determine progress"). The log line stays the channel
every backend reads; a post that fails is said once on stderr and never stops training. Only
metrics named like identifiers (STATUS_METRIC_NAME) are posted: the job cannot tell which of its
env values are secret (the flow masks them in what it reads), and the TrainJob is stored as is.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import ssl
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

PREFIX = "@@prefect-nemo.report "
MAX_NAME_CHARS = 64  # a metric name longer than this is cut (it names a table row and a chart)
MAX_LINE_CHARS = 8192  # a longer line is not read as a report (a log line, not a payload)
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# the env the Trainer's TrainJobStatus plugin gives trainer containers (the CA and token are files;
# the token is projected by the kubelet and rotates, so it is read again for every post)
STATUS_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
STATUS_CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
STATUS_TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
STATUS_POST_S = 5.0  # at most one post this often (the last step always goes)
STATUS_TIMEOUT_S = 3.0
# metric names posted to the status server: the CRD allows 1-64 characters; a name with spaces
# or other text (which may carry a value of the job's env) stays in the log line only
STATUS_METRIC_NAME = re.compile(r"[A-Za-z0-9_./-]{1,64}")
STATUS_MAX_METRICS = 256  # the CRD's maxItems


@dataclass(frozen=True)
class Report:
    """One report of a job: its step (of total, when known) and metric values; `eta_s` is the
    engine's own estimate of the seconds left, where the engine keeps one (the Trainer's
    estimatedRemainingSeconds), never read from a line."""

    step: int | None = None
    total: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    eta_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        """What the report line carries: step and total when known, metrics JSON-safe."""
        data: dict[str, Any] = {}
        if self.step is not None:
            data["step"] = self.step
        if self.total is not None:
            data["total"] = self.total
        data["metrics"] = {name: encode_number(value) for name, value in self.metrics.items()}
        return data

    def describe(self) -> str:
        """The report in a few words: `step 120/1000 loss=0.31 lr=2e-05`."""
        words = []
        if self.step is not None:
            words.append(f"step {self.step}" + (f"/{self.total}" if self.total else ""))
        if self.metrics:
            words.append(metrics_text(self.metrics))
        return " ".join(words) or "an empty report"


def metrics_text(metrics: dict[str, float], limit: int = 8) -> str:
    """The first `limit` metrics as `name=value` pairs."""
    return " ".join(f"{name}={value:.4g}" for name, value in list(metrics.items())[:limit])


def encode_number(value: float) -> float | str:
    """A metric value as JSON takes it: NaN and infinities as "nan", "inf", "-inf"."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def format_line(step: int | None = None, total: int | None = None, **metrics: Any) -> str:
    """The report line `progress` prints (without its newline). TypeError for a metric that
    is no number, ValueError for a negative step or a total < 1."""
    report = Report(
        step=None if step is None else _count("step", step, least=0),
        total=None if total is None else _count("total", total, least=1),
        metrics={name: _number(name, value) for name, value in metrics.items()},
    )
    return PREFIX + json.dumps(report.as_json(), separators=(",", ":"))


def progress(step: int | None = None, total: int | None = None, **metrics: Any) -> None:
    """Report the job's step (of `total`) and metrics: one line on stdout, flushed at once.

    Metrics are numbers (int, float, or anything `float()` takes, e.g. a 0-d tensor); `step`
    and `total` are no metric names."""
    sys.stdout.write(format_line(step, total, **metrics) + "\n")
    sys.stdout.flush()
    if os.environ.get(STATUS_URL_ENV):
        _status.report(step, total, {name: _number(name, v) for name, v in metrics.items()})


def status_body(
    step: int | None, total: int | None, metrics: dict[str, float], eta_s: float | None = None
) -> dict[str, Any]:
    """The Trainer's UpdateTrainJobStatusRequest for one report: percent (whole, 0-100), ETA,
    metrics as strings (identifier names only), and the time (lastUpdatedTime is required)."""
    status: dict[str, Any] = {
        "lastUpdatedTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "metrics": [
            {"name": name, "value": str(encode_number(value))[:64]}
            for name, value in metrics.items() if STATUS_METRIC_NAME.fullmatch(name)
        ][:STATUS_MAX_METRICS],
    }  # fmt: skip
    if step is not None and total is not None:
        status["progressPercentage"] = min(100, int(100 * step / total))
    if eta_s is not None:
        status["estimatedRemainingSeconds"] = min(2**31 - 1, max(0, round(eta_s)))
    return {"trainerStatus": status}


class StatusPoster:
    """Posts reports to the Trainer's status server: rate-limited, never raising."""

    def __init__(self, every_s: float = STATUS_POST_S) -> None:
        self.every_s = every_s
        self._last_post = -math.inf
        self._first: tuple[float, int] | None = None  # (monotonic time, step): the rate's start
        self._failed = False  # a failure is said once

    def report(self, step: int | None, total: int | None, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        if step is not None and (self._first is None or step < self._first[1]):
            self._first = (now, step)  # the first report, or a restart from an earlier step
        last = step is not None and total is not None and step >= total
        if not last and now - self._last_post < self.every_s:
            return
        self._last_post = now
        eta = None
        if step is not None and total is not None and self._first is not None:
            t0, s0 = self._first
            if step > s0 and now > t0:
                eta = (total - step) * (now - t0) / (step - s0)
        try:
            self.post(status_body(step, total, metrics, eta))
        except Exception as exc:  # a status post never stops training
            if not self._failed:
                self._failed = True
                print(f"prefect-nemo: posting progress to {os.environ.get(STATUS_URL_ENV)} "
                      f"failed ({type(exc).__name__}: {exc}); the log line still reports it",
                      file=sys.stderr, flush=True)  # fmt: skip

    def post(self, body: dict[str, Any]) -> None:
        """One POST of `body` to the status server, with the token as read now."""
        url = os.environ[STATUS_URL_ENV]
        context = ssl.create_default_context(cafile=os.environ.get(STATUS_CA_ENV) or None)
        with open(os.environ[STATUS_TOKEN_ENV]) as f:
            token = f.read().strip()
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, context=context, timeout=STATUS_TIMEOUT_S) as resp:
            resp.read()


_status = StatusPoster()


def parse(line: str) -> Report | None:
    """The report a log line carries, or None for any other line (also a garbled report: a
    job's log is never an error). The marker may follow a launcher's prefix (torchrun's
    `[default0]:`, Slurm's task labels)."""
    at = line.find(PREFIX)
    if at < 0 or len(line) > MAX_LINE_CHARS:
        return None
    try:
        data = json.loads(line[at + len(PREFIX) :])
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    step, total, metrics = data.get("step"), data.get("total"), data.get("metrics") or {}
    if not isinstance(metrics, dict):
        return None
    values: dict[str, float] = {}
    for name, value in metrics.items():
        number = _decode(value)
        if number is not None and isinstance(name, str) and name:
            values[name[:MAX_NAME_CHARS]] = number
    return Report(step=_at_least(step, 0), total=_at_least(total, 1), metrics=values)


def _decode(value: Any) -> float | None:
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least(value: Any, least: int) -> int | None:
    """A whole number >= least read from a report, else None."""
    return int(value) if _is_int(value) and value >= least else None


def _count(name: str, value: Any, *, least: int) -> int:
    if not _is_int(value):
        try:
            value = int(value)  # a numpy or tensor integer
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool | str | bytes):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}") from None


# ---------------------------------------------------------------------------------------------
# PyTorch Lightning / NeMo


class ProgressCallback:
    """Reports a Lightning (or NeMo) trainer's step, max_steps and logged metrics every
    `every_n_steps` training steps, after each validation, and once when training ends.

    Duck-typed on `trainer.global_step`, `trainer.max_steps`, `trainer.callback_metrics` and
    `trainer.is_global_zero` (only rank 0 reports): this module imports no Lightning. Give a
    Trainer `progress_callback()`, which also derives from Lightning's `Callback` when
    Lightning is installed (the Trainer checks callbacks' types).
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._reported_step: int | None = None

    def report(self, trainer: Any) -> None:
        """Report the trainer's state now (rank 0 only)."""
        if not getattr(trainer, "is_global_zero", True):
            return
        step = int(getattr(trainer, "global_step", 0) or 0)
        max_steps = getattr(trainer, "max_steps", None)
        total = int(max_steps) if isinstance(max_steps, int) and max_steps > 0 else None
        metrics: dict[str, float] = {}
        for name, value in dict(getattr(trainer, "callback_metrics", None) or {}).items():
            if name in ("step", "total"):  # progress' own arguments, not metrics here
                continue
            try:  # a tensor of one value reports; anything else is left out, never raised
                metrics[str(name)] = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
        progress(step, total, **metrics)
        self._reported_step = step

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning hook: every `every_n_steps` optimizer steps."""
        step = int(getattr(trainer, "global_step", 0) or 0)
        if step % self.every_n_steps == 0 and step != self._reported_step:
            self.report(trainer)

    def on_validation_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning hook: the validation metrics, as soon as they are known."""
        if not getattr(trainer, "sanity_checking", False):
            self.report(trainer)

    def on_train_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning hook: the last step and metrics."""
        self.report(trainer)


def progress_callback(every_n_steps: int = 50) -> ProgressCallback:
    """A ProgressCallback for `Trainer(callbacks=[...])`: also a Lightning `Callback` when
    `lightning` (or `pytorch_lightning`) is installed; imported here, not at module import."""
    base: type | None = None
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            base = importlib.import_module(module).Callback
            break
        except ImportError:
            continue
    if base is None:
        return ProgressCallback(every_n_steps)
    cls = type("LightningProgressCallback", (ProgressCallback, base), {})
    callback: ProgressCallback = cls(every_n_steps)
    return callback
