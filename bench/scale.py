"""Scale: one flow run runs and tracks N jobs (`make bench-scale`; too long for `make bench`).

Kubernetes path: a loopback API server with the KubeRay simulator on a FakeRay (jobs of 5 s on
a clock, no pods, no Ray), in its own process (`_scale_cluster`), a fresh one per measurement.
Each measurement runs in a fresh process too, so peak RSS (VmHWM) and threads are its own:

- ours: a flow calling `run_jobs(specs, cluster, max_in_flight=N)` (every job its own task run).
- raw: the kubernetes client creating the same N RayJobs (our manifests) and ONE watch until
  all ended: what a script without Prefect would do.

Figures (each with its raw baseline from the same run), N = 100 and 1,000:
scale_kube_wall_ratio_<N> (ours flow wall / raw wall), scale_kube_rss_mb_<N>,
scale_kube_threads_<N> (peaks of the flow process), scale_kube_detect_p50_s_<N> (from the
simulator's write of the final status to run_jobs' wait seeing it; raw: its watch seeing it),
scale_kube_cpu_s_<N> (CPU seconds of the flow process; raw: of the raw script; load on the
machine inflates wall time far more than CPU time), scale_kube_cpu_ms_per_job_<N> (the flow's
own CPU, from its call to its return, per job), scale_prefect_server_cpu_s_<N> (of the
Prefect server during the flow); Prefect's own floor (issue 30, 2), in a fresh process on the
same server: a flow of N async task runs that each only wait JOB_S, gathered as run_jobs
gathers its task runs, no backend: scale_prefect_floor_s_<N> (its wall),
scale_prefect_floor_cpu_ms_per_job_<N>, scale_prefect_floor_server_cpu_s_<N>, and
scale_kube_over_floor_<N> (ours / max(raw, floor): what we add over the slower of the two);
scale_kube_api_requests_per_job_<N>, scale_prefect_api_requests_per_job_<N> (HTTP; events on
Prefect's websocket counted apart), scale_kube_per_job_cost_growth (per-job wall overhead over
raw at 1,000 / at 100), scale_prefect_ui_page_s_max_1000 (the UI's flow-run page loaded every
second during a second 1,000-job run: the API requests the real page makes, recorded from it in
Chromium by `bench/ui_requests.py`, sent in its waves over 6 connections as a browser sends
them; the same requests one after another are logged too; that run's wall and server CPU as
scale_kube_wall_s_paged_1000 and scale_prefect_server_cpu_s_paged_1000: the figures above come
from the run without the page, whose load on the shared server neither raw nor the floor
carries), scale_kube_leaks_1000 (threads
+ fds the run left over its start); then the real engines at N = 200 (`bench/_scale_engines.py`):
scale_ray_ratio_200, scale_ray_rss_mb_200, scale_ray_threads_200, scale_slurm_ratio_200 (and
their raw figures); then the 1,000-job run on SQLite and on PostgreSQL (`bench/_scale_db.py`):
scale_prefect_db_ratio and the UI page latency on each; then 1,000 RayJobs on a Kueue quota
(issue 28, 5: a LocalQueue with room for 100, admitted by `QuotaAdmitter`, each RayJob with its
own RayCluster as Kueue requires): scale_quota_wall_ratio_1000 (ours / raw: the same RayJobs
created labelled and suspended, then one watch), scale_quota_peak_admitted_1000 (<= 100),
scale_quota_kube_api_requests_per_job_1000 (ours: a job waiting in the queue costs no request).
The last results are kept in `bench/.last-scale.txt` for `make bench`.

    .venv/bin/python -m bench.scale            # everything
    .venv/bin/python -m bench.scale 100        # only N = 100 (Kubernetes path)
    .venv/bin/python -m bench.scale ray slurm  # only the real engines (bench/_scale_engines.py)
    SCALE_ENGINE_ROUNDS=3 .venv/bin/python -m bench.scale slurm  # 3 interleaved rounds
    SCALE_KUBE_ROUNDS=3 .venv/bin/python -m bench.scale 1000     # raw, ours, floor: 3 rounds
    .venv/bin/python -m bench.scale db         # only SQLite vs PostgreSQL (bench/_scale_db.py)
    .venv/bin/python -m bench.scale quota      # only 1,000 RayJobs on a Kueue quota of 100
    .venv/bin/python -m bench.scale before 100 # the way before run_jobs: N run_job.submit
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

LAST = Path(__file__).with_name(".last-scale.txt")
SIZES = (100, 1000)
JOB_S = 5.0
# real engines, ENGINE_N jobs each (bench._scale_engines); db: SQLite vs PostgreSQL (_scale_db)
ENGINES = ("ray", "slurm", "db")
ENGINE_N = int(os.environ.get("SCALE_ENGINE_N", "200"))  # a smaller N: a quick check
# interleaved rounds of each real engine (bench._rounds): ratios as median [min, max]
ENGINE_ROUNDS = int(os.environ.get("SCALE_ENGINE_ROUNDS", "1"))
# rounds of the Kubernetes path's raw, ours and floor (rotated): figures as median [min, max]
KUBE_ROUNDS = int(os.environ.get("SCALE_KUBE_ROUNDS", "1"))
QUOTA_QUEUE, QUOTA = "bench-quota", 100  # the Kueue run: its LocalQueue and its room
QUOTA_N = int(os.environ.get("SCALE_QUOTA_N", "1000"))  # a smaller N: a quick check


def log(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The measured processes (`python -m bench.scale child <ours|raw> N <kubeconfig.json>`)


def child(kind: str, n: int, kubeconfig_path: str) -> dict[str, Any]:
    """One measurement in this fresh process; returns its figures."""
    from bench._scale_probe import Sampler, cpu_s, open_fds, peak_rss_mb

    kubeconfig = json.loads(Path(kubeconfig_path).read_text())
    before = (threading.active_count(), open_fds())
    cpu0 = cpu_s()
    with Sampler() as sampler:
        queue = QUOTA_QUEUE if kind.startswith("quota") else None
        if kind in ("raw", "quota-raw"):
            out = _raw(n, kubeconfig, queue)
        elif kind == "floor":
            out = _floor(n)
        else:
            out = _ours(n, kubeconfig, submit=kind == "submit", queue=queue)
    cpu = cpu_s() - cpu0
    time.sleep(2.0)  # threads that end with the run get to end
    after = (threading.active_count(), open_fds())
    out.update(
        cpu_s=cpu,
        peak_threads=sampler.peak_threads,
        peak_rss_mb=peak_rss_mb(),
        threads_left=after[0] - before[0],  # Prefect's own workers stay for the process
        ours_left=[t.name for t in threading.enumerate() if t.name.startswith("prefect-nemo")],
        fds_left=after[1] - before[1],
    )
    return out


def _specs(n: int) -> list[Any]:
    from prefect_nemo import JobSpec

    return [JobSpec(entrypoint=f"sleep {JOB_S:g}", name=f"s{i:04d}") for i in range(n)]


def _ours(
    n: int, kubeconfig: dict[str, Any], *, submit: bool = False, queue: str | None = None
) -> dict[str, Any]:
    """run_jobs in one flow run (`submit`: the way before it, N run_job.submit calls; `queue`:
    each job in that Kueue LocalQueue, on a RayCluster of its own)."""
    from prefect import flow
    from prefect.futures import wait as wait_futures
    from prefect.settings import PREFECT_API_URL

    import prefect_nemo.lifecycle as lifecycle
    from bench._scale_probe import PrefectRequestCounter, cpu_s
    from prefect_nemo import run_job, run_jobs
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    counter = PrefectRequestCounter(str(PREFECT_API_URL.value())).install()
    seen: dict[str, float] = {}
    wait = lifecycle.wait_until_terminal_async

    wait_sync = lifecycle.wait_until_terminal

    async def timed_wait(watcher: Any, handle: Any, **kw: Any) -> Any:  # when each end was seen
        status = await wait(watcher, handle, **kw)
        seen[handle.job_id] = time.time()
        return status

    def timed_wait_sync(watcher: Any, handle: Any, **kw: Any) -> Any:
        status = wait_sync(watcher, handle, **kw)
        seen[handle.job_id] = time.time()
        return status

    lifecycle.wait_until_terminal_async = timed_wait
    lifecycle.wait_until_terminal = timed_wait_sync
    from bench._scale_cluster import CLUSTER_SPEC

    kubernetes = KubernetesCluster(kubeconfig=kubeconfig)
    block = (
        KubeRayCluster(kubernetes=kubernetes, ray_cluster_spec=CLUSTER_SPEC, queue_name=queue)
        if queue
        else KubeRayCluster(kubernetes=kubernetes, ray_cluster_name="shared")
    )
    specs = _specs(n)

    @flow(name="scale-bench")
    def scale_bench() -> tuple[float, dict[str, int]]:
        t0 = time.monotonic()
        if submit:
            futures = [run_job.submit(s, block, stream_logs=False) for s in specs]
            wait_futures(futures)
            states = [f.state.type.value for f in futures]
        else:
            results = run_jobs(specs, block, max_in_flight=n)
            states = [r.state.value for r in results]
        return time.monotonic() - t0, {s: states.count(s) for s in set(states)}

    t0, cpu0 = time.monotonic(), cpu_s()
    jobs_wall, states = scale_bench()
    return {
        "wall_s": time.monotonic() - t0,
        "flow_cpu_s": cpu_s() - cpu0,
        "jobs_wall_s": jobs_wall,
        "states": states,
        "seen": seen,
        "prefect_requests": counter.requests,
        "prefect_events": counter.events,
        "prefect_by_path": counter.by_path,
    }


def _floor(n: int) -> dict[str, Any]:
    """Prefect's own floor: a flow of n async task runs that only wait as long as a job takes
    (JOB_S), gathered on one loop with one client as run_jobs runs its task runs; no backend."""
    import asyncio

    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.context import AsyncClientContext

    from bench._scale_probe import cpu_s

    @task(name="run_job", cache_policy=NO_CACHE, task_run_name="{name}")
    async def wait_job(name: str) -> str:
        await asyncio.sleep(JOB_S)
        return name

    async def wait_all() -> list[str]:
        async with AsyncClientContext.get_or_create():
            return await asyncio.gather(*(wait_job(f"s{i:04d}") for i in range(n)))

    @flow(name="scale-floor")
    def scale_floor() -> float:
        t0 = time.monotonic()
        asyncio.run(wait_all())
        return time.monotonic() - t0

    t0, cpu0 = time.monotonic(), cpu_s()
    jobs_wall = scale_floor()
    return {
        "wall_s": time.monotonic() - t0,
        "flow_cpu_s": cpu_s() - cpu0,
        "jobs_wall_s": jobs_wall,
        "seen": {},
    }


def _raw(n: int, kubeconfig: dict[str, Any], queue: str | None = None) -> dict[str, Any]:
    from kubernetes import config, watch
    from kubernetes.client import CustomObjectsApi

    from bench._scale_cluster import CLUSTER_SPEC
    from prefect_nemo.backends.kuberay import RayJobConfig
    from prefect_nemo.backends.kuberay.manifests import rayjob_documents

    custom = CustomObjectsApi(config.new_client_from_config_dict(kubeconfig))
    cfg = (  # our manifests: with a queue, labelled and created suspended, as Kueue asks
        RayJobConfig(ray_cluster_spec=CLUSTER_SPEC, queue_name=queue)
        if queue
        else RayJobConfig(ray_cluster_name="shared")
    )
    manifests = [
        rayjob_documents(s, f"raw-{s.name}", {}, cfg, namespace="default")[0] for s in _specs(n)
    ]
    t0 = time.monotonic()
    for manifest in manifests:
        custom.create_namespaced_custom_object("ray.io", "v1", "default", "rayjobs", manifest)
    seen: dict[str, float] = {}
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object, "ray.io", "v1", "default", "rayjobs"
    )
    for event in stream:
        obj = event["object"]
        name = obj["metadata"]["name"]
        if (obj.get("status") or {}).get("jobDeploymentStatus") in ("Complete", "Failed"):
            seen.setdefault(name, time.time())
            if len(seen) == n:
                break
    return {"wall_s": time.monotonic() - t0, "seen": seen}


# ---------------------------------------------------------------------------------------------
# The driver


def measure(kind: str, n: int, api_url: str | None, ui: list[float] | None) -> dict[str, Any]:
    """One measurement: a fresh simulated cluster, a fresh measured process."""
    from bench._scale_probe import SimulatedCluster, server_cpu_s

    quota = f"{QUOTA_QUEUE}:{QUOTA}" if kind.startswith("quota") else None
    with SimulatedCluster(quota) as cluster:
        path = Path(f"/tmp/prefect-nemo-scale-{os.getpid()}.json")
        path.write_text(json.dumps(cluster.kubeconfig))
        since = time.time()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if api_url:
            env["PREFECT_API_URL"] = api_url
        stop = threading.Event()
        pager = None
        if ui is not None and api_url:
            pager = threading.Thread(target=_time_ui, args=(api_url, ui, stop), daemon=True)
            pager.start()
        server_cpu0 = server_cpu_s()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.scale", "child", kind, str(n), str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=None if kind == "raw" else subprocess.DEVNULL,
                text=True,
                timeout=900,
            )
        finally:
            stop.set()
            if pager is not None:
                pager.join()
            path.unlink(missing_ok=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{kind} N={n} failed (exit {proc.returncode})")
        out: dict[str, Any] = json.loads(lines[-1])
        out["server_cpu_s"] = server_cpu_s() - server_cpu0
        out["kube"] = cluster.ask("requests", since=since)
        completed = cluster.ask("completed")["completed"]
        out["quota"] = cluster.ask("quota")
    detect = [
        t - completed[name] for name, t in out["seen"].items() if name in completed
    ]  # fmt: skip
    out["detect_p50_s"] = _percentile(detect, 50) if detect else float("nan")
    out.pop("seen")
    return out


# The API requests the Prefect UI's flow-run page makes (Prefect 3.8.8, its Logs tab), recorded
# from the real page in headless Chromium by `python -m bench.ui_requests`, in the waves the page
# sends them: each wave needs what the one before it returned. A browser sends a wave's requests
# at once over at most 6 connections to the host, so the page waits on the slowest of a wave.
UI_BROWSER_CONNECTIONS = 6


def _ui_page(run: dict[str, Any], now: str) -> list[tuple[str, str, Any]]:
    """The page's second wave for a flow run (the first GETs the run, the third its graph's
    task runs)."""
    run_id, of_run = run["id"], {"flow_runs": {"id": {"any_": [run["id"]]}}}
    resource, since = f"prefect.flow-run.{run_id}", {"since": run["start_time"], "until": now}
    automations = {
        "event": {"name": ["prefect-cloud.automation.action.executed",
                           "prefect.automation.action.executed"]},
        "occurred": since,
        "related": {"id": [resource]},
        "resource": {"id_prefix": ["prefect-cloud.automation", "prefect.automation"]},
    }  # fmt: skip
    live = ["RUNNING", "SCHEDULED", "PENDING", "PAUSED"]
    subflows = {"parent_flow_run_id": {"any_": [run_id]}, "state": {"type": {"any_": live}}}
    logs = {"logs": {"flow_run_id": {"any_": [run_id]}, "level": {"ge_": 0}}, "limit": 200}
    run_events = {
        "any_resource": {"id": [resource]},
        "event": {"exclude_prefix": ["prefect.log.write", "prefect.task-run."]},
        "occurred": since,
    }
    return [
        ("POST", "/task_runs/count", {**of_run, "task_runs": {"subflow_runs": {"exists_": False}}}),
        ("POST", "/task_runs/count", of_run),
        ("POST", "/events/filter", {"filter": automations, "limit": 1}),
        ("POST", "/flow_runs/filter", {"flow_runs": subflows}),
        ("GET", f"/flows/{run['flow_id']}", None),
        ("POST", "/logs/filter", {**logs, "offset": 0, "sort": "TIMESTAMP_ASC"}),
        ("GET", f"/flow_runs/{run_id}/graph-v2", None),
        ("POST", "/events/filter", {"filter": run_events}),
    ]


def _time_ui(api_url: str, samples: list[float], stop: threading.Event) -> None:
    """Load the flow-run page's API requests (`_ui_page` waves) every second while a flow runs,
    as a browser does; `samples` gets each load's seconds. Also logged at the end: the same
    requests sent one after another (one connection), and the slowest of each request."""
    import asyncio
    from datetime import UTC, datetime

    import httpx

    slowest: dict[str, float] = {}
    one_by_one: list[float] = []

    async def timed(client: httpx.AsyncClient, method: str, path: str, body: Any) -> Any:
        t0 = time.monotonic()
        response = await client.request(method, path, json=body)
        response.raise_for_status()
        name = f"{method} {path.split('/')[1]}{'/graph-v2' if 'graph' in path else ''}"
        slowest[name] = max(slowest.get(name, 0.0), spent := time.monotonic() - t0)
        return response.json(), spent

    async def load(client: httpx.AsyncClient, run_id: str) -> tuple[float, float]:
        """(the page's wait, the sum of its requests' times)."""
        t0 = time.monotonic()
        run, first = await timed(client, "GET", f"/flow_runs/{run_id}", None)
        now = datetime.now(UTC).isoformat()
        wave = await asyncio.gather(*(timed(client, *r) for r in _ui_page(run, now)))
        graph = next(out for out, _ in wave if isinstance(out, dict) and "nodes" in out)
        ids = [node_id for node_id, node in graph["nodes"] if node.get("kind") == "task-run"]
        _, last = await timed(client, "POST", "/task_runs/filter",
                              {"task_runs": {"id": {"any_": ids}}})  # fmt: skip
        return time.monotonic() - t0, first + sum(spent for _, spent in wave) + last

    async def pages() -> None:
        limits = httpx.Limits(max_connections=UI_BROWSER_CONNECTIONS)
        async with httpx.AsyncClient(base_url=api_url, timeout=30, limits=limits) as client:
            while not stop.is_set():
                await asyncio.sleep(1.0)
                try:
                    running = {"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}},
                               "limit": 1}  # fmt: skip
                    runs = (await client.post("/flow_runs/filter", json=running)).json()
                    if not runs:
                        continue
                    page_s, summed_s = await load(client, runs[0]["id"])
                    samples.append(page_s)
                    one_by_one.append(summed_s)
                except Exception as exc:  # a slow or failing page is what we measure: note it
                    log(f"UI page request failed: {exc!r}")
                    samples.append(float("inf"))

    asyncio.run(pages())
    parts = ", ".join(f"{name} {s:.2f}s" for name, s in slowest.items())
    log(f"UI page, slowest of each request: {parts}")
    if one_by_one:
        log(f"UI page's requests one after another: max {max(one_by_one):.2f}s "
            f"p50 {_percentile(one_by_one, 50):.2f}s")  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    from bench.ray_overhead import percentile

    return percentile(values, q)


def before(n: int) -> int:
    """What N run_job.submit calls in one flow run cost (the default thread per task), as the
    same figures; printed only (not kept for `make bench`)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        out = measure("submit", n, str(PREFECT_API_URL.value()), None)
    for key in ("wall_s", "jobs_wall_s", "peak_rss_mb", "peak_threads", "detect_p50_s"):
        print(f"scale_before_kube_{key}_{n}={out[key]:.3f}")
    print(f"scale_before_kube_api_requests_per_job_{n}={out['kube']['requests'] / n:.3f}")
    print(f"scale_before_prefect_api_requests_per_job_{n}={out['prefect_requests'] / n:.3f}")
    print(f"scale_before_states_{n}={out['states']}")
    return 0


def main(
    sizes: tuple[int, ...] = SIZES, engines: tuple[str, ...] = ENGINES, quota: bool = True
) -> int:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from bench.run_all import format_value

    lines: dict[str, str] = {}

    def report(key: str, value: object) -> None:
        lines[key] = f"{key}={format_value(value)}"
        print(lines[key], flush=True)

    with prefect_test_harness(server_startup_timeout=180):
        api_url = str(PREFECT_API_URL.value())
        if sizes:
            _kube(sizes, api_url, report)
        for engine in engines:
            if engine != "db":
                _engine(engine, api_url, report)
        if quota:
            _quota(api_url, report)
    if "db" in engines:  # each database behind its own `prefect server start`
        from bench._scale_db import measure_db

        measure_db(measure, report)
    _keep(lines)
    return 0


def _kube(sizes: tuple[int, ...], api_url: str, report: Any) -> None:
    """The Kubernetes path at each size: raw, ours and the floor in KUBE_ROUNDS rounds, the
    order rotated each round (bench._rounds.rotated); at 1,000 the UI page's run, once."""
    from functools import partial

    from bench._rounds import figure, rotated

    overhead: dict[int, float] = {}
    for n in sizes:
        sides = {side: partial(_kube_side, side, n, api_url) for side in ("raw", "ours", "floor")}
        rounds = rotated(sides, KUBE_ROUNDS)
        figures = [_kube_figures(n, r) for r in rounds]
        for key in figures[0]:
            report(key, figure([f[key] for f in figures]))
        ours = rounds[-1]["ours"]
        leaks = (
            f"threads:{ours['threads_left']},ours:{len(ours['ours_left'])},fds:{ours['fds_left']}"
        )
        report(f"scale_kube_leaks_{n}", leaks)
        if n >= 1000:  # apart: the page's load on the server is neither raw's nor the floor's
            log(f"run_jobs again, N={n}, the UI's flow-run page loaded every second")
            ui: list[float] = []
            paged = measure("ours", n, api_url, ui)
            log(f"ours with the page: {paged['wall_s']:.1f}s")
            log("UI page seconds, one a second: " + " ".join(f"{s:.2f}" for s in ui))
            report(f"scale_prefect_ui_page_s_max_{n}", max(ui))
            report(f"scale_prefect_ui_page_s_p50_{n}", _percentile(ui, 50))
            report(f"scale_kube_wall_s_paged_{n}", paged["wall_s"])
            report(f"scale_prefect_server_cpu_s_paged_{n}", paged["server_cpu_s"])
        overhead[n] = statistics.median(
            (r["ours"]["wall_s"] - r["raw"]["wall_s"]) / n for r in rounds
        )
        report(f"scale_kube_per_job_overhead_s_{n}", overhead[n])
    if 100 in overhead and 1000 in overhead and overhead[100] > 0:
        report("scale_kube_per_job_cost_growth", overhead[1000] / overhead[100])


def _kube_figures(n: int, sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One round's figures at size n, by the keys they are reported under."""
    ours, raw, floor = sides["ours"], sides["raw"], sides["floor"]
    return {
        f"scale_kube_wall_s_{n}": ours["wall_s"],
        f"scale_kube_wall_s_raw_{n}": raw["wall_s"],
        f"scale_kube_wall_ratio_{n}": ours["wall_s"] / raw["wall_s"],
        f"scale_kube_jobs_wall_s_{n}": ours["jobs_wall_s"],
        f"scale_kube_cpu_s_{n}": ours["cpu_s"],
        f"scale_kube_cpu_s_raw_{n}": raw["cpu_s"],
        f"scale_prefect_server_cpu_s_{n}": ours["server_cpu_s"],
        # the flow's own CPU, from its call to its return (imports and start-up left out)
        f"scale_kube_cpu_ms_per_job_{n}": ours["flow_cpu_s"] * 1000 / n,
        f"scale_prefect_floor_s_{n}": floor["wall_s"],
        f"scale_prefect_floor_cpu_ms_per_job_{n}": floor["flow_cpu_s"] * 1000 / n,
        f"scale_prefect_floor_server_cpu_s_{n}": floor["server_cpu_s"],
        # over the slower of what the cluster needs (raw) and what Prefect needs (the floor)
        f"scale_kube_over_floor_{n}": ours["wall_s"] / max(raw["wall_s"], floor["wall_s"]),
        f"scale_kube_rss_mb_{n}": ours["peak_rss_mb"],
        f"scale_kube_rss_mb_raw_{n}": raw["peak_rss_mb"],
        f"scale_kube_threads_{n}": ours["peak_threads"],
        f"scale_kube_threads_raw_{n}": raw["peak_threads"],
        f"scale_kube_detect_p50_s_{n}": ours["detect_p50_s"],
        f"scale_kube_detect_p50_s_raw_{n}": raw["detect_p50_s"],
        f"scale_kube_api_requests_per_job_{n}": ours["kube"]["requests"] / n,
        f"scale_kube_api_requests_per_job_raw_{n}": raw["kube"]["requests"] / n,
        f"scale_prefect_api_requests_per_job_{n}": ours["prefect_requests"] / n,
        f"scale_prefect_events_per_job_{n}": ours["prefect_events"] / n,
    }


def _kube_side(side: str, n: int, api_url: str) -> dict[str, Any]:
    """One side of a round at size n (raw, ours or the floor), in a fresh process."""
    if side == "raw":
        log(f"raw kubernetes client, N={n}")
        out = measure("raw", n, None, None)
        log(f"raw: {out['wall_s']:.1f}s")
    elif side == "ours":
        log(f"run_jobs in one flow run, N={n}")
        out = measure("ours", n, api_url, None)
        log(f"ours: {out['wall_s']:.1f}s (jobs {out['jobs_wall_s']:.1f}s) {out['states']}")
        log(f"ours: Prefect API requests by path {out['prefect_by_path']}")
    else:
        log(f"Prefect's floor: {n} async task runs waiting {JOB_S:g}s each, no backend")
        out = measure("floor", n, api_url, None)
        log(f"floor: {out['wall_s']:.1f}s, flow CPU {out['flow_cpu_s']:.1f}s")
    return out


def _quota(api_url: str, report: Any) -> None:
    """QUOTA_N RayJobs on a Kueue quota of QUOTA, ours next to the raw client."""
    n = QUOTA_N
    log(f"quota: raw kubernetes client, N={n}, room for {QUOTA}")
    raw = measure("quota-raw", n, None, None)
    log(f"quota raw: {raw['wall_s']:.1f}s, Kueue admitted {raw['quota']}")
    log(f"quota: run_jobs in one flow run, N={n}")
    ours = measure("quota", n, api_url, None)
    log(f"quota ours: {ours['wall_s']:.1f}s {ours['states']}, Kueue admitted {ours['quota']}")
    report(f"scale_quota_wall_s_{n}", ours["wall_s"])
    report(f"scale_quota_wall_s_raw_{n}", raw["wall_s"])
    report(f"scale_quota_wall_ratio_{n}", ours["wall_s"] / raw["wall_s"])
    report(f"scale_quota_states_{n}", ",".join(f"{k}:{v}" for k, v in ours["states"].items()))
    report(f"scale_quota_peak_admitted_{n}", ours["quota"]["peak"])
    report(f"scale_quota_kube_api_requests_per_job_{n}", ours["kube"]["requests"] / n)
    report(f"scale_quota_kube_api_requests_per_job_raw_{n}", raw["kube"]["requests"] / n)
    report(f"scale_quota_cpu_s_{n}", ours["cpu_s"])
    report(f"scale_quota_cpu_s_raw_{n}", raw["cpu_s"])


def _engine(engine: str, api_url: str, report: Any) -> None:
    """A real engine (ray, slurm) at ENGINE_N jobs, ours next to its raw client."""
    import tempfile

    from bench import _scale_engines
    from bench._rounds import figure

    n, rounds = ENGINE_N, ENGINE_ROUNDS
    log(f"{engine}: the raw client and run_jobs in one flow run, N={n}, {rounds} round(s)")
    if engine == "ray":
        pairs = _scale_engines.measure_ray(n, api_url, engine_child, rounds)
    else:
        with tempfile.TemporaryDirectory(prefix="prefect-nemo-scale-slurm-") as job_dir:
            pairs = _scale_engines.measure_slurm(n, api_url, engine_child, job_dir, rounds)
    for ours, raw in pairs:
        log(f"{engine}: raw {raw['wall_s']:.1f}s {raw['states']}; ours {ours['wall_s']:.1f}s "
            f"{ours['states']}")  # fmt: skip

    report(f"scale_{engine}_ratio_{n}", figure([o["wall_s"] / r["wall_s"] for o, r in pairs]))
    figures = (("wall_s", "wall_s"), ("rss_mb", "peak_rss_mb"), ("threads", "peak_threads"))
    for name, key in figures:
        report(f"scale_{engine}_{name}_{n}", figure([o[key] for o, _ in pairs]))
        report(f"scale_{engine}_{name}_raw_{n}", figure([r[key] for _, r in pairs]))
    states = Counter[str]()
    for ours, _ in pairs:
        states.update(ours["states"])
    report(f"scale_{engine}_states_{n}", ",".join(f"{k}:{v}" for k, v in states.items()))


def engine_child(
    side: str,
    kind: str,
    n: int,
    config: dict[str, Any],
    api_url: str | None,
    python: str,
    module: str = "bench._scale_engines",
) -> dict[str, Any]:
    """One real-engine measurement in a fresh process (`module`: `bench._scale_engines`, or a
    peer's module with the same arguments and output, as `bench.peers` runs); its figures."""
    stem = f"/tmp/prefect-nemo-scale-{os.getpid()}-{kind}-{side}"
    path, log_path = Path(stem + ".json"), Path(stem + ".log")
    path.write_text(json.dumps(config))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    try:
        with open(log_path, "w") as err:
            proc = subprocess.run(
                [python, "-m", module, side, kind, str(n), str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=1800,
            )
    finally:
        path.unlink(missing_ok=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{side} {kind} N={n} failed (exit {proc.returncode}):\n{tail}")
    log_path.unlink(missing_ok=True)
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def _keep(lines: dict[str, str]) -> None:
    """Write this run's figures to LAST, keeping the earlier run's figures it did not measure."""
    kept: dict[str, str] = {}
    if LAST.exists():
        for line in LAST.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                kept[line.split("=", 1)[0]] = line
    kept.update(lines)
    parts = ", ".join(sorted({k.split("_")[1] for k in lines}))
    LAST.write_text(
        f"# bench/scale.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} (measured now: {parts})\n"
        + "\n".join(kept.values())
        + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "before":
        sys.exit(before(int(sys.argv[2]) if len(sys.argv) > 2 else 100))
    else:
        args = sys.argv[1:]
        picked = tuple(a for a in args if a in ENGINES)
        sizes = tuple(int(a) for a in args if a.isdigit())
        sys.exit(main(sizes, picked, "quota" in args) if args else main())
