"""The sweeper: stops the jobs of flow runs that died without a word (SIGKILL, the OOM killer, a
lost node), from outside the process that submitted them.

Every job we submit carries the flow run that submitted it (`jobs.META_FLOW_RUN`, read back by
`Backend.owned_jobs()` from the job itself: Ray metadata, Kubernetes labels, a Slurm job's
comment, Lepton and run:ai labels). Every run that submitted or waits on jobs emits
`prefect-nemo.run.heartbeat` naming them while it lives (`tasks/_run.py`). A job is stopped when
nobody vouches for it:

- a heartbeat of a run that waits on it (a retry or a re-run that attached counts) named it
  within the lease that heartbeat grants (plus EVENTS_DELAY_S: the API shows events late): kept;
- a `prefect-nemo.job.stop-pending` event says a stop was asked for and never confirmed (the
  cluster was unreachable): stopped now, whatever its run says;
- its run COMPLETED: kept (a job submitted and not waited for was left running on purpose);
- its run FAILED, CRASHED or CANCELLED, or is gone, or has stopped renewing its lease (the
  run's newest job submission counts as its heartbeat until one is readable, so a dead run's
  jobs are stopped together): stopped once that has lasted `sweep_grace_s` (the block's
  setting), so a retry of a crashed run that comes within the grace attaches instead.

What was stopped is reported: a table artifact of the sweep's run and a `prefect-nemo.job.swept`
event per job, with the time the job ran until the stop (`wasted_run_s`, where the cluster
says its start and end: its GPUs worked for a run that was gone) and, where the job's submission
event says its GPUs, the GPU-hours and cost of that time (`wasted_gpu_hours`, `wasted_cost` at
the block's `gpu_hour_price`). A job we did not submit is never listed, so never touched.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.errors import InvalidJobSpec, PrefectNemoError
from prefect_nemo.jobs import JobHandle, OwnedJob
from prefect_nemo.lifecycle import stop_and_confirm
from prefect_nemo.redaction import Redactor
from prefect_nemo.tasks._blocks import cluster_block_types, resolve_block, saved_block_names
from prefect_nemo.tasks._run import current_run
from prefect_nemo.tasks._run_watch import HEARTBEAT_EVENT
from prefect_nemo.tasks.artifacts import RunTable
from prefect_nemo.tasks.reporting import emit, job_resource, say
from prefect_nemo.usage import JobShape, cost, gpu_hours

# How long a sign of life that carries no lease of its own counts: a job's submission, Prefect's
# own flow-run heartbeat (PREFECT_RUNNER_HEARTBEAT_FREQUENCY is at least 30 s).
LEASE_S = 90.0
HEARTBEAT_LOOKBACK = timedelta(minutes=30)
STOP_PENDING_EVENT = "prefect-nemo.job.stop-pending"
# a job's submission (or a re-run's attach): their payload's `shape` says the job's GPUs
SUBMITTED_EVENTS = ["prefect-nemo.job.submitted", "prefect-nemo.job.attached"]
SWEPT_EVENT = "prefect-nemo.job.swept"
CONFIRM_S = 15.0  # how long one sweep waits to see a stop confirmed
# Prefect's own liveness signal of worker and served runs (PREFECT_RUNNER_HEARTBEAT_FREQUENCY)
PREFECT_HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
# Prefect's event persister writes events in batches, "the maximum number of seconds between
# flushes" being 5 (PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL): the newest heartbeats
# may not be readable yet, so each vouches this much past its lease (twice the default flush).
EVENTS_DELAY_S = 10.0
LOOKBACK = timedelta(days=2)  # how far back stop-pending records are honoured
FAILED_RUN_STATES = {StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


@dataclass(frozen=True)
class Verdict:
    """What the sweeper decided about one job, and why."""

    block: str
    cluster: str
    job_id: str
    owner: str | None
    stop: bool
    why: str
    outcome: str = ""
    wasted_run_s: float | None = None  # from the job's start to its stop, stopped jobs only
    wasted_gpu_hours: float | None = None  # of wasted_run_s, where the job's GPUs are known
    wasted_cost: float | None = None  # of those GPU-hours, at the block's gpu_hour_price


@dataclass(frozen=True)
class Beat:
    """A heartbeat: when it was sent and until when it vouches."""

    at: datetime
    until: datetime


@dataclass(frozen=True)
class Evidence:
    """What the Prefect API says about the runs and jobs of a sweep."""

    now: datetime
    beats: dict[tuple[str, str], Beat]  # (cluster, job id) -> newest heartbeat naming it
    run_beats: dict[str, Beat]  # flow run id -> newest heartbeat of the run
    pending: dict[tuple[str, str], datetime]  # (cluster, job id) -> newest stop-pending record
    runs: dict[str, Any]  # flow run id -> FlowRun (absent: no such run)
    # flow run id -> the newest submission among its listed jobs: the run was alive then
    run_submitted: dict[str, datetime] = field(default_factory=dict)


def judge(
    block: str, cluster: str, job: OwnedJob, evidence: Evidence, grace_s: float, lease_s: float
) -> Verdict:
    """The rule of the module docstring, for one job (`lease_s`: how long a sign of life
    without its own lease counts, e.g. the job's submission)."""

    def verdict(stop: bool, why: str) -> Verdict:
        return Verdict(block, cluster, job.job_id, job.flow_run_id, stop, why)

    key = (cluster, job.job_id)
    beat = evidence.beats.get(key)
    pending = evidence.pending.get(key)
    if pending is not None and (beat is None or beat.at < pending):
        return verdict(True, f"a stop asked for at {pending:%H:%M:%S} was never confirmed")
    if beat is not None and evidence.now <= beat.until:
        return verdict(False, f"a run named it {(evidence.now - beat.at).total_seconds():.0f}s ago")
    owner = job.flow_run_id
    if not owner:
        return verdict(False, "it names no flow run (submitted outside any run)")
    run = evidence.runs.get(owner)
    state = run.state.type if run is not None and run.state is not None else None
    if state is StateType.COMPLETED:
        return verdict(False, "its run completed: left running on purpose")
    if run is None:
        dead_since = beat.until if beat else job.submitted_at or evidence.now
        why = "its flow run no longer exists"
    elif state in FAILED_RUN_STATES:
        dead_since = run.state.timestamp
        why = f"its flow run is {state.value}"
    else:
        # the run's newest submission stands in for its heartbeat until one is readable (a
        # later lease must not outlast the heartbeats of a run killed just after it submitted);
        # the run's, not the job's: a dead run's jobs die together, whenever each was submitted
        signs = [beat, evidence.run_beats.get(owner)]
        submitted = evidence.run_submitted.get(owner, job.submitted_at)
        if submitted is not None and not any(signs):
            signs.append(Beat(submitted, submitted + timedelta(seconds=lease_s)))
        dead_since = max((b.until for b in signs if b is not None), default=evidence.now)
        if dead_since > evidence.now:
            return verdict(False, f"its run is {state.value if state else 'unknown'} and alive")
        why = f"its run is {state.value if state else 'unknown'} but stopped saying it is alive"
    dead_for = (evidence.now - dead_since).total_seconds()
    if dead_for < grace_s:
        return verdict(False, f"{why}; within the grace ({dead_for:.0f}s of {grace_s:g}s)")
    return verdict(True, f"{why} ({dead_for:.0f}s, past the grace of {grace_s:g}s)")


def gather_evidence(jobs: Sequence[OwnedJob], lease_s: float) -> Evidence:
    """Recent heartbeats (ours carry their lease; Prefect's own get `lease_s`; each vouches
    EVENTS_DELAY_S longer, as newer ones may not be readable yet), stop-pending
    records, and the owner runs of `jobs`, from the Prefect API: three reads, whatever the
    number of jobs."""
    now = datetime.now(UTC)
    owners = {job.flow_run_id for job in jobs if job.flow_run_id}
    run_submitted: dict[str, datetime] = {}
    for job in jobs:
        if job.flow_run_id and job.submitted_at is not None:
            newest = run_submitted.get(job.flow_run_id, job.submitted_at)
            run_submitted[job.flow_run_id] = max(newest, job.submitted_at)
    beats: dict[tuple[str, str], Beat] = {}
    run_beats: dict[str, Beat] = {}
    pending: dict[tuple[str, str], datetime] = {}

    def newer(old: Beat | None, new: Beat) -> Beat:
        return new if old is None or new.at > old.at else old

    with get_client(sync_client=True) as client:
        since = now - HEARTBEAT_LOOKBACK
        for event in read_events(client, since, name=[HEARTBEAT_EVENT, PREFECT_HEARTBEAT_EVENT]):
            resource, payload = event["resource"], event.get("payload") or {}
            run_id = resource.get("prefect-nemo.flow-run-id") or resource[
                "prefect.resource.id"
            ].removeprefix("prefect.flow-run.")
            at = _time(event["occurred"])
            vouches_s = float(payload.get("lease_s", lease_s)) + EVENTS_DELAY_S
            beat = Beat(at, at + timedelta(seconds=vouches_s))
            run_beats[run_id] = newer(run_beats.get(run_id), beat)
            for job in payload.get("jobs", []):
                key = (job["cluster"], job["job_id"])
                beats[key] = newer(beats.get(key), beat)
        for event in read_events(client, now - LOOKBACK, name=[STOP_PENDING_EVENT]):
            resource = event["resource"]
            key = (resource.get("prefect-nemo.cluster", ""), resource["prefect.resource.name"])
            when = _time(event["occurred"])
            pending[key] = max(when, pending.get(key, when))
        ids = sorted({o for o in owners if _is_uuid(o)})
        runs = (
            client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            if ids
            else []
        )
    return Evidence(now, beats, run_beats, pending, {str(r.id): r for r in runs}, run_submitted)


def read_events(
    client: Any, since: datetime, *, resources: Sequence[str] = (), **names: list[str]
) -> list[dict[str, Any]]:
    """Every event since `since` of these names (an EventNameFilter: `name=[...]`,
    `prefix=[...]`), about these resource ids if any are given, all pages, as the API
    returns them."""
    query: dict[str, Any] = {
        "occurred": {"since": since.isoformat(), "until": datetime.now(UTC).isoformat()},
        "event": names,
    }
    if resources:
        query["resource"] = {"id": list(resources)}
    body = {"filter": query, "limit": 50}  # the API's page size limit
    page = client.request("POST", "/events/filter", json=body).json()
    events = list(page.get("events") or [])
    while page.get("next_page"):
        page = client._client.get(page["next_page"]).json()
        events += page.get("events") or []
    return events


def submitted_shapes(handles: Iterable[JobHandle]) -> dict[str, JobShape]:
    """The GPUs each job's newest submission (or attach) event says it holds, by the job's
    resource id: one read for all of them. A job whose event is gone or names no GPUs is not
    in it."""
    ids = sorted({handle.resource_id for handle in handles})
    if not ids:
        return {}
    with get_client(sync_client=True) as client:
        found = read_events(client, datetime.now(UTC) - LOOKBACK, resources=ids,
                            name=SUBMITTED_EVENTS)  # fmt: skip
    shapes: dict[str, JobShape] = {}
    for event in sorted(found, key=lambda e: e["occurred"]):
        if shape := (event.get("payload") or {}).get("shape"):
            shapes[event["resource"]["prefect.resource.id"]] = JobShape.model_validate(shape)
    return shapes


def sweep(
    blocks: Sequence[ClusterBlock | str] = (),
    *,
    lease_s: float = LEASE_S,
    dry_run: bool = False,
) -> list[Verdict]:
    """Judge every job prefect-nemo submitted to these clusters (default: every saved cluster
    block) and stop the ones nobody vouches for (in parallel; not with `dry_run`); returns
    every verdict. A named block that cannot be loaded fails first (InvalidJobSpec); a cluster
    that cannot be reached is reported and the others are swept."""
    run = current_run()
    targets = _targets(blocks, run)
    found: list[tuple[str, ClusterBlock, Any, list[OwnedJob]]] = []
    for name, block in targets:
        backend = None
        try:
            backend = block.backend()
            found.append((name, block, backend, backend.owned_jobs()))
        except PrefectNemoError as exc:
            redact = Redactor(backend.secrets if backend is not None else ())
            say(run, logging.ERROR, redact(
                f"sweep: cannot list the jobs of {name}, so none of them was judged or stopped "
                f"(the other clusters are swept): {exc}"))  # fmt: skip
    evidence = gather_evidence([job for *_, jobs in found for job in jobs], lease_s)
    judged: list[tuple[Any, ClusterBlock, OwnedJob, Verdict]] = []
    for name, block, backend, jobs in found:
        for job in jobs:
            verdict = judge(name, backend.cluster, job, evidence, block.sweep_grace_s, lease_s)
            judged.append((backend, block, job, verdict))
    verdicts = [verdict for *_, verdict in judged]
    todo = [] if dry_run else [n for n, verdict in enumerate(verdicts) if verdict.stop]
    if todo:  # each stop waits for its confirmation: in parallel, each in this run's context
        handles = {n: judged[n][0].handle(judged[n][2].job_id) for n in todo}
        shapes = submitted_shapes(handles.values())
        with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
            futures = [
                pool.submit(_stop_in, contextvars.copy_context(), judged[n], handles[n],
                            shapes.get(handles[n].resource_id))
                for n in todo
            ]  # fmt: skip
            for n, future in zip(todo, futures, strict=True):
                verdicts[n] = future.result()
    _report(run, verdicts, dry_run)
    return verdicts


def _targets(blocks: Sequence[ClusterBlock | str], run: Any) -> list[tuple[str, ClusterBlock]]:
    """(name, block) of each block to sweep; every saved cluster block when none is named.
    A named block that cannot be loaded is bad input: InvalidJobSpec before anything is
    judged; a saved one that cannot is reported and the others are swept."""
    named = bool(blocks)
    out = []
    for ref in blocks or saved_block_names(cluster_block_types()):
        try:
            # resolve_block only checks isinstance: the abstract class is fine (python/mypy#4717)
            block = resolve_block(ref, ClusterBlock, "blocks", "kube-ray-cluster/prod", "cluster")  # type: ignore[type-abstract]
        except InvalidJobSpec as exc:
            if named:
                raise
            say(run, logging.ERROR, f"sweep: {exc}")
            continue
        name = ref if isinstance(ref, str) else (block._block_document_name or type(block).__name__)
        out.append((name, block))
    return out


def _stop_in(
    context: contextvars.Context,
    judged: tuple[Any, ClusterBlock, OwnedJob, Verdict],
    handle: JobHandle,
    shape: JobShape | None,
) -> Verdict:
    """`_stop` of one judged job, run in `context` (a typed spelling of context.run(_stop, ...))."""
    return context.run(_stop, *judged, handle, shape)


def _stop(
    backend: Any,
    block: ClusterBlock,
    job: OwnedJob,
    verdict: Verdict,
    handle: JobHandle,
    shape: JobShape | None,
) -> Verdict:
    try:
        # a sweep does not wait long for one stop (a PENDING Ray job's stop waits for resources):
        # the job stays listed and the next sweep asks again
        timeout_s = min(block.stop_timeout_s, CONFIRM_S)
        final = stop_and_confirm(backend, job.job_id, timeout_s=timeout_s)
        outcome = final.state.value if final else "gone"
    except PrefectNemoError as exc:
        final, outcome = None, Redactor(backend.secrets)(f"stop not confirmed: {exc}")
    # the cluster's start (Ray: its submission) to the stop: GPU time nobody used
    span_s = final.duration_s if final is not None else None
    wasted_s = round(span_s, 3) if span_s is not None else None
    hours = gpu_hours(shape, wasted_s) if shape is not None and wasted_s is not None else None
    wasted = {
        "wasted_run_s": wasted_s,
        "wasted_gpu_hours": hours,
        "wasted_cost": cost(hours, block.gpu_hour_price) if hours is not None else None,
    }
    emit(
        SWEPT_EVENT,
        job_resource(handle),
        {"job_id": job.job_id, "owner": job.flow_run_id, "why": verdict.why, "outcome": outcome,
         **wasted},
    )  # fmt: skip
    return Verdict(**{**asdict(verdict), "outcome": outcome, **wasted})


_table = RunTable("Jobs the sweeper judged (prefect-nemo).")


def _report(run: Any, verdicts: list[Verdict], dry_run: bool) -> None:
    stopped = [v for v in verdicts if v.stop]
    verb = "would stop" if dry_run else "stopped"
    wasted = sum(v.wasted_run_s or 0.0 for v in stopped)
    hours = sum(v.wasted_gpu_hours or 0.0 for v in stopped)
    say(run, logging.WARNING if stopped else logging.INFO,
        f"sweep: {len(verdicts)} live job(s) of ours, {verb} {len(stopped)}"
        + (f" (they had run {wasted:.0f}s for dead runs" if wasted else "")
        + (f", {hours:.4f} GPU-hours wasted)" if hours else ")" if wasted else "")
        + "".join(f"\n  {v.job_id} on {v.block}: {v.why} -> {v.outcome or verb}"
                  for v in stopped))  # fmt: skip
    if verdicts:
        _table.update(run.flow_run_id, {f"{v.cluster}/{v.job_id}": asdict(v) for v in verdicts})


@flow(name="prefect-nemo-sweep", log_prints=True)
def sweep_flow(
    blocks: list[str] | None = None, dry_run: bool = False, rounds: int = 1, every_s: float = 20.0
) -> list[dict[str, Any]]:
    """Stop the jobs of flow runs that died without a word (see prefect_nemo.tasks.sweeper):
    `rounds` sweeps, `every_s` apart (a deployment scheduled every minute sweeps 3 times, so a
    dead run's jobs are stopped within a minute of its grace, with one flow run a minute)."""
    if rounds < 1 or every_s < 0:
        raise InvalidJobSpec(f"rounds={rounds}, every_s={every_s}: need rounds >= 1, every_s >= 0")
    verdicts: list[Verdict] = []
    for i in range(rounds):
        if i:
            time.sleep(every_s)
        verdicts += sweep(blocks or (), dry_run=dry_run)
    return [asdict(v) for v in verdicts]


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _is_uuid(text: str) -> bool:
    try:
        UUID(text)
    except ValueError:
        return False
    return True
