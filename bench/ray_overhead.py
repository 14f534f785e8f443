"""What prefect-nemo costs over a minimal Ray Jobs client, on one local Ray cluster.

Figures (see `run`):

- ray_overhead_ratio: makespan of a 1 -> 10 parallel -> 1 DAG of `sleep 0.5` jobs run by a
  prefect-nemo flow, over the same DAG run by a raw JobSubmissionClient loop polling every
  50 ms, per round: `median [min, max]` of ROUNDS interleaved rounds (bench._rounds), after
  one warm-up round. ray_makespan_*_s are the medians of each side.
- ray_detect_p50_s / ray_detect_p95_s: from a job's end (Ray's end_time) to the moment its
  run_job returned in the flow, over every job of the counted prefect-nemo runs.
- ray_requests_per_s_{10,40}jobs: Ray API requests per second (connections through a counting
  proxy) while a flow waits on 10 and 40 running jobs; the cost should not grow with the jobs.

    .venv/bin/python -m bench.ray_overhead      # this module alone
"""

from __future__ import annotations

import contextvars
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import prefect
import ray
from prefect import flow
from prefect.futures import as_completed, wait
from prefect.testing.utilities import prefect_test_harness
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

from bench._rounds import ROUNDS, Spread, interleaved
from prefect_nemo import JobResult, JobSpec, run_job
from prefect_nemo.blocks import RayJobsCluster
from prefect_nemo.lifecycle import META_KEY
from prefect_nemo.local_ray import LocalRayCluster, start_local_ray
from prefect_nemo.testing.proxy import TcpProxy
from prefect_nemo.watcher import ClusterWatcher, watcher_for

Report = Callable[[str, object], None]

ENTRYPOINT = "sleep 0.5"
N_PARALLEL = 10
RAW_POLL_S = 0.05
WARMUPS = 1

LOAD_SIZES = (10, 40)
# Long enough to outlive the measurement however slowly the cluster starts jobs (a busy 2-core
# machine takes 35-65 s to get 40 jobs RUNNING: Ray starts one worker per physical core at a
# time), so not the issue's `sleep 25`; the jobs are stopped as soon as the window closes.
LOAD_ENTRYPOINT = "sleep 300"
LOAD_WINDOW_S = 8.0
# The watcher polls faster while jobs are young (every AGE_FACTOR of the time since the youngest
# job entered its current state, up to the block's max_poll_interval_s), so every load size is
# measured at the same poll interval: LOAD_RUNNING_AGE_S after the last of its jobs turned
# RUNNING, just after a watcher tick. Otherwise the slower start of 40 jobs would make the two
# windows sit at different points of the same curve.
# The window also opens only LOAD_SETTLE_TICKS ticks after all jobs are RUNNING: the watcher
# sees RUNNING (and its task opens the log stream) up to one tick after our raw client does.
LOAD_RUNNING_AGE_S = 20.0
LOAD_SETTLE_TICKS = 2
LOAD_RUNNING_TIMEOUT_S = 180.0

TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


def log(message: str) -> None:
    """Progress and diagnostics go to stderr; stdout carries only figures."""
    print(f"[ray_overhead] {message}", file=sys.stderr, flush=True)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    data = sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    pos = (len(data) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


# ---------------------------------------------------------------------------------------------
# Timings of one DAG run, whoever ran it


@dataclass(frozen=True)
class JobTiming:
    """One job: Ray's start/end (epoch seconds) and when its waiter saw it end."""

    start: float
    end: float
    observed: float

    @property
    def detect_s(self) -> float:
        """From the job's end on the cluster to its waiter seeing it."""
        return self.observed - self.end


@dataclass(frozen=True)
class Stage:
    """One level of the DAG: when its first submission began and how each of its jobs went."""

    begin: float
    jobs: tuple[JobTiming, ...]

    @property
    def end(self) -> float:
        """When the last job of the stage was seen to end."""
        return max(j.observed for j in self.jobs)

    def phases(self) -> dict[str, float]:
        """Split the stage's wall time: until Ray accepted its last job (dispatch), until the
        last job ended on Ray (run), until the waiter saw the last one (detect)."""
        last_start = max(j.start for j in self.jobs)
        last_end = max(j.end for j in self.jobs)
        return {
            "dispatch": last_start - self.begin,
            "run": last_end - last_start,
            "detect": self.end - last_end,
        }


@dataclass(frozen=True)
class DagRun:
    """A whole DAG run: its stages in order, and the wall time around it (flow runs only)."""

    stages: tuple[Stage, ...]
    total_s: float | None = None

    @property
    def makespan_s(self) -> float:
        """From the first submission to the last job seen to end."""
        return self.stages[-1].end - self.stages[0].begin

    @property
    def jobs(self) -> list[JobTiming]:
        """Every job of the run."""
        return [j for s in self.stages for j in s.jobs]

    def phases(self) -> dict[str, float]:
        """dispatch / run / detect summed over the stages (plus any gap between stages)."""
        sums = {"dispatch": 0.0, "run": 0.0, "detect": 0.0}
        for stage in self.stages:
            for name, value in stage.phases().items():
                sums[name] += value
        sums["gaps"] = self.makespan_s - sum(sums.values())
        return sums


def _dag_names() -> list[list[str]]:
    return [["first"], [f"mid{i}" for i in range(N_PARALLEL)], ["last"]]


# ---------------------------------------------------------------------------------------------
# (a) the baseline: a minimal raw JobSubmissionClient loop


def raw_client(cluster: LocalRayCluster) -> JobSubmissionClient:
    """Ray's own client against the real dashboard (not through the proxy)."""
    headers = {"Authorization": f"Bearer {cluster.token}"} if cluster.token else None
    return JobSubmissionClient(cluster.dashboard_url, headers=headers)


def _poll_until_terminal(client: JobSubmissionClient, job_ids: list[str]) -> dict[str, float]:
    """Ask every live job's status each round, RAW_POLL_S apart; when each was seen ending."""
    seen: dict[str, float] = {}
    while True:
        for job_id in job_ids:
            if job_id not in seen and client.get_job_status(job_id) in TERMINAL:
                seen[job_id] = time.time()
        if len(seen) == len(job_ids):
            return seen
        time.sleep(RAW_POLL_S)


def run_raw_dag(client: JobSubmissionClient) -> DagRun:
    """The DAG with submit + poll only: what a user would write without prefect-nemo."""
    tag = f"bench-raw-{uuid.uuid4().hex[:8]}"
    stages: list[tuple[float, dict[str, float]]] = []
    for names in _dag_names():
        begin = time.time()
        ids = [
            client.submit_job(entrypoint=ENTRYPOINT, submission_id=f"{tag}-{name}")
            for name in names
        ]
        stages.append((begin, _poll_until_terminal(client, ids)))
    # Ray's own timestamps, read after the clock stopped.
    result = []
    for begin, seen in stages:
        jobs = []
        for job_id, observed in seen.items():
            info = client.get_job_info(job_id)
            assert info.start_time is not None and info.end_time is not None
            jobs.append(JobTiming(info.start_time / 1000, info.end_time / 1000, observed))
        result.append(Stage(begin, tuple(jobs)))
    return DagRun(tuple(result))


# ---------------------------------------------------------------------------------------------
# (b) the same DAG as a prefect-nemo flow


def _timing(result: JobResult, observed: float) -> JobTiming:
    if result.start_time is None or result.end_time is None:
        raise RuntimeError(f"job {result.handle.job_id} has no start/end time: {result}")
    return JobTiming(result.start_time.timestamp(), result.end_time.timestamp(), observed)


def make_dag_flow(block: RayJobsCluster) -> Callable[[str], DagRun]:
    """A flow running the DAG on block's cluster (the block is closed over, not a parameter,
    so its token never goes through parameter serialization)."""

    def spec(tag: str, name: str) -> JobSpec:
        return JobSpec(entrypoint=ENTRYPOINT, name=f"{tag}-{name}")

    @flow(name="bench-ray-dag", persist_result=False)
    def bench_ray_dag(tag: str) -> DagRun:
        stages = []
        begin = time.time()
        first = run_job(spec(tag, "first"), cluster=block)
        stages.append(Stage(begin, (_timing(first, time.time()),)))

        begin = time.time()
        futures = [run_job.submit(spec(tag, name), cluster=block) for name in _dag_names()[1]]
        middle = []
        for future in as_completed(futures):
            result = future.result()
            middle.append(_timing(result, time.time()))
        stages.append(Stage(begin, tuple(middle)))

        begin = time.time()
        last = run_job(spec(tag, "last"), cluster=block)
        stages.append(Stage(begin, (_timing(last, time.time()),)))
        return DagRun(tuple(stages))

    def run_dag(tag: str) -> DagRun:
        started = time.time()
        dag = bench_ray_dag(tag)
        return DagRun(dag.stages, total_s=time.time() - started)

    return run_dag


# ---------------------------------------------------------------------------------------------
# Requests per second while a flow waits on many jobs


@dataclass(frozen=True)
class LoadRun:
    """Requests through the proxy during the window, and what the watcher did meanwhile."""

    jobs: int
    window_s: float
    requests: int
    watcher_ticks: int
    running_after_s: float  # from the last submission to all jobs RUNNING
    age_s: float  # seconds since the last job turned RUNNING when the window opened

    @property
    def requests_per_s(self) -> float:
        """Ray API requests per second during the window."""
        return self.requests / self.window_s


def make_load_flow(block: RayJobsCluster) -> Callable[..., Any]:
    """A flow that runs `count` long jobs at once and waits until all of them have ended."""

    @flow(name="bench-ray-load", persist_result=False)
    def bench_ray_load(tag: str, count: int) -> int:
        futures = [
            run_job.submit(JobSpec(entrypoint=LOAD_ENTRYPOINT, name=f"{tag}-{i}"), cluster=block)
            for i in range(count)
        ]
        done = wait(futures).done  # the benchmark stops the jobs: each task raises JobStopped
        return sum(1 for future in done if future.state.is_failed())

    return bench_ray_load


def _flow_jobs(client: JobSubmissionClient, tag: str) -> list[JobDetails]:
    return [j for j in client.list_jobs() if tag in (j.metadata or {}).get(META_KEY, "")]


def _wait_all_running(client: JobSubmissionClient, tag: str, count: int) -> list[JobDetails]:
    deadline = time.monotonic() + LOAD_RUNNING_TIMEOUT_S
    while time.monotonic() < deadline:
        jobs = _flow_jobs(client, tag)
        if len(jobs) == count and all(j.status == JobStatus.RUNNING for j in jobs):
            return jobs
        if ended := [j.submission_id for j in jobs if j.status in TERMINAL]:
            raise RuntimeError(f"load jobs ended before the measurement: {ended}")
        time.sleep(0.25)
    raise TimeoutError(f"{count} load jobs not all RUNNING after {LOAD_RUNNING_TIMEOUT_S:g}s")


def _after_next_tick(watcher: ClusterWatcher, timeout_s: float = 10.0) -> None:
    """Return just after the watcher's tick counter moves (its request has been answered)."""
    start, deadline = watcher.ticks, time.monotonic() + timeout_s
    while watcher.ticks == start and time.monotonic() < deadline:
        time.sleep(0.002)


def measure_load(
    client: JobSubmissionClient,
    block: RayJobsCluster,
    proxy: TcpProxy,
    count: int,
    *,
    age_s: float,
) -> LoadRun:
    """Run `count` long jobs in one flow (in a thread) and count the Ray API requests made in
    LOAD_WINDOW_S while it waits on all of them RUNNING, `age_s` after the last turned RUNNING."""
    tag = f"bench-load{count}-{uuid.uuid4().hex[:8]}"
    load_flow = make_load_flow(block)
    states: list[Any] = []
    # The thread must see the test harness's Prefect settings, which live in context vars.
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run,
        args=(lambda: states.append(load_flow(tag, count, return_state=True)),),
        name=f"bench-load-{count}",
        daemon=True,
    )
    thread.start()
    try:
        jobs = _wait_all_running(client, tag, count)
        ready = time.time()
        youngest_start = max(j.start_time or 0 for j in jobs) / 1000
        watcher = watcher_for(block.backend())
        for _ in range(LOAD_SETTLE_TICKS):
            _after_next_tick(watcher)
        time.sleep(max(0.0, ready + age_s - time.time()))
        _after_next_tick(watcher)
        opened = time.time()
        t0, c0, ticks0 = time.monotonic(), proxy.connections, watcher.ticks
        time.sleep(LOAD_WINDOW_S)
        t1, c1, ticks1 = time.monotonic(), proxy.connections, watcher.ticks
        running = [j for j in _flow_jobs(client, tag) if j.status == JobStatus.RUNNING]
        if len(running) != count:
            log(f"warning: only {len(running)}/{count} jobs still RUNNING when the window closed")
        return LoadRun(
            jobs=count,
            window_s=t1 - t0,
            requests=c1 - c0,
            watcher_ticks=ticks1 - ticks0,
            running_after_s=ready - youngest_start,
            age_s=opened - ready,
        )
    finally:
        for job in _flow_jobs(client, tag):
            if job.status not in TERMINAL and job.submission_id:
                client.stop_job(job.submission_id)
        thread.join(120)
        if thread.is_alive():
            log(f"warning: the {count}-job flow did not end within 120s of stopping its jobs")
        elif states:
            log(f"{count}-job flow ended {states[0].type.value} (its jobs were stopped)")


# ---------------------------------------------------------------------------------------------
# The benchmark


def _medians(runs: list[DagRun]) -> dict[str, float]:
    return {
        name: statistics.median(r.phases()[name] for r in runs)
        for name in ("dispatch", "run", "detect", "gaps")
    }


def _describe(label: str, runs: list[DagRun]) -> None:
    spans = ", ".join(f"{r.makespan_s:.2f}" for r in runs)
    phases = ", ".join(f"{k} {v:.3f}" for k, v in _medians(runs).items())
    log(f"{label}: makespans [{spans}] s; median phases (s, summed over 3 stages): {phases}")


def run(report: Report) -> None:
    """Start one Ray cluster and one Prefect API, run the measurements, report the figures."""
    report("ray_version", ray.__version__)
    report("prefect_version", prefect.__version__)
    log("starting a local Ray cluster and the Prefect test API")
    with start_local_ray(num_cpus=16) as cluster, prefect_test_harness(server_startup_timeout=180):
        client = raw_client(cluster)
        block = cluster.block()
        run_dag = make_dag_flow(block)

        def ours() -> DagRun:
            dag = run_dag(f"bench-dag-{uuid.uuid4().hex[:8]}")
            log(f"prefect-nemo makespan {dag.makespan_s:.3f}s (flow total {dag.total_s:.3f}s)")
            return dag

        def raw() -> DagRun:
            dag = run_raw_dag(client)
            log(f"raw makespan {dag.makespan_s:.3f}s")
            return dag

        pairs = interleaved(ours, raw, ROUNDS, warmups=WARMUPS)
        flow_runs = [o for o, _ in pairs]
        raw_runs = [r for _, r in pairs]
        _describe("raw", raw_runs)
        _describe("prefect-nemo", flow_runs)
        raw_span = statistics.median(r.makespan_s for r in raw_runs)
        flow_span = statistics.median(r.makespan_s for r in flow_runs)
        detections = [j.detect_s for r in flow_runs for j in r.jobs]
        raw_detections = [j.detect_s for r in raw_runs for j in r.jobs]
        log(
            f"raw loop detection p50 {percentile(raw_detections, 50):.3f}s "
            f"p95 {percentile(raw_detections, 95):.3f}s (for comparison)"
        )
        report("ray_makespan_raw_s", raw_span)
        report("ray_makespan_prefect_s", flow_span)
        report("ray_overhead_ratio", Spread.of(o.makespan_s / r.makespan_s for o, r in pairs))
        report("ray_flow_total_s", statistics.median(r.total_s or 0.0 for r in flow_runs))
        report("ray_detect_p50_s", percentile(detections, 50))
        report("ray_detect_p95_s", percentile(detections, 95))

        port = urlparse(cluster.dashboard_url).port
        if port is None:
            raise RuntimeError(f"no port in {cluster.dashboard_url}")
        with TcpProxy("127.0.0.1", port) as proxy:
            proxied = block.model_copy(update={"dashboard_url": proxy.url})
            rates: dict[int, float] = {}
            for count in LOAD_SIZES:
                load = measure_load(client, proxied, proxy, count, age_s=LOAD_RUNNING_AGE_S)
                log(
                    f"{count} jobs: {load.requests} requests in {load.window_s:.2f}s, of which "
                    f"{load.watcher_ticks} watcher polls and {load.requests - load.watcher_ticks} "
                    f"others (log streams); all RUNNING {load.running_after_s:.1f}s after the "
                    f"last submission; window opened {load.age_s:.1f}s after all were RUNNING"
                )
                rates[count] = load.requests_per_s
            for count in LOAD_SIZES:
                report(f"ray_requests_per_s_{count}jobs", rates[count])
            report("ray_requests_ratio_40_vs_10", rates[40] / rates[10])


if __name__ == "__main__":
    from bench.run_all import report as print_figure

    run(print_figure)
