"""`prefect-nemo doctor`: the preflight of a block before its first job, one row per check.

Each backend is asked about itself with its engine's own client: Kubernetes (credentials, the
CRDs its kinds need and the versions served, every RBAC verb it declares in `access()`), Ray
(the dashboard, the client and cluster versions, label selectors), Slurm (SSH, the commands,
the controller, accounting, account, partition, job dir), run:ai and Lepton (credentials,
project or node group); and this machine's clock against the Prefect server's (run leases
depend on it). No Prefect import here: `tasks/doctor.py` loads the blocks and reads the
Prefect server's clock.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import replace
from email.utils import parsedate_to_datetime
from typing import Any

from prefect_nemo.doctor.checks import THIS_MACHINE, Check, Status, failed, ok
from prefect_nemo.doctor.kube import cluster_checks, job_checks
from prefect_nemo.doctor.nemo_run import lepton_checks, runai_checks, slurm_checks
from prefect_nemo.doctor.ray import ray_checks
from prefect_nemo.errors import PrefectNemoError
from prefect_nemo.redaction import Redactor

__all__ = [
    "THIS_MACHINE",
    "Check",
    "Status",
    "check_backend",
    "clock_check",
    "cluster_checks",
    "failed",
    "ok",
    "stamp",
    "table",
]

CLOCK_WARN_S = 2.0  # an NTP-synced clock is within milliseconds: seconds mean no sync


# -- per block ------------------------------------------------------------------------------------


def check_backend(block: str, backend: Any, *, secrets: Iterable[str] = ()) -> list[Check]:
    """Every check of one block's backend, by its kind; secrets (the backend's and `secrets`)
    masked in every row. A check that breaks is a failed row, never a traceback."""
    kind = getattr(backend, "kind", "")
    try:
        rows = _checks_of(kind, backend)
    except ImportError as exc:  # the NeMo-Run backends build without nemo-run, then need it
        rows = [
            Check(
                "backend",
                Status.FAIL,
                f"the {kind} backend needs a package this machine lacks: {exc}",
                "pip install 'prefect-nemo[nemo-run]' on this machine",
            )
        ]
    except Exception as exc:  # the doctor reports; it does not crash on one block
        rows = [
            Check(
                "doctor",
                Status.FAIL,
                f"the checks of this {kind or 'block'} broke: {type(exc).__name__}: {exc}",
                "run again; if it persists, report it",
            )
        ]
    return stamp(block, rows, [*getattr(backend, "secrets", []), *secrets])


def stamp(block: str, rows: Sequence[Check], secrets: Iterable[str]) -> list[Check]:
    """The rows as `block`'s, every secret value masked in their text."""
    redact = Redactor(secrets)
    return [
        replace(row, block=block, detail=redact(row.detail), fix=redact(row.fix)) for row in rows
    ]


def _checks_of(kind: str, backend: Any) -> list[Check]:
    if kind == "ray-jobs":
        return ray_checks(backend)
    if kind in ("kuberay", "kubeflow-trainer"):
        return job_checks(backend)
    if kind == "slurm":
        return slurm_checks(backend)
    if kind in ("dgx-cloud", "dgx-cloud-ray"):
        return runai_checks(backend)
    if kind in ("lepton", "lepton-ray"):
        return lepton_checks(backend.lepton if kind == "lepton-ray" else backend)
    return _access_only(kind, backend)


def _access_only(kind: str, backend: Any) -> list[Check]:
    """A backend the doctor has no checks of its own for: its access check alone."""
    try:
        backend.check_access()
    except PrefectNemoError as exc:
        return [Check("access", Status.FAIL, str(exc), "see the message")]
    return [ok("access", f"the {kind} backend's access check passed")]


# -- this machine ---------------------------------------------------------------------------------


def clock_check(
    server_date: str | None, sent: float, received: float, *, heartbeat_s: float
) -> Check:
    """This machine's clock against the Prefect server's, from the Date header of an answer
    sent at `sent` and received at `received` (this machine's epoch seconds).

    Run leases are judged across machines: a run stamps its heartbeats with its own clock
    and grants itself two heartbeats; the sweeper compares them with its clock. A skew past
    one heartbeat (half the lease) makes a live run look silent between heartbeats and a
    dead one look alive. The Date header has whole seconds, so the skew is known to half a
    second plus half the round trip."""
    name = "clock vs Prefect"
    if not server_date:
        return Check(
            name,
            Status.WARN,
            "the Prefect server's answer had no Date header",
            "check the clock by hand (chronyc tracking / timedatectl)",
            THIS_MACHINE,
        )
    server = parsedate_to_datetime(server_date).timestamp() + 0.5  # the second's middle
    skew = server - (sent + received) / 2  # > 0: this machine is behind
    margin = 0.5 + (received - sent) / 2
    beyond = abs(skew) - margin  # how far it is off at the least
    where = "behind" if skew > 0 else "ahead of"
    detail = (
        f"this machine's clock is {abs(skew):.1f}s {where} the Prefect server's "
        f"(±{margin:.1f}s); run leases are {2 * heartbeat_s:g}s (heartbeats every "
        f"{heartbeat_s:g}s)"
    )
    fix = (
        "sync this machine's clock (NTP: chrony or systemd-timesyncd) and the Prefect "
        "server's: the sweeper compares run heartbeats with its own clock"
    )
    if beyond > heartbeat_s:
        return Check(name, Status.FAIL, detail, fix, THIS_MACHINE)
    if beyond > CLOCK_WARN_S:
        return Check(name, Status.WARN, detail, fix, THIS_MACHINE)
    return Check(name, Status.OK, detail, "", THIS_MACHINE)


# -- the table ------------------------------------------------------------------------------------

HEADERS = ("BLOCK", "CHECK", "STATUS", "DETAIL", "FIX")


def table(checks: Sequence[Check], width: int | None = None) -> str:
    """The checks as a text table (long cells wrapped), then a count of each outcome."""
    width = width or shutil.get_terminal_size((160, 24)).columns
    rows = [(c.block, c.name, str(c.status), c.detail, c.fix) for c in checks]
    fixed = [
        min(cap, max(len(HEADERS[i]), *(len(r[i]) for r in rows)) if rows else len(HEADERS[i]))
        for i, cap in enumerate((48, 40, 6))
    ]
    rest = max(40, width - sum(fixed) - 8)  # two spaces between columns
    widths = [*fixed, rest * 11 // 20, rest - rest * 11 // 20]
    lines = []
    for row in [HEADERS, *rows]:
        cells = [
            textwrap.wrap(text, w, break_on_hyphens=False) or [""]
            for text, w in zip(row, widths, strict=True)
        ]
        for i in range(max(len(c) for c in cells)):
            parts = [
                (c[i] if i < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)
            ]
            lines.append("  ".join(parts).rstrip())
    counts = {s: sum(c.status is s for c in checks) for s in Status}
    lines.append(
        f"\n{len(checks)} checks: {counts[Status.OK]} ok, {counts[Status.WARN]} warning(s), "
        f"{counts[Status.FAIL]} failed"
    )
    return "\n".join(lines)
