"""Reliability under chaos (issue 17), at the issue's sizes, against a real Prefect server
(`prefect server start`, restartable) and a real local Ray head with token auth; one
`key=value` line per figure.

    .venv/bin/python -m bench.chaos       # or: make chaos  (about 10 minutes)

- kill -9 of a plain script waiting on 6 running jobs, no retry: `chaos_kill9_left_running`
  (jobs of the killed run still RUNNING sweep_grace_s + 60 s after the kill; grace 30 s, the
  sweeper run every 5 s), `chaos_kill9_stopped_after_s`; the same script run again within the
  grace: `chaos_kill9_retry_attached` (of 6), `chaos_kill9_retry_stopped`.
- Ray dashboard down 25 s (unreachable budget 5 s, stop timeout 5 s): the task fails, its stop
  is recorded as pending; `chaos_stop_pending_stopped_after_return_s` (the sweeper's stop).
- `prefect flow-run cancel` of a script-started run with 3 running jobs:
  `chaos_cancel_stopped_s` (from the CLI's return to all STOPPED), `chaos_cancel_final_state`.
- Prefect server down 90 s with 4 jobs (two end during the outage):
  `chaos_server_down_duplicates`, `chaos_server_down_events_present` (k/N of the run's
  `prefect-nemo.job.*` events), `chaos_server_down_log_lines_present` (k/N job log lines, each
  once and in order), the final state, the automation waiting for the 4 succeeded events.
- Prefect server down 20 s past an outage budget of 5 s: the jobs stopped during the outage.

This module has no `run(report)`: `make bench` does not run it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.run_all import report
from prefect_nemo.local_ray import start_local_ray
from prefect_nemo.testing.chaos import Engines, cancel_script_run, kill9, stop_pending
from prefect_nemo.testing.chaos_server import server_down, server_down_past_budget


def chaos(engines: Engines) -> None:
    """Run every scenario and report its figures."""
    k = _timed("kill9", kill9, engines, count=6, grace_s=30)
    report("chaos_kill9_left_running", k["left_running"])
    report("chaos_kill9_stopped_after_s", k["stopped_after_s"])
    report("chaos_kill9_stopped_within_grace", k["early_stops"])
    report("chaos_kill9_retry_attached", k["retry_attached"])
    report("chaos_kill9_retry_stopped", k["retry_stopped"])
    report("chaos_kill9_retry_duplicates", k["retry_duplicates"])

    p = _timed("stop_pending", stop_pending, engines, down_s=25, budget_s=5, stop_timeout_s=5)
    report("chaos_stop_pending_script_exited_after_cut_s", p["exited_s_after_cut"])
    report("chaos_stop_pending_events", p["stop_pending_events"])
    report("chaos_stop_pending_stopped_after_return_s", p["stopped_after_return_s"])
    report("chaos_stop_pending_final_state", ",".join(p["final_states"]))

    c = _timed("cancel", cancel_script_run, engines, count=3)
    report("chaos_cancel_stopped_s", c["stopped_s"])
    report("chaos_cancel_final_state", c["final_state"])
    named = sum(job in c["state_message"] for job in c["job_ids"])
    report("chaos_cancel_message_names_jobs", f"{named}/{len(c['job_ids'])}")

    d = _timed("server_down", server_down, engines, down_s=90, count=4)
    report("chaos_server_down_outage_s", d["outage_s"])
    report("chaos_server_down_duplicates", d["duplicates"])
    report("chaos_server_down_succeeded", f"{d['succeeded']}/4")
    report("chaos_server_down_final_state", d["final_state"])
    report("chaos_server_down_events_present", f"{d['events_present']}/{d['events_emitted']}")
    report("chaos_server_down_log_lines_present",
           f"{d['log_lines_present']}/{d['log_lines_expected']}")  # fmt: skip
    report("chaos_server_down_log_lines_in_api", d["log_lines_seen"])
    report("chaos_server_down_log_lines_made_during_outage", d["lines_during_outage"])
    report("chaos_server_down_trigger_fired_s_after_return", d["trigger_fired_s_after_return"])

    b = _timed("past_budget", server_down_past_budget, engines, down_s=20, budget_s=5, count=2)
    report("chaos_server_down_past_budget_jobs_stopped_s", b["stopped_s_after_outage"])
    report("chaos_server_down_past_budget_job_states", ",".join(b["job_states"]))
    report("chaos_server_down_past_budget_final_state", b["final_state"])


def _timed(name: str, scenario: Any, engines: Engines, **sizes: Any) -> dict[str, Any]:
    started = time.monotonic()
    result = scenario(engines, **sizes)
    print(f"[chaos] {name}: {time.monotonic() - started:.0f}s {sizes}", file=sys.stderr)
    if output := result.pop("output", ""):
        print(f"[chaos] {name} script output (tail):\n{output[-1500:]}", file=sys.stderr)
    out: dict[str, Any] = result
    return out


def main() -> None:
    from prefect_nemo.testing.prefect_server import PrefectServer

    work = Path(tempfile.mkdtemp(prefix="prefect-nemo-chaos-"))
    with (
        PrefectServer(work / "server") as server,
        start_local_ray(num_cpus=8, resources={"slot": 4}) as ray,
    ):
        chaos(Engines(server, ray, work))


if __name__ == "__main__":
    main()
