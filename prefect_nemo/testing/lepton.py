"""A loopback DGX Cloud Lepton workspace API (v2) on 127.0.0.1, for leptonai's APIClient unchanged.

Serves under ``{url}/api/v2/workspaces/{workspace_id}``: dedicated node groups and their nodes,
``POST/GET/DELETE /jobs[/{id}]``, ``GET /jobs`` (paged; ``q`` a name substring, ``query`` a
label selector on the jobs' ``metadata.labels``, as leptonai documents them), ``PATCH /jobs/{id}``
(``{"spec": {"stopped": true}}`` stops), replicas and replica logs, and Ray clusters
(``/rayclusters``), whose ``/rayclusters/{name}/dashboard/...`` is proxied to a real Ray
dashboard when one is configured. A bearer token is required (a wrong one is 401). Incoming jobs
and Ray clusters are validated with leptonai's own pydantic models, unknown fields refused.

By default nothing runs in a pod: job states follow the clock (Starting → Running →
Completed/Failed, Stopping → Stopped) and the server's knobs, and a replica's log is
synthetic. With ``execute=True`` the pods really run, as local processes (see `LeptonServer`).
A node group holds one replica per node: a job whose replicas do not fit in the free nodes of
its group (``spec.affinity``) waits ``Queueing`` until they do, higher
``spec.queue_config.priority_class`` first, then in order of creation, none overtaking another
of its group (NeMo-Run's ``data-mover-*`` jobs are never held). What would break at ``exec`` in
a real pod does break here: a command argument or ``NAME=value`` env string over Linux's
MAX_ARG_STRLEN (128 KiB), or argv + env over ARG_MAX (2 MiB), makes the job fail with "argument
list too long".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError

from prefect_nemo.testing.runai import ApiError, LoopbackHttpServer

#: Linux caps one argv or environment string (with its NUL) at this many bytes.
MAX_ARG_STRLEN = 128 * 1024
#: Linux caps argv + environment together (a quarter of an 8 MiB stack).
ARG_MAX = 2 * 1024 * 1024
_JOB_ID = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_JOB_ID_MAX = 36
#: Lepton's queue priority classes, lowest first (a job without one counts as mid-4000).
PRIORITY_CLASSES = tuple(
    f"{band}-{n}000" for band, ns in (("low", "123"), ("mid", "456"), ("high", "789")) for n in ns
)
_HOLDING = ("Starting", "Running", "Stopping")  # states whose replicas occupy nodes
_ENDED = ("Completed", "Failed", "Stopped")
#: The init script NeMo-Run's Lepton launch script fetches in every pod.
INIT_SCRIPT_URL = "https://raw.githubusercontent.com/leptonai/scripts/main/lepton_env_to_pytorch.sh"
#: What an executed pod's image adds to this machine's userland, read by bash (BASH_ENV) before
#: the pod's command: pods here reach no network, so `wget` serves Lepton's init script only (a
#: stand-in mapping Lepton's rank variables to torch's, as the real one does); and a pod has a
#: root of its own, so a top-level path this machine lacks, and NeMo-Run's /nemo_run always
#: (`ln -s <job dir> /nemo_run`, then `cd /nemo_run/code`; another test may have made one on
#: the host), lives under the replica's own directory.
POD_IMAGE = r"""
_pod_path() {
  case "$1" in
    /*) local rest="${1#/}"; local top="/${rest%%/*}"
        if [ "$top" = /nemo_run ] || { [ ! -e "$top" ] && [ ! -L "$top" ]; }; then
          printf '%s' "$LOOPBACK_LEPTON_POD_ROOT$1"; return
        fi ;;
  esac
  printf '%s' "$1"
}
cd() { if [ $# -eq 1 ]; then builtin cd "$(_pod_path "$1")"; else builtin cd "$@"; fi; }
ln() { local a=() x; for x in "$@"; do a+=("$(_pod_path "$x")"); done; command ln "${a[@]}"; }
wget() {
  local out="" url=""
  while [ $# -gt 0 ]; do
    case "$1" in
      -O) out="$2"; shift 2 ;;
      -O*) out="${1#-O}"; shift ;;
      -*) shift ;;
      *) url="$1"; shift ;;
    esac
  done
  if [ "$url" != "__INIT_SCRIPT_URL__" ]; then
    echo "wget: unable to resolve host address '${url#*://}'" >&2; return 4
  fi
  cat > "${out:-lepton_env_to_pytorch.sh}" <<'INIT'
# loopback stand-in for leptonai/scripts lepton_env_to_pytorch.sh
export NNODES="${LEPTON_JOB_TOTAL_WORKERS:-1}"
export NODE_RANK="${LEPTON_JOB_WORKER_INDEX:-0}"
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
export MASTER_PORT="${MASTER_PORT:-29400}"
INIT
}
""".replace("__INIT_SCRIPT_URL__", INIT_SCRIPT_URL)
_HOP = {"host", "authorization", "origin", "content-length", "transfer-encoding", "connection"}


def unknown_fields(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """Paths of keys in `data` that `model` (a leptonai pydantic model) has no field for."""
    if not isinstance(data, dict):
        return []
    known: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        known[info.alias or name] = info.annotation
        known[name] = info.annotation
    found: list[str] = []
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in known:
            found.append(path)
            continue
        found += _unknown_in(known[key], value, path)
    return found


def _unknown_in(annotation: Any, value: Any, where: str) -> list[str]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                return _unknown_in(arg, value, where)
        return []
    if origin in (list, set, tuple) and isinstance(value, list):
        (inner, *_) = typing.get_args(annotation) or (Any,)
        return [p for i, v in enumerate(value) for p in _unknown_in(inner, v, f"{where}[{i}]")]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return unknown_fields(annotation, value, where)
    return []


def _check(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate `body` with `model`, refusing unknown fields (the real API ignores none)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    extra = unknown_fields(model, body)
    if extra:
        raise ApiError(400, f"unknown field(s): {', '.join(extra)}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ApiError(400, f"invalid {model.__name__}: {exc}") from None


@dataclass
class Job:
    """One Lepton job as the loopback server keeps it."""

    id: str
    body: dict[str, Any]
    created: float
    phases: list[tuple[float, str]]
    message: str = ""
    replica_ids: list[str] = field(default_factory=list)
    log: str | None = None
    waiting: bool = False  # Queueing for nodes of its group
    events: list[dict[str, Any]] = field(default_factory=list)  # GET /jobs/{id}/events
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    log_files: dict[str, Path] = field(default_factory=dict)  # replica id -> its output (execute)

    @property
    def group_id(self) -> str | None:
        """The dedicated node group it runs in (its affinity's first)."""
        groups = (self.spec.get("affinity") or {}).get("allowed_dedicated_node_groups") or []
        return str(groups[0]) if groups else None

    @property
    def priority_rank(self) -> int:
        """Where its queue priority class stands (higher goes first)."""
        priority = (self.spec.get("queue_config") or {}).get("priority_class") or "mid-4000"
        return PRIORITY_CLASSES.index(priority)

    @property
    def spec(self) -> dict[str, Any]:
        return self.body.get("spec") or {}

    @property
    def parallelism(self) -> int:
        return int(self.spec.get("parallelism") or 1)

    def state(self, now: float) -> str:
        current = self.phases[0][1]
        for start, phase in self.phases:
            if start <= now:
                current = phase
        return current

    @property
    def labels(self) -> dict[str, str]:
        return dict((self.body.get("metadata") or {}).get("labels") or {})

    def env(self) -> dict[str, str]:
        """Plain env vars of the job (secret references are not resolved here)."""
        return {
            e["name"]: e["value"] for e in self.spec.get("envs") or [] if e.get("value") is not None
        }

    def as_json(self, now: float) -> dict[str, Any]:
        state = self.state(now)
        n = self.parallelism
        running = state in ("Running", "Stopping")
        done = state in ("Completed", "Failed", "Stopped")
        metadata = {**(self.body.get("metadata") or {}), "id": self.id}
        metadata.setdefault("name", self.id)
        metadata["created_at"] = int(self.created * 1000)
        return {
            "metadata": metadata,
            "spec": self.spec,
            "status": {
                "job_name": self.id,
                "state": state,
                "ready": n if running else 0,
                "active": n if running or state == "Starting" else 0,
                "succeeded": n if state == "Completed" else 0,
                "failed": n if state == "Failed" else 0,
                "creation_time": int(self.created),
                "completion_time": int(max(s for s, _ in self.phases if s <= now))
                if done
                else None,
                "job_history": [],
            },
        }


@dataclass
class RayClusterRecord:
    """One Lepton Ray cluster."""

    name: str
    body: dict[str, Any]
    created: float
    ready_at: float


class LeptonServer(LoopbackHttpServer):
    """A loopback Lepton workspace; `env()` gives the LEPTON_WORKSPACE_* variables for it.

    Knobs: `start_s` / `running_s` (state durations), `outcome`, `set_outcome(prefix, state)`,
    `hold(prefix)` (runs until stopped or deleted), `stopping_s`, `set_log(job_id, text)`,
    `fail(job_id, reason, node)` (a live job Failed now, its events saying why),
    `ray_dashboard(url, token)` (where Ray cluster dashboards are proxied to),
    `data_mover_s` (NeMo-Run's ``data-mover-*`` jobs complete after this long; 0 = already
    Completed when first read, so NeMo-Run's 5 s poll sleep is skipped in tests).

    With `execute=True` the pods really run, as local processes: each replica runs the job's
    ``container.command`` with `pod_env` (plain env values only; secret references are not
    resolved), in a directory of its own, from the time Running begins (a data mover's at once,
    before its creation is answered, so it is Completed when first read); mounts' ``mount_path``
    are this machine's paths. The job is Running while any replica runs, then Completed if all
    exited 0, else Failed (`outcome`, `set_outcome` and `running_s` do not apply); a replica's
    log endpoint serves its real output (stdout and stderr), following it while the job is live.
    Stop (``PATCH``), delete and `fail` terminate the replicas, and so does closing the server.
    `POD_IMAGE` says what such a pod finds besides this machine's own userland.
    """

    thread_name = "loopback-lepton"

    def __init__(
        self,
        *,
        workspace_id: str = "ws-loopback",
        token: str = "",
        node_groups: dict[str, int] | None = None,
        start_s: float = 0.2,
        running_s: float = 0.6,
        stopping_s: float = 0.3,
        ray_ready_s: float = 0.3,
        outcome: str = "Completed",
        data_mover_s: float = 0.0,
        log_tick_s: float = 0.5,
        execute: bool = False,
    ) -> None:
        super().__init__()
        self.execute = execute
        # where executed replicas run and write their output; removed on close
        self._pods_dir = Path(tempfile.mkdtemp(prefix="loopback-lepton-")) if execute else None
        self.log_tick_s = log_tick_s
        self.data_mover_s = data_mover_s
        self.workspace_id = workspace_id
        self.token = token or secrets.token_urlsafe(24)
        # node group name -> node count; ids are generated
        self.node_groups = {
            name: (f"ng-{secrets.token_hex(4)}", count)
            for name, count in (node_groups or {"nemo-nodes": 2}).items()
        }
        self.start_s = start_s
        self.running_s = running_s
        self.stopping_s = stopping_s
        self.ray_ready_s = ray_ready_s
        self.outcome = outcome
        self.jobs: dict[str, Job] = {}
        self.deleted: list[str] = []
        self.rayclusters: dict[str, RayClusterRecord] = {}
        self._ray_target: tuple[str, str | None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def api_url(self) -> str:
        """The workspace API URL (LEPTON_WORKSPACE_URL)."""
        return f"{self.url}/api/v2/workspaces/{self.workspace_id}"

    def env(self) -> dict[str, str]:
        """LEPTON_WORKSPACE_ID / TOKEN / URL for leptonai's APIClient()."""
        return {
            "LEPTON_WORKSPACE_ID": self.workspace_id,
            "LEPTON_WORKSPACE_TOKEN": self.token,
            "LEPTON_WORKSPACE_URL": self.api_url,
        }

    # knobs ------------------------------------------------------------------------------------

    def set_log(self, job_id: str, text: str) -> None:
        """What the job's replicas print."""
        with self.lock:
            self.jobs[job_id].log = text

    def fail(self, job_id: str, reason: str, node: str | None = None) -> None:
        """End a live job Failed now, as its platform would when a replica's node is lost or
        the replica is evicted or preempted: its events (``GET /jobs/{id}/events``, leptonai's
        ``LeptonEvent``s) carry `reason` in Kubernetes' words, about `node` when given."""
        now = time.time()
        with self.lock:
            job = self.jobs[job_id]
            job.phases = [p for p in job.phases if p[0] <= now] + [(now, "Failed")]
            job.waiting = False
            _kill(job)
            regarding = {"kind": "Node", "name": node} if node else {"kind": "Pod"}
            job.events.append(
                {
                    "type": "Warning",
                    "reason": reason,
                    "regarding": regarding,
                    "count": 1,
                    "last_observed_time": datetime.fromtimestamp(now, UTC).isoformat(),
                }
            )

    def ray_dashboard(self, url: str, token: str | None = None) -> None:
        """Proxy every Ray cluster's dashboard to this (real) Ray dashboard."""
        self._ray_target = (url.rstrip("/"), token)

    def pod_env(self, job: Job, rank: int = 0) -> dict[str, str]:
        """The environment a replica of `job` starts with (Lepton sets the rank variables)."""
        return {
            **job.env(),
            "LEPTON_JOB_WORKER_INDEX": str(rank),
            "LEPTON_JOB_TOTAL_WORKERS": str(job.parallelism),
        }

    # routes -----------------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        base = f"/api/v2/workspaces/{self.workspace_id}"
        r = app.router
        r.add_get(base + "/dedicated-node-groups", self._node_groups)
        r.add_get(base + "/dedicated-node-groups/{id}", self._node_group)
        r.add_get(base + "/dedicated-node-groups/{id}/nodes", self._nodes)
        r.add_get(base + "/jobs", self._list_jobs)
        r.add_post(base + "/jobs", self._create_job)
        r.add_get(base + "/jobs/{id}", self._get_job)
        r.add_patch(base + "/jobs/{id}", self._patch_job)
        r.add_delete(base + "/jobs/{id}", self._delete_job)
        r.add_get(base + "/jobs/{id}/events", self._events)
        r.add_get(base + "/jobs/{id}/replicas", self._replicas)
        r.add_get(base + "/jobs/{id}/replicas/{rid}/log", self._log)
        r.add_get(base + "/rayclusters", self._list_ray)
        r.add_post(base + "/rayclusters", self._create_ray)
        r.add_get(base + "/rayclusters/{name}", self._get_ray)
        r.add_delete(base + "/rayclusters/{name}", self._delete_ray)
        r.add_route("*", base + "/rayclusters/{name}/dashboard/{tail:.*}", self._dashboard)

    async def on_shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:  # the server owns every replica it started: none outlives it
            _kill(job)
        for job in jobs:
            for proc in job.processes:
                try:
                    await asyncio.to_thread(proc.wait, 5)
                except subprocess.TimeoutExpired:
                    _kill(job, signal.SIGKILL)
                    await asyncio.to_thread(proc.wait)
        if self._pods_dir is not None:
            shutil.rmtree(self._pods_dir, ignore_errors=True)

    def _auth(self, request: web.Request) -> None:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized: invalid or missing workspace token")

    # node groups ------------------------------------------------------------------------------

    def _group_json(self, name: str) -> dict[str, Any]:
        gid, count = self.node_groups[name]
        return {
            "metadata": {"id": gid, "name": name},
            "spec": {"workspaces": [self.workspace_id], "desired_nodes": count},
            "status": {"ready_nodes": count},
        }

    def _group_by_id(self, gid: str) -> str:
        for name, (group_id, _) in self.node_groups.items():
            if gid in (group_id, name):
                return name
        raise ApiError(404, f"dedicated node group '{gid}' not found")

    async def _node_groups(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response([self._group_json(n) for n in self.node_groups])

    async def _node_group(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response(self._group_json(self._group_by_id(request.match_info["id"])))

    async def _nodes(self, request: web.Request) -> web.Response:
        self._auth(request)
        name = self._group_by_id(request.match_info["id"])
        gid, count = self.node_groups[name]
        return web.json_response(
            [
                {
                    "metadata": {"id": f"{gid}-node-{i}", "name": f"{name}-{i}"},
                    "spec": {"dedicated_node_group": gid, "unschedulable": False},
                    "status": {"status": ["Ready"]},
                }
                for i in range(count)
            ]
        )

    # jobs -------------------------------------------------------------------------------------

    async def _create_job(self, request: web.Request) -> web.Response:
        from leptonai.api.v1.types.job import LeptonJob

        self._auth(request)
        body = await request.json()
        job = _check(LeptonJob, body)
        job_id = job.metadata.id_ or ""  # type: ignore[attr-defined]
        if not _JOB_ID.match(job_id) or len(job_id) > _JOB_ID_MAX:
            raise ApiError(
                400,
                f"metadata.id: '{job_id}' must be 1-{_JOB_ID_MAX} lowercase letters, digits and "
                "'-', starting with a letter",
            )
        affinity = (body.get("spec") or {}).get("affinity") or {}
        ids = {gid for gid, _ in self.node_groups.values()}
        for gid in affinity.get("allowed_dedicated_node_groups") or []:
            if gid not in ids:
                raise ApiError(400, f"spec.affinity: dedicated node group '{gid}' not found")
        priority = ((body.get("spec") or {}).get("queue_config") or {}).get("priority_class")
        if priority is not None and priority not in PRIORITY_CLASSES:
            raise ApiError(
                400,
                f"spec.queue_config.priority_class: '{priority}' is not one of "
                + ", ".join(PRIORITY_CLASSES),
            )
        now = time.time()
        with self.lock:
            if job_id in self.jobs:
                raise ApiError(409, f"job '{job_id}' already exists")
            self._admit(now)
            record = Job(job_id, body, now, self._schedule(job_id, now))
            failure = _exec_failure(record)
            if failure:  # the pod cannot even start its command
                record.phases = [(now, "Starting"), (now + self.start_s, "Failed")]
                record.message = failure
                record.log = failure + "\n"
            elif not job_id.startswith("data-mover-") and self._must_wait(record, now):
                record.phases, record.waiting = [(now, "Queueing")], True
            n = record.parallelism
            record.replica_ids = [f"{job_id}-{i}-{secrets.token_hex(3)}" for i in range(n)]
            self.jobs[job_id] = record
            if self.execute and not failure and not record.waiting:
                if job_id.startswith("data-mover-"):
                    self._start_pods(record, wait=True)
                else:
                    self._start_pods(record)
        if record.processes and job_id.startswith("data-mover-"):  # done before it is read
            await asyncio.to_thread(self._end_by_exit_codes, record)
        return web.json_response(record.as_json(time.time()))

    def _start_pods(self, job: Job, *, wait: bool = False) -> None:
        """Run `job`'s replicas (execute mode): now when `wait` (the caller waits for them,
        holding the lock), else in a thread from the time Running begins."""
        if wait:
            self._spawn(job)
            return
        threading.Thread(
            target=self._run_pods, args=(job,), name="loopback-lepton-pods", daemon=True
        ).start()

    def _run_pods(self, job: Job) -> None:
        """Start the replicas when Running begins, then end the job by their exit codes."""
        with self.lock:
            start = max(t for t, phase in job.phases if phase == "Running")
        time.sleep(max(0.0, start - time.time()))
        with self.lock:
            if self.jobs.get(job.id) is not job or job.state(time.time()) != "Running":
                return  # stopped, failed or deleted before its pods started
            self._spawn(job)
        self._end_by_exit_codes(job)

    def _spawn(self, job: Job) -> None:
        """Start one process per replica, its output in its log file. Called with the lock."""
        assert self._pods_dir is not None
        command = [str(a) for a in (job.spec.get("container") or {}).get("command") or []]
        image = self._pods_dir / "pod-image.sh"
        if not image.exists():
            image.write_text(POD_IMAGE)
        for rank, rid in enumerate(job.replica_ids):
            root = self._pods_dir / rid
            root.mkdir()
            job.log_files[rid] = log = self._pods_dir / f"{rid}.log"
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(root),
                "BASH_ENV": str(image),
                "LOOPBACK_LEPTON_POD_ROOT": str(root),
                **self.pod_env(job, rank),
            }
            with open(log, "wb") as out:
                try:
                    proc = subprocess.Popen(
                        command or ["false"], env=env, cwd=root, stdout=out,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True,  # its own group: stop ends its children too
                    )  # fmt: skip
                except OSError as exc:  # no such executable: the replica fails at once
                    out.write(f"exec {command[0]}: {exc.strerror}\n".encode())
                    proc = subprocess.Popen(["false"], stdout=subprocess.DEVNULL)
            job.processes.append(proc)

    def _end_by_exit_codes(self, job: Job) -> None:
        """Wait for the replicas; a job still live then ends Completed (all 0) or Failed."""
        codes = [proc.wait() for proc in list(job.processes)]
        with self.lock:
            if job.state(time.time()) in ("Starting", "Running"):
                end = "Completed" if all(c == 0 for c in codes) else "Failed"
                job.phases.append((time.time(), end))

    def _schedule(self, job_id: str, now: float) -> list[tuple[float, str]]:
        if job_id.startswith("data-mover-"):
            if self.execute:  # its process decides when and how it ends
                return [(now, "Starting")]
            return [(now, "Starting"), (now + self.data_mover_s, "Completed")]
        end = self.end_of(job_id)
        phases = [(now, "Starting"), (now + self.start_s, "Running")]
        if end is not None and not self.execute:
            phases.append((now + self.start_s + self.running_s, end))
        return phases

    def _must_wait(self, job: Job, now: float) -> bool:
        """True when `job` does not fit in the free nodes of its group now, or another job of
        the group waits ahead of it (same or higher priority: no overtaking)."""
        gid = job.group_id
        count = next((n for g, n in self.node_groups.values() if g == gid), None)
        if count is None:
            return False
        busy = sum(
            j.parallelism
            for j in self.jobs.values()
            if j is not job and j.group_id == gid and not j.waiting and j.state(now) in _HOLDING
            and any(phase == "Starting" for _, phase in j.phases)  # it got nodes
        )  # fmt: skip
        ahead = any(
            j.waiting and j is not job and j.group_id == gid
            and (-j.priority_rank, j.created) < (-job.priority_rank, job.created)
            for j in self.jobs.values()
        )  # fmt: skip
        return ahead or busy + job.parallelism > count

    def _admit(self, now: float) -> None:
        """Start the queued jobs that fit now, in queue order. Called with the lock held, on
        every request: the clock decides when nodes free up."""
        queued = sorted(
            (j for j in self.jobs.values() if j.waiting),
            key=lambda j: (-j.priority_rank, j.created),
        )
        for job in queued:
            if not self._must_wait(job, now):
                job.waiting = False
                job.phases += [(t, phase) for t, phase in self._schedule(job.id, now)]
                if self.execute:
                    self._start_pods(job)

    def _job(self, request: web.Request) -> Job:
        with self.lock:
            self._admit(time.time())
            job = self.jobs.get(request.match_info["id"])
        if job is None:
            raise ApiError(404, f"job '{request.match_info['id']}' not found")
        return job

    async def _get_job(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response(self._job(request).as_json(time.time()))

    async def _events(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = self._job(request)
        with self.lock:
            return web.json_response(list(job.events))

    async def _list_jobs(self, request: web.Request) -> web.Response:
        self._auth(request)
        q = request.query.get("q", "")
        selector = request.query.get("query", "")
        mode = request.query.get("job_query_mode", "alive_only")
        page = int(request.query.get("page", "1"))
        size = int(request.query.get("page_size", "50"))
        now = time.time()
        with self.lock:
            self._admit(now)
            jobs = [
                j.as_json(now)
                for j in self.jobs.values()
                if q in j.id and selects(selector, j.labels)
            ]
        if mode == "alive_only":
            jobs = [j for j in jobs if j["status"]["state"] not in ("Completed", "Failed")]
        elif mode == "archive_only":
            jobs = [j for j in jobs if j["status"]["state"] in ("Completed", "Failed")]
        start = (page - 1) * size
        return web.json_response({"jobs": jobs[start : start + size], "total": len(jobs)})

    async def _patch_job(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = self._job(request)
        body = await request.json()
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, dict) or set(spec) - {"stopped"}:
            raise ApiError(400, "only spec.stopped can be changed on a job")
        now = time.time()
        with self.lock:
            if spec.get("stopped") and job.state(now) not in ("Completed", "Failed", "Stopped"):
                job.phases = [p for p in job.phases if p[0] <= now]
                job.phases += [(now, "Stopping"), (now + self.stopping_s, "Stopped")]
                job.spec["stopped"] = True
                job.waiting = False  # a stopped job leaves the queue
                _kill(job)
            self._admit(now)
        return web.json_response(job.as_json(now))

    async def _delete_job(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = self._job(request)
        with self.lock:
            self.jobs.pop(job.id, None)
            self.deleted.append(job.id)
            _kill(job)
            self._admit(time.time())
        return web.json_response({})

    async def _replicas(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = self._job(request)
        if job.state(time.time()) == "Starting":
            return web.json_response([])
        return web.json_response(
            [
                {"metadata": {"id": rid, "name": rid}, "id": rid, "status": {}}
                for rid in job.replica_ids
            ]
        )

    async def _log(self, request: web.Request) -> web.StreamResponse:
        """The replica's log; while the job runs the stream stays open (as Lepton's does),
        one line every `log_tick_s`, until the job ends or the client goes."""
        self._auth(request)
        job = self._job(request)
        rid = request.match_info["rid"]
        if rid not in job.replica_ids:
            raise ApiError(404, f"replica '{rid}' of job '{job.id}' not found")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        if job.log is None and rid in job.log_files:
            return await self._real_log(job, job.log_files[rid], response)
        state = job.state(time.time())
        await response.write(
            (job.log or f"[loopback lepton] {rid}: job {job.id} is {state}\n").encode()
        )
        try:
            while state in ("Starting", "Running", "Stopping"):
                await asyncio.sleep(self.log_tick_s)
                state = job.state(time.time())
                await response.write(f"[loopback lepton] {rid}: {state}\n".encode())
            await response.write_eof()
        except ConnectionError:  # the client stopped reading (aiohttp's reset error is one)
            pass
        return response

    async def _real_log(
        self, job: Job, path: Path, response: web.StreamResponse
    ) -> web.StreamResponse:
        """An executed replica's output: what it printed so far, then what it prints, until the
        job has ended (all of it read then) or the client goes."""
        offset = 0
        try:
            while True:
                ended = job.state(time.time()) in _ENDED  # before the read: nothing is missed
                with open(path, "rb") as log:
                    log.seek(offset)
                    chunk = log.read()
                if chunk:
                    offset += len(chunk)
                    await response.write(chunk)
                if ended:
                    break
                await asyncio.sleep(0.1)
            await response.write_eof()
        except ConnectionError:  # the client stopped reading
            pass
        return response

    # Ray clusters -----------------------------------------------------------------------------

    def _ray_json(self, record: RayClusterRecord, now: float) -> dict[str, Any]:
        state = "Ready" if now >= record.ready_at else "Starting"
        workers = sum(
            (g.get("min_replicas") or 0)
            for g in (record.body.get("spec") or {}).get("worker_group_specs") or []
        )
        return {
            **record.body,
            "status": {
                "state": state,
                "readyWorkerReplicas": workers if state == "Ready" else 0,
                "desiredWorkerReplicas": workers,
            },
        }

    async def _create_ray(self, request: web.Request) -> web.Response:
        from leptonai.api.v1.types.raycluster import LeptonRayCluster

        self._auth(request)
        body = await request.json()
        cluster = _check(LeptonRayCluster, body)
        name = (cluster.metadata.id_ if cluster.metadata else None) or ""  # type: ignore[union-attr]
        if not _JOB_ID.match(name) or len(name) > _JOB_ID_MAX:
            raise ApiError(400, f"metadata.id: '{name}' is not a valid Ray cluster name")
        now = time.time()
        with self.lock:
            if name in self.rayclusters:
                raise ApiError(409, f"raycluster '{name}' already exists")
            self.rayclusters[name] = RayClusterRecord(name, body, now, now + self.ray_ready_s)
        return web.json_response({})

    def _ray_record(self, request: web.Request) -> RayClusterRecord:
        with self.lock:
            record = self.rayclusters.get(request.match_info["name"])
        if record is None:
            raise ApiError(404, f"raycluster '{request.match_info['name']}' not found")
        return record

    async def _list_ray(self, request: web.Request) -> web.Response:
        self._auth(request)
        now = time.time()
        with self.lock:
            records = list(self.rayclusters.values())
        return web.json_response([self._ray_json(r, now) for r in records])

    async def _get_ray(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response(self._ray_json(self._ray_record(request), time.time()))

    async def _delete_ray(self, request: web.Request) -> web.Response:
        self._auth(request)
        record = self._ray_record(request)
        with self.lock:
            self.rayclusters.pop(record.name, None)
        return web.json_response({})

    async def _dashboard(self, request: web.Request) -> web.Response:
        self._auth(request)
        record = self._ray_record(request)
        if time.time() < record.ready_at:
            raise ApiError(503, f"raycluster '{record.name}' is not ready")
        if self._ray_target is None:
            raise ApiError(502, "no Ray dashboard behind this loopback workspace")
        target, token = self._ray_target
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        url = f"{target}/{request.match_info['tail']}"
        async with self._session.request(
            request.method,
            url,
            params=request.query,
            data=await request.read(),
            headers=headers,
            allow_redirects=False,
        ) as upstream:
            payload = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            return web.Response(body=payload, status=upstream.status, headers=out)


def selects(selector: str, labels: dict[str, str]) -> bool:
    """A Kubernetes-style equality label selector (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``,
    comma-separated, all must hold) applied to `labels`; an empty selector selects all."""
    for requirement in filter(None, (r.strip() for r in selector.split(","))):
        key, op, value = re.fullmatch(r"(!?[^=!]+)(==|!=|=)?(.*)", requirement).groups()  # type: ignore[union-attr]
        if op is None:
            held = key.startswith("!") != (key.lstrip("!") in labels)
        elif op == "!=":
            held = labels.get(key) != value
        else:
            held = labels.get(key) == value
        if not held:
            return False
    return True


def _kill(job: Job, sig: int = signal.SIGTERM) -> None:
    """Signal every live replica of `job` (its whole process group)."""
    for proc in job.processes:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)


def _exec_failure(job: Job) -> str:
    """Why the pod's exec would fail (E2BIG), or '' when argv and env fit Linux's limits."""
    argv = (job.spec.get("container") or {}).get("command") or []
    env = [f"{k}={v}" for k, v in job.env().items()]
    for what, strings in (("command argument", argv), ("environment variable", env)):
        for i, s in enumerate(strings):
            size = len(s.encode()) + 1
            if size > MAX_ARG_STRLEN:
                return (
                    f"exec /bin/sh: argument list too long ({what} #{i} is {size} bytes, over "
                    f"MAX_ARG_STRLEN={MAX_ARG_STRLEN})"
                )
    total = sum(len(s.encode()) + 1 + 8 for s in [*argv, *env])
    if total > ARG_MAX:
        return f"exec /bin/sh: argument list too long (argv + env are {total} bytes > {ARG_MAX})"
    return ""
