"""A loopback run:ai (DGX Cloud) REST API on 127.0.0.1, for NeMo-Run's DGXCloudExecutor unchanged.

Serves what NeMo-Run and our backend call under ``{url}/api/v1``: ``POST /token``
(client_credentials; a wrong secret is 401, tokens expire after ``token_ttl_s``),
``GET /org-unit/projects``, ``POST/GET/DELETE /workloads/{workspaces,trainings,distributed}``,
``POST .../{id}/suspend`` and ``/resume``, ``GET /workloads?filterBy=name==...`` (each item
with its ``projectName`` and ``environmentVariables``, a name-to-value object, as run:ai's
``Workload`` schema has them since API 2.19; its labels are not in the list) and
``GET /workloads/{id}`` (one item of that schema: ``phase``, ``phaseMessage``,
``priorityClassName``). Workload phases (Creating → Initializing → Running →
Completed/Failed, Stopping → Stopped on suspend) follow the clock and the server's knobs;
nothing runs. A project with a GPU quota (`set_quota`) holds a workload that does not fit in
what is left of it ``Pending`` (run:ai's "waiting for the scheduler"), with a ``phaseMessage``
saying so, until running workloads of the project end (higher ``priorityClass`` first, then
in order of creation). Payloads are checked as the real service
checks them (required fields, an env var value <= 10,000 characters, args <= 9,500, labels and
annotations as ``{name, value, exclude}`` items with a name of 1-63 characters) and a
rejected one is a 400 with a message. Every request is recorded for tests.

`LoopbackHttpServer` (an aiohttp app on its own event loop thread) is shared with the loopback
Lepton server in `prefect_nemo.testing.lepton`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from prefect_nemo.testing.app_thread import AppThread

#: run:ai rejects an environment variable value longer than this.
ENV_VALUE_LIMIT = 10_000
#: run:ai rejects workload args longer than about this (NeMo-Run's MAX_ARGS_CHARS).
ARGS_LIMIT = 9_500
#: Kinds of workloads by the path segment that names them.
KINDS = {"workspaces": "Workspace", "trainings": "Training", "distributed": "Distributed"}
TERMINAL_PHASES = {"Completed", "Failed", "Stopped", "Degraded"}
#: The priority classes run:ai's workload API takes in ``spec.priorityClass``, lowest first:
#: the 2.2x names ("very-low" ... "very-high") and the older dictionary's ("build", "train",
#: "inference", "interactive-preemptible").
PRIORITY_CLASSES = (
    "very-low", "low", "medium-low", "medium", "medium-high", "high", "very-high",
    "interactive-preemptible", "train", "build", "inference",
)  # fmt: skip
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX = 35  # longer names are refused (NeMo-Run shortens to 34 for this reason)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat().replace("+00:00", "Z") if ts else None


class ApiError(Exception):
    """An error answer: status and message, sent as ``{"code": status, "message": ...}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server answered."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    status: int = 0


@dataclass
class RequestRecord:
    """Every request a loopback server answered, in order."""

    entries: list[RecordedRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, entry: RecordedRequest) -> None:
        with self._lock:
            self.entries.append(entry)

    def find(self, method: str | None = None, path: str = "") -> list[RecordedRequest]:
        """Requests with this method (any if None) whose path contains `path`."""
        with self._lock:
            return [
                e
                for e in self.entries
                if (method is None or e.method == method.upper()) and path in e.path
            ]

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


class LoopbackHttpServer:
    """An aiohttp server on 127.0.0.1 (free port) on its own event loop thread.

    Subclasses add routes in `routes()`; `ApiError` raised by a handler becomes a JSON error
    answer; every request is recorded in `requests`; `fail_next` injects one error answer.
    """

    thread_name = "loopback-http"
    #: How a job ends unless `set_outcome` says otherwise (a state or phase of the service).
    outcome = "Completed"

    def __init__(self) -> None:
        self.url = ""
        self.requests = RequestRecord()
        self.lock = threading.RLock()
        self._faults: list[tuple[str, str, int, str]] = []
        self._outcomes: dict[str, str] = {}
        self._held: set[str] = set()
        self._server = AppThread(self.thread_name)

    def set_outcome(self, prefix: str, end: str) -> None:
        """Jobs whose name starts with `prefix` end in `end` (e.g. "Completed" or "Failed")."""
        with self.lock:
            self._outcomes[prefix] = end

    def hold(self, prefix: str) -> None:
        """Jobs whose name starts with `prefix` keep running until stopped."""
        with self.lock:
            self._held.add(prefix)

    def end_of(self, name: str) -> str | None:
        """How a job of this name ends: its `set_outcome`, else `outcome`; None when held."""
        with self.lock:
            if any(name.startswith(prefix) for prefix in self._held):
                return None
            return next((e for p, e in self._outcomes.items() if name.startswith(p)), self.outcome)

    def routes(self, app: web.Application) -> None:
        """Add the server's routes to `app`."""
        raise NotImplementedError

    def fail_next(self, method: str, path_suffix: str, status: int, message: str) -> None:
        """Answer the next `method` request whose path ends with `path_suffix` with an error."""
        with self.lock:
            self._faults.append((method.upper(), path_suffix, status, message))

    def _fault(self, request: web.Request) -> ApiError | None:
        with self.lock:
            for fault in self._faults:
                method, suffix, status, message = fault
                if request.method == method and request.path.endswith(suffix):
                    self._faults.remove(fault)
                    return ApiError(status, message)
        return None

    def start(self) -> LoopbackHttpServer:
        """Start serving on a free port; returns self."""
        if self._server.running:
            return self

        def app() -> web.Application:
            app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._middleware])
            self.routes(app)
            return app

        self.url = f"http://127.0.0.1:{self._server.start(app)}"
        return self

    def stop(self) -> None:
        """Stop serving and end the thread."""
        self._server.stop(self.on_shutdown)

    async def on_shutdown(self) -> None:
        """Close what subclasses opened (client sessions)."""

    def __enter__(self) -> LoopbackHttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        try:
            fault = self._fault(request)
            if fault is not None:
                raise fault
            response = await handler(request)
        except ApiError as exc:
            response = web.json_response(
                {"code": exc.status, "message": exc.message}, status=exc.status
            )
        except web.HTTPException as exc:
            response = web.json_response(
                {"code": exc.status, "message": exc.reason}, status=exc.status
            )
        query: dict[str, list[str]] = {}
        for key, value in request.query.items():
            query.setdefault(key, []).append(value)
        self.requests.add(
            RecordedRequest(
                request.method,
                request.path,
                query,
                dict(request.headers),
                body,
                response.status,
            )
        )
        return response


# ----------------------------------------------------------------------------- run:ai


@dataclass
class Workload:
    """One run:ai workload as the loopback server keeps it."""

    id: str
    kind: str  # path segment: workspaces / trainings / distributed
    name: str
    requested_name: str
    project_id: str
    cluster_id: str
    spec: dict[str, Any]
    created: float
    phases: list[tuple[float, str]]  # (from time, phase), in order
    deleted: float | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    project_name: str = ""
    waiting: str = ""  # while queued for quota: the scheduler's message (phaseMessage)
    failure: tuple[str, str] | None = None  # (reason, message) of a `RunaiServer.fail`

    @property
    def gpus(self) -> int:
        """GPUs the workload holds while it runs: its pods' gpuDevicesRequest."""
        per_pod = int((self.spec.get("compute") or {}).get("gpuDevicesRequest") or 0)
        return per_pod * self.replicas

    @property
    def priority_rank(self) -> int:
        """Where its ``spec.priorityClass`` stands (higher goes first; unset is "train")."""
        return PRIORITY_CLASSES.index(self.spec.get("priorityClass") or "train")

    @property
    def replicas(self) -> int:
        """Pods of the workload: numWorkers of a distributed one, else one."""
        return int(self.spec.get("numWorkers") or 1) if self.kind == "distributed" else 1

    def argv(self) -> list[str]:
        """The container's command line: ``command`` split on blanks, ``args`` shell-split."""
        command = (self.spec.get("command") or "").split()
        return command + shlex.split(self.spec.get("args") or "")

    def phase(self, now: float) -> str:
        """The phase at `now`."""
        current = self.phases[0][1]
        for start, phase in self.phases:
            if start <= now:
                current = phase
        return current

    def env(self) -> dict[str, str]:
        """The environment variables the workload was created with."""
        return {e["name"]: e.get("value", "") for e in self.spec.get("environmentVariables") or []}

    def as_json(self, now: float) -> dict[str, Any]:
        phase = self.phase(now)
        return {
            "name": self.name,
            "requestedName": self.requested_name,
            "workloadId": self.id,
            "projectId": self.project_id,
            "clusterId": self.cluster_id,
            "createdBy": "loopback@example.com",
            "createdAt": _iso(self.created),
            "desiredPhase": "Stopped" if phase in ("Stopping", "Stopped") else "Running",
            "actualPhase": phase,
            "spec": self.spec,
        }

    def _failed_message(self, phase: str) -> str:
        return self.failure[1] if phase == "Failed" and self.failure else ""

    def _conditions(self, phase: str) -> list[dict[str, str]]:
        """A failed one's condition saying why (the Workload schema's type, status, reason,
        message); none otherwise."""
        if phase != "Failed" or not self.failure:
            return []
        reason, message = self.failure
        return [{"type": "Failed", "status": "True", "reason": reason, "message": message}]

    def list_item(self, now: float, project_name: str) -> dict[str, Any]:
        phase = self.phase(now)
        return {
            "id": self.id,
            "name": self.name,
            "type": KINDS[self.kind],
            "phase": phase,
            "projectId": self.project_id,
            "projectName": project_name,
            "environmentVariables": self.env(),
            "clusterId": self.cluster_id,
            "createdAt": _iso(self.created),
            "phaseUpdatedAt": _iso(max(s for s, _ in self.phases if s <= now)),
            "phaseMessage": self.waiting if phase == "Pending" else self._failed_message(phase),
            "conditions": self._conditions(phase),
            "priorityClassName": self.spec.get("priorityClass") or "train",
            "deletedAt": _iso(self.deleted),
        }


class RunaiServer(LoopbackHttpServer):
    """A loopback run:ai control plane; point NeMo-Run's ``base_url`` at `base_url`.

    Knobs: `token_ttl_s` (tokens expire, then 401 until a new one is fetched),
    `expire_tokens()`, `creating_s` / `initializing_s` / `running_s` (phase durations),
    `outcome` ("Completed" or "Failed") or `set_outcome(prefix, phase)` per workload,
    `hold(prefix)` (stays Running until suspended), `fail(name, reason, message)` (a live
    workload Failed now, its pods killed, saying why), `stopping_s`, `set_quota(project, gpus)`
    (workloads that do not fit wait ``Pending``).

    With `execute=True` the pods really run, as local processes: once Initializing is over,
    each replica's ``command`` + ``args`` runs with `pod_env` (paths as in the spec, so point
    the PVCs at a local directory); the workload is Running while any runs, then Completed if
    all exited 0, else Failed; suspend terminates them (Stopped).
    """

    thread_name = "loopback-runai"

    def __init__(
        self,
        *,
        client_id: str = "prefect-nemo-app",
        client_secret: str = "",
        projects: dict[str, str] | None = None,
        token_ttl_s: float = 3600.0,
        creating_s: float = 0.2,
        initializing_s: float = 0.2,
        running_s: float = 0.6,
        stopping_s: float = 0.3,
        outcome: str = "Completed",
        execute: bool = False,
    ) -> None:
        super().__init__()
        self.execute = execute
        self.client_id = client_id
        self.client_secret = client_secret or secrets.token_urlsafe(18)
        self.cluster_id = str(uuid.uuid4())
        self.projects = dict(projects or {"nemo-project": "4501"})  # name -> id
        self.token_ttl_s = token_ttl_s
        self.creating_s = creating_s
        self.initializing_s = initializing_s
        self.running_s = running_s
        self.stopping_s = stopping_s
        self.outcome = outcome
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic clock)
        self.issued_tokens: list[str] = []  # every token ever handed out, for leak scans
        self.workloads: dict[str, Workload] = {}
        self.quotas: dict[str, int] = {}  # project name -> GPUs (no entry: no limit)

    @property
    def base_url(self) -> str:
        """The API base URL NeMo-Run's DGXCloudExecutor takes as ``base_url``."""
        return f"{self.url}/api/v1"

    # knobs ------------------------------------------------------------------------------------

    def expire_tokens(self) -> None:
        """Every token issued so far stops working (401) until the client fetches a new one."""
        with self.lock:
            self.tokens.clear()

    def set_quota(self, project: str, gpus: int | None) -> None:
        """The project's GPU quota (None: no limit); workloads waiting for it are scheduled
        as soon as they fit."""
        with self.lock:
            if gpus is None:
                self.quotas.pop(project, None)
            else:
                self.quotas[project] = gpus
            self._admit(time.time())

    def by_name(self, requested_name: str) -> list[Workload]:
        """Workloads created with this requested name (prefix names get a random suffix)."""
        with self.lock:
            return [w for w in self.workloads.values() if w.requested_name == requested_name]

    def pod_env(self, workload: Workload, rank: int = 0) -> dict[str, str]:
        """The environment a pod of `workload` starts with: its env vars plus what the
        training operator sets (RANK, WORLD_SIZE, MASTER_ADDR, a ``-worker-<rank>`` hostname)."""
        return {
            **workload.env(),
            "RANK": str(rank),
            "WORLD_SIZE": str(workload.replicas),
            "MASTER_ADDR": "127.0.0.1",
            "HOSTNAME": f"{workload.name}-worker-{rank}",
        }

    # routes -----------------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/api/v1/token", self._token)
        r.add_get("/api/v1/org-unit/projects", self._projects)
        r.add_get("/api/v1/workloads", self._list)
        r.add_get("/api/v1/workloads/{id}", self._get_any)
        r.add_post("/api/v1/workloads/{kind}", self._create)
        r.add_get("/api/v1/workloads/{kind}/{id}", self._get)
        r.add_delete("/api/v1/workloads/{kind}/{id}", self._delete)
        r.add_post("/api/v1/workloads/{kind}/{id}/suspend", self._suspend)
        r.add_post("/api/v1/workloads/{kind}/{id}/resume", self._resume)

    def _auth(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip()
        with self.lock:
            expiry = self.tokens.get(token) if header.startswith("Bearer ") else None
            if expiry is None or expiry < time.monotonic():
                self.tokens.pop(token, None)
                raise ApiError(401, "Unauthorized: the access token is missing, invalid or expired")

    async def _token(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("grantType") != "client_credentials":
            raise ApiError(400, "grantType: must be one of app_token, client_credentials, ...")
        if body.get("clientId") != self.client_id or body.get("clientSecret") != self.client_secret:
            raise ApiError(401, "invalid client credentials")
        token = secrets.token_urlsafe(32)
        with self.lock:
            self.tokens[token] = time.monotonic() + self.token_ttl_s
            self.issued_tokens.append(token)
        return web.json_response(
            {"accessToken": token, "idToken": secrets.token_urlsafe(8), "refreshToken": ""}
        )

    async def _projects(self, request: web.Request) -> web.Response:
        self._auth(request)
        projects = [
            {"id": pid, "name": name, "clusterId": self.cluster_id}
            for name, pid in self.projects.items()
        ]
        return web.json_response({"projects": projects})

    async def _create(self, request: web.Request) -> web.Response:
        self._auth(request)
        kind = request.match_info["kind"]
        if kind not in KINDS:
            raise ApiError(404, f"no such workload type '{kind}'")
        body = await _json_body(request)
        workload = self._validate(kind, body)
        with self.lock:
            if not body.get("useGivenNameAsPrefix") and any(
                w.name == workload.name and w.deleted is None for w in self.workloads.values()
            ):
                raise ApiError(409, f"workload '{workload.name}' already exists in the project")
            now = time.time()
            self._admit(now)  # what ended frees quota first
            self.workloads[workload.id] = workload
            if self._queue_ahead(workload, now):
                workload.phases = [(now, "Creating"), (now + self.creating_s, "Pending")]
                workload.waiting = self._waiting_message(workload, now)
            elif self.execute:
                self._start_pods(workload)
        return web.json_response(workload.as_json(time.time()), status=202)

    def _start_pods(self, workload: Workload) -> None:
        threading.Thread(
            target=self._run_pods, args=(workload,), name="loopback-runai-pods", daemon=True
        ).start()

    def _holding(self, project: str, now: float) -> list[Workload]:
        """The project's workloads that hold their GPUs now (scheduled, not ended)."""
        return [
            w
            for w in self.workloads.values()
            if w.project_name == project
            and w.deleted is None
            and not w.waiting
            and w.phase(now) not in TERMINAL_PHASES
        ]

    def _queue_ahead(self, workload: Workload, now: float) -> bool:
        """True when `workload` must wait: it does not fit in the project's free quota, or a
        workload of the project waits ahead of it (same or higher priority: no overtaking)."""
        quota = self.quotas.get(workload.project_name)
        if quota is None:
            return False
        used = sum(w.gpus for w in self._holding(workload.project_name, now) if w is not workload)
        ahead = [
            w
            for w in self.workloads.values()
            if w.waiting and w is not workload and w.project_name == workload.project_name
            and (-w.priority_rank, w.created) < (-workload.priority_rank, workload.created)
        ]  # fmt: skip
        return bool(ahead) or used + workload.gpus > quota

    def _waiting_message(self, workload: Workload, now: float) -> str:
        """Why it waits, in the words of run:ai's scheduler (its ``phaseMessage``)."""
        quota = self.quotas.get(workload.project_name, 0)
        used = sum(w.gpus for w in self._holding(workload.project_name, now))
        return (
            f"Workload requested {workload.gpus} GPUs, but project '{workload.project_name}' "
            f"has {max(0, quota - used)} of its {quota} GPUs quota free ({used} allocated): "
            "waiting for resources"
        )

    def _admit(self, now: float) -> None:
        """Schedule the waiting workloads that fit now, higher priority first, then oldest,
        none overtaking another of its project. Called with the lock held, on every request:
        the clock decides when quota frees."""
        waiting = sorted(
            (w for w in self.workloads.values() if w.waiting and w.deleted is None),
            key=lambda w: (-w.priority_rank, w.created),
        )
        for workload in waiting:
            if self._queue_ahead(workload, now):
                workload.waiting = self._waiting_message(workload, now)
                continue
            workload.waiting = ""
            pending_at = max(t for t, phase in workload.phases if phase == "Pending")
            start = max(now, pending_at)
            run_at = start + self.initializing_s
            workload.phases += [(start, "Initializing"), (run_at, "Running")]
            end = self.end_of(workload.requested_name)
            if end is not None:
                workload.phases.append((run_at + self.running_s, end))
            if self.execute:
                self._start_pods(workload)

    def _run_pods(self, workload: Workload) -> None:
        """Start the replicas when Running begins, then end the workload by their exit codes."""
        with self.lock:
            start = [t for t, phase in workload.phases if phase == "Running"][-1]
            workload.phases = [p for p in workload.phases if p[0] <= start]  # no timed end
        time.sleep(max(0.0, start - time.time()))
        with self.lock:
            if workload.phase(time.time()) != "Running":
                return  # suspended or deleted before its pods started
            base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            for rank in range(workload.replicas):
                workload.processes.append(
                    subprocess.Popen(
                        workload.argv(),
                        env={**base, **self.pod_env(workload, rank)},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        codes = [p.wait() for p in workload.processes]
        with self.lock:
            if workload.phase(time.time()) == "Running":
                phase = "Completed" if all(c == 0 for c in codes) else "Failed"
                workload.phases.append((time.time(), phase))

    def fail(self, requested_name: str, reason: str, message: str) -> None:
        """End the live workloads of this requested name Failed now, as run:ai would when their
        pods' node is lost or they are evicted: the pods' processes are killed, and
        ``GET /workloads/{id}`` says why in its ``phaseMessage`` and a condition."""
        now = time.time()
        with self.lock:
            for workload in self.by_name(requested_name):
                if workload.phase(now) in TERMINAL_PHASES:
                    continue
                workload.phases = [p for p in workload.phases if p[0] <= now] + [(now, "Failed")]
                workload.waiting = ""
                workload.failure = (reason, message)
                self._kill(workload)

    def _kill(self, workload: Workload) -> None:
        for proc in workload.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)

    async def on_shutdown(self) -> None:
        with self.lock:
            for workload in self.workloads.values():
                self._kill(workload)

    def _validate(self, kind: str, body: dict[str, Any]) -> Workload:
        for key in ("name", "projectId", "clusterId"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise ApiError(400, f"{key}: required, a non-empty string")
        name = body["name"]
        if not _NAME.match(name) or len(name) > _NAME_MAX:
            raise ApiError(
                400,
                f"name: '{name}' must be at most {_NAME_MAX} characters of lowercase letters, "
                "digits and '-', starting with a letter",
            )
        if body["projectId"] not in self.projects.values():
            raise ApiError(400, f"projectId: project '{body['projectId']}' does not exist")
        if body["clusterId"] != self.cluster_id:
            raise ApiError(400, f"clusterId: cluster '{body['clusterId']}' does not exist")
        spec = body.get("spec")
        if not isinstance(spec, dict):
            raise ApiError(400, "spec: required, an object")
        for key in ("command", "args", "image"):
            if key in spec and not isinstance(spec[key], str):
                raise ApiError(400, f"spec.{key}: must be a string")
        if len(spec.get("args") or "") > ARGS_LIMIT:
            raise ApiError(
                400, f"spec.args: {len(spec['args'])} characters, more than {ARGS_LIMIT} allowed"
            )
        envs = spec.get("environmentVariables") or []
        if not isinstance(envs, list):
            raise ApiError(400, "spec.environmentVariables: must be an array")
        seen: set[str] = set()
        for i, env in enumerate(envs):
            where = f"spec.environmentVariables[{i}]"
            if not isinstance(env, dict) or not isinstance(env.get("name"), str) or not env["name"]:
                raise ApiError(400, f"{where}.name: required, a non-empty string")
            if env["name"] in seen:
                raise ApiError(400, f"{where}.name: duplicate variable '{env['name']}'")
            seen.add(env["name"])
            value = env.get("value")
            if value is not None and not isinstance(value, str):
                raise ApiError(400, f"{where}.value: must be a string")
            if len(value or "") > ENV_VALUE_LIMIT:
                raise ApiError(
                    400,
                    f"{where}.value: {len(value or '')} characters, more than "
                    f"{ENV_VALUE_LIMIT} allowed",
                )
        for key in ("labels", "annotations"):
            for i, item in enumerate(spec.get(key) or []):
                key_name = item.get("name") if isinstance(item, dict) else None
                if not isinstance(key_name, str) or not 1 <= len(key_name) <= 63:
                    raise ApiError(400, f"spec.{key}[{i}].name: required, 1-63 characters")
                if set(item) - {"name", "value", "exclude"}:
                    raise ApiError(400, f"spec.{key}[{i}]: only name, value and exclude")
        priority = spec.get("priorityClass")
        if priority is not None and priority not in PRIORITY_CLASSES:
            raise ApiError(
                400,
                f"spec.priorityClass: '{priority}' is not a priority class; valid values are "
                + ", ".join(PRIORITY_CLASSES),
            )
        compute = spec.get("compute") or {}
        gpus = compute.get("gpuDevicesRequest")
        if gpus is not None and (not isinstance(gpus, int) or gpus < 0):
            raise ApiError(400, "spec.compute.gpuDevicesRequest: must be an integer >= 0")
        if kind == "distributed":
            for key in ("distributedFramework", "numWorkers"):
                if key not in spec:
                    raise ApiError(400, f"spec.{key}: required for distributed workloads")
        final = f"{name}-{secrets.token_hex(3)}" if body.get("useGivenNameAsPrefix") else name
        now = time.time()
        project = next(n for n, pid in self.projects.items() if pid == body["projectId"])
        return Workload(
            project_name=project,
            id=str(uuid.uuid4()),
            kind=kind,
            name=final,
            requested_name=name,
            project_id=body["projectId"],
            cluster_id=body["clusterId"],
            spec=spec,
            created=now,
            phases=self._schedule(name, now),
        )

    def _schedule(self, name: str, now: float) -> list[tuple[float, str]]:
        end = self.end_of(name)
        t_init = now + self.creating_s
        t_run = t_init + self.initializing_s
        phases = [(now, "Creating"), (t_init, "Initializing"), (t_run, "Running")]
        if end is not None:
            phases.append((t_run + self.running_s, end))
        return phases

    def _workload(self, request: web.Request) -> Workload:
        kind, wid = request.match_info["kind"], request.match_info["id"]
        with self.lock:
            workload = self.workloads.get(wid)
        if workload is None or workload.kind != kind or workload.deleted is not None:
            raise ApiError(404, f"The specified resource was not found: {kind} '{wid}'")
        return workload

    async def _get(self, request: web.Request) -> web.Response:
        self._auth(request)
        now = time.time()
        with self.lock:
            self._admit(now)
        return web.json_response(self._workload(request).as_json(now))

    async def _get_any(self, request: web.Request) -> web.Response:
        """``GET /workloads/{workloadId}``: the workload as the ``Workload`` schema has it."""
        self._auth(request)
        now = time.time()
        with self.lock:
            self._admit(now)
            wid = request.match_info["id"]
            workload = self.workloads.get(wid)
            if workload is None or workload.deleted is not None:
                raise ApiError(404, f"The specified resource was not found: '{wid}'")
            return web.json_response(workload.list_item(now, workload.project_name))

    async def _delete(self, request: web.Request) -> web.Response:
        self._auth(request)
        workload = self._workload(request)
        with self.lock:
            workload.deleted = time.time()
            workload.waiting = ""
            self._kill(workload)
            self._admit(time.time())
        return web.json_response({"code": 202, "message": "Accepted"}, status=202)

    async def _suspend(self, request: web.Request) -> web.Response:
        self._auth(request)
        workload = self._workload(request)
        now = time.time()
        with self.lock:
            if workload.phase(now) not in TERMINAL_PHASES:
                workload.phases = [p for p in workload.phases if p[0] <= now]
                workload.phases += [(now, "Stopping"), (now + self.stopping_s, "Stopped")]
                workload.waiting = ""  # out of the queue: a suspended workload waits for nothing
                self._kill(workload)
            self._admit(now)
        return web.json_response({"code": 202, "message": "Accepted"}, status=202)

    async def _resume(self, request: web.Request) -> web.Response:
        self._auth(request)
        workload = self._workload(request)
        now = time.time()
        with self.lock:
            if workload.phase(now) == "Stopped":
                if self._queue_ahead(workload, now):
                    workload.phases += [(now, "Resuming"), (now + self.creating_s, "Pending")]
                    workload.waiting = self._waiting_message(workload, now)
                else:
                    workload.phases += self._schedule(workload.requested_name, now)
                    if self.execute:
                        self._start_pods(workload)
        return web.json_response({"code": 202, "message": "Accepted"}, status=202)

    async def _list(self, request: web.Request) -> web.Response:
        self._auth(request)
        filters = [f for value in request.query.getall("filterBy", []) for f in value.split(",")]
        deleted = request.query.get("deleted") == "true"
        offset = int(request.query.get("offset", "0"))
        limit = min(int(request.query.get("limit", "50")), 500)
        now = time.time()
        names = {pid: name for name, pid in self.projects.items()}
        with self.lock:
            self._admit(now)
            items = [
                w.list_item(now, names.get(w.project_id, ""))
                for w in self.workloads.values()
                if (w.deleted is not None) == deleted
            ]
        items = [i for i in items if all(_matches(i, f) for f in filters if f)]
        items.sort(key=lambda i: i["createdAt"] or "")
        page = items[offset : offset + limit]
        body: dict[str, Any] = {"workloads": page}
        if offset + limit < len(items):
            body["next"] = offset + limit
        return web.json_response(body)


_FILTER = re.compile(r"^([A-Za-z]+)(==|!=|=@|!@|=\^|=\$)(.*)$")


def _matches(item: dict[str, Any], expression: str) -> bool:
    """run:ai's filterBy: ``field<op>value`` with ==, !=, =@, !@, =^ and =$."""
    match = _FILTER.match(expression)
    if match is None:
        raise ApiError(400, f"filterBy: '{expression}' is not field<op>value")
    key, op, value = match.groups()
    have = str(item.get(key, ""))
    return {
        "==": have == value,
        "!=": have != value,
        "=@": value in have,
        "!@": value not in have,
        "=^": have.startswith(value),
        "=$": have.endswith(value),
    }[op]


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body
