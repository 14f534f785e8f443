"""What a job's progress reports cost the flow that runs it, over plain log lines.

Figure (issue 31, goal <= 1.05):

- report_overhead_ratio: the flow process's CPU time (user + system, every thread) for a job
  that calls `prefect_nemo.report.progress` 200 times a second, over the same job printing
  the same payload as plain lines; median [min, max] of 5 interleaved rounds (bench._rounds).
  Both jobs print REPORTS lines of about the same length on the same local Ray cluster; the
  flow streams the log (run_job's default), so each plain line becomes a Prefect log record
  and each report line becomes progress (artifacts and rate-limited events).
- report_flow_cpu_s_plain / report_flow_cpu_s_report: the medians behind the ratio.

    .venv/bin/python -m bench.report_overhead
"""

from __future__ import annotations

import resource
import statistics
import sys
import uuid
from collections.abc import Callable
from uuid import UUID

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.runtime import flow_run
from prefect.testing.utilities import prefect_test_harness

from bench._rounds import Spread, interleaved
from prefect_nemo import JobResult, JobSpec, JobState, run_job
from prefect_nemo.blocks import RayJobsCluster
from prefect_nemo.local_ray import start_local_ray

Report = Callable[[str, object], None]

RATE_HZ = 200
REPORTS = 1000  # 5 s of reports at RATE_HZ

# One script, two ways of saying the same thing: `report` goes through the report module,
# `plain` prints the very line it would print, without the prefix the log pump looks for.
JOB = f"""
import sys, time
from prefect_nemo import report
kind = sys.argv[1]
start = time.monotonic()
for step in range(1, {REPORTS} + 1):
    metrics = {{"loss": 2.0 / step, "lr": 2e-5}}
    if kind == "report":
        report.progress(step=step, total={REPORTS}, **metrics)
    else:
        line = report.Report(step=step, total={REPORTS}, metrics=metrics).as_json()
        print("plain", report.json.dumps(line), flush=True)
    time.sleep(max(0.0, start + step / {RATE_HZ} - time.monotonic()))
"""


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only figures."""
    print(f"[report_overhead] {message}", file=sys.stderr, flush=True)


def cpu_s() -> float:
    """This process's CPU time so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_flow(block: RayJobsCluster) -> Callable[[str, str], tuple[JobResult, str]]:
    """A flow running one job of either kind (the block is closed over: its token never goes
    through parameter serialization)."""

    @flow(name="bench-report-overhead", persist_result=False)
    def one_job(kind: str, tag: str) -> tuple[JobResult, str]:
        spec = JobSpec(entrypoint=f"python -c '{JOB}' {kind}", name=f"{tag}-{kind}")
        return run_job(spec, cluster=block), str(flow_run.id)

    return one_job


def payload_lines_logged(flow_run_id: str) -> int:
    """How many of the flow run's first 200 log records carry a job's payload line: a plain
    job's do, a reporting job's must not (its lines are progress, not log)."""
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)])),
            limit=200,
        )
    return sum('"metrics"' in record.message for record in logs)


def run(report: Report) -> None:
    """Start one Ray cluster and one Prefect API; alternate the two kinds of job."""
    log("starting a local Ray cluster and the Prefect test API")
    with start_local_ray(num_cpus=4) as cluster, prefect_test_harness(server_startup_timeout=180):
        one_job = make_flow(cluster.block())

        def flow_cpu_s(kind: str) -> float:
            before = cpu_s()
            result, run_id = one_job(kind, f"bench-report-{uuid.uuid4().hex[:6]}")
            spent = cpu_s() - before
            if result.state is not JobState.SUCCEEDED:
                raise RuntimeError(f"the {kind} job ended {result.state}: {result.message}")
            if (payload_lines_logged(run_id) > 0) != (kind == "plain"):
                raise RuntimeError(f"the {kind} job's lines were not read as {kind} lines")
            log(f"{kind} job: flow CPU {spent:.2f}s")
            return spent

        pairs = interleaved(lambda: flow_cpu_s("report"), lambda: flow_cpu_s("plain"), warmups=1)
        report("report_flow_cpu_s_plain", statistics.median(plain for _, plain in pairs))
        report("report_flow_cpu_s_report", statistics.median(ours for ours, _ in pairs))
        report("report_overhead_ratio", Spread.of(ours / plain for ours, plain in pairs))


if __name__ == "__main__":
    from bench.run_all import report as print_figure

    run(print_figure)
