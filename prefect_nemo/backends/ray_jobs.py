"""The Ray Jobs API backend, written on Ray's own JobSubmissionClient (no Prefect import)."""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import inspect
import json
import re
import ssl
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Collection
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

import aiohttp
import ray
import requests
from ray.exceptions import AuthenticationError
from ray.job_submission import JobDetails, JobSubmissionClient

from prefect_nemo import names
from prefect_nemo.backends import ray_logs
from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    InvalidJobSpec,
    JobAlreadyExists,
    Throttled,
)
from prefect_nemo.jobs import (
    META_FLOW_RUN,
    META_KEY,
    RESERVED_PREFIX,
    Failure,
    FailureClass,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    OwnedJob,
    QueueInfo,
    refuse_launcher,
)
from prefect_nemo.packaging import collect_source, stage_source
from prefect_nemo.placement.errors import PlacementError
from prefect_nemo.placement.plan import Topology
from prefect_nemo.placement.spec import PlacementSpec, to_ray_entrypoint

T = TypeVar("T")

# Lets a driver's own ray.init(runtime_env=...) win over the job's runtime_env instead of failing.
OVERRIDE_RUNTIME_ENV = {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}

#: Metadata key of the entrypoint's resource ask, named as nodes name resources ({"GPU": 1}).
#: Ray's Jobs API returns no entrypoint resources, and a PENDING job is QUEUED only when no
#: node has what it asked for.
META_ASK = RESERVED_PREFIX + "entrypoint_resources"

# JobSubmissionClient.submit_job gained entrypoint_label_selector in this release (2.53.0 has
# no such parameter; checked in both wheels' ray/dashboard/modules/job/sdk.py).
LABEL_SELECTOR_RAY = "2.54.0"


class TimedJobClient(JobSubmissionClient):
    """JobSubmissionClient whose every HTTP request carries a timeout (Ray sets none)."""

    def __init__(self, address: str, *, timeout_s: float, **kwargs: Any) -> None:
        self._timeout_s = timeout_s  # set first: the base __init__ already sends a request
        super().__init__(address, **kwargs)

    def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self._timeout_s)
        return super()._do_request(method, endpoint, **kwargs)

    def _raise_error(self, r: requests.Response) -> None:
        """A 429/503 (a proxy or gateway in front of the dashboard pushing back) is Throttled,
        with its Retry-After; every other failure is Ray's own RuntimeError."""
        if r.status_code in (429, 503):
            raise Throttled(
                f"Ray dashboard at {self._address} pushed back ({r.status_code} {r.reason})",
                _retry_after_s(r.headers.get("Retry-After")),
            )
        super()._raise_error(r)


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds (its delay-seconds form; an HTTP-date is left to our backoff)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _ms_to_datetime(ms: int | None) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=UTC) if ms else None


#: Ray's JobErrorType (ray.dashboard.modules.job.common) by failure class: the job supervisor
#: actor (which runs the driver) dying or failing to start is the cluster's doing (its node
#: died, or it could not be placed); a runtime env that cannot be set up or an entrypoint that
#: cannot start is the spec's; an entrypoint's non-zero exit is the code's (its log may still
#: say a node died: the lifecycle reads it)
RAY_ERROR_CLASSES = {
    "JOB_SUPERVISOR_ACTOR_DIED": FailureClass.INFRASTRUCTURE,
    "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE": FailureClass.INFRASTRUCTURE,
    "JOB_SUPERVISOR_ACTOR_START_TIMEOUT": FailureClass.INFRASTRUCTURE,
    "JOB_SUPERVISOR_ACTOR_START_FAILURE": FailureClass.INFRASTRUCTURE,
    "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE": FailureClass.INFRASTRUCTURE,
    "RUNTIME_ENV_SETUP_FAILURE": FailureClass.SPEC,
    "JOB_ENTRYPOINT_COMMAND_START_ERROR": FailureClass.SPEC,
    "JOB_ENTRYPOINT_COMMAND_ERROR": FailureClass.APPLICATION,
}


def _status_from_details(details: JobDetails) -> JobStatus:
    state = JobState(str(details.status.value))
    return JobStatus(
        job_id=details.submission_id or details.job_id or "",
        state=state,
        message=details.message or "",
        start_time=_ms_to_datetime(details.start_time),
        end_time=_ms_to_datetime(details.end_time),
        exit_code=details.driver_exit_code,
        metadata=details.metadata or {},
        failure=_failure(details) if state is JobState.FAILED else None,
    )


def _failure(details: JobDetails) -> Failure | None:
    """What Ray says the job failed of (its error_type); None where it says nothing."""
    error_type = str(getattr(details, "error_type", None) or "")
    kind = RAY_ERROR_CLASSES.get(error_type)
    if kind is None or kind is FailureClass.APPLICATION:  # its exit code says it better
        return None
    node = details.driver_node_id if kind is FailureClass.INFRASTRUCTURE else None
    return Failure(kind=kind, reason=error_type, node=node or None)


def entrypoint_ask(details: JobDetails) -> dict[str, float]:
    """The resources the job's entrypoint asked for, as we recorded them at submit (Ray's
    JobDetails carries no entrypoint_num_cpus/gpus/memory/resources)."""
    try:
        ask = json.loads((details.metadata or {}).get(META_ASK) or "{}")
    except ValueError:
        return {}
    return {str(k): float(n) for k, n in ask.items()} if isinstance(ask, dict) else {}


def unmet(ask: dict[str, float], nodes: list[dict[str, float]]) -> dict[str, float]:
    """What of `ask` no single node has (the entrypoint runs on one node), or {} when some
    node has all of it."""
    if any(all(node.get(k, 0.0) >= n for k, n in ask.items()) for node in nodes):
        return {}
    return {k: n for k, n in ask.items() if not any(node.get(k, 0.0) >= n for node in nodes)} or ask


class _AskingCost:
    """Which way statuses() asks Ray, by what each way costs. list_jobs answers for every
    watched job at once, but returns every job the cluster ever ran (Ray keeps them all:
    ray-project/ray#55010), so on a cluster with a long history it costs far more than asking
    for the few jobs a flow watches (measured on a local head holding 300 jobs: one list took
    70 ms and 90 ms of the head's CPU, one get_job_info 4 ms). The first poll lists, which also
    tells how many jobs the cluster holds; where the watched jobs are a small share of those,
    the next WINDOW polls ask each (to price a get); from then on, the way that costs less per
    poll is taken, and the way in use is left only for one SWITCH_MARGIN times cheaper. A way's
    cost is the least of its last WINDOW polls: a loaded machine only ever adds time to an
    answer, so one slow answer must not flip the way (seen in CI under 4 test workers: one get
    slower than twice a list of 20 jobs sent the next poll back to listing)."""

    EXPLORE_SHARE = 0.25  # ask each (to price it) when watching at most this share of the jobs
    SWITCH_MARGIN = 2.0
    WINDOW = 3

    def __init__(self) -> None:
        self._lists: deque[float] = deque(maxlen=self.WINDOW)  # what the last lists took
        self._gets: deque[float] = deque(maxlen=self.WINDOW)  # one get, on the last asks
        self.cluster_jobs = 0  # how many jobs the last list returned
        self.asking_each = False  # the way the last poll took

    def each(self, watched: int) -> bool:
        """Ask each watched job this poll (else list them all)."""
        if not self._lists or watched == 0:
            return False
        if len(self._gets) < self.WINDOW:  # a get is priced by WINDOW polls of asking each
            return watched <= self.EXPLORE_SHARE * self.cluster_jobs
        each_s, list_s = watched * min(self._gets), min(self._lists)
        if self.asking_each:
            return each_s < self.SWITCH_MARGIN * list_s
        return self.SWITCH_MARGIN * each_s < list_s

    def listed(self, cluster_jobs: int, took_s: float) -> None:
        """A poll listed the cluster's `cluster_jobs` jobs in `took_s`."""
        self._lists.append(took_s)
        self.cluster_jobs, self.asking_each = cluster_jobs, False

    def asked_each(self, watched: int, took_s: float) -> None:
        """A poll asked each of `watched` jobs in `took_s`."""
        self._gets.append(took_s / watched)
        self.asking_each = True


_clients: dict[tuple[object, ...], TimedJobClient] = {}
_clients_lock = threading.Lock()


def _server_error(text: str) -> str:
    """A dashboard's 500 in one line: its status and the exception its traceback ends with
    (the first line alone says only "Traceback (most recent call last):")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    status = lines[0].split("Traceback (most recent call last):")[0].rstrip(": ")
    cause = lines[-1] if len(lines) > 1 else ""
    return f"{status}: {cause[:200]}" if cause else status[:200]


class RayJobsBackend:
    """Submit, watch, stop and read logs of jobs on a running Ray cluster's Jobs API."""

    kind: ClassVar[str] = "ray-jobs"
    max_job_id_len: ClassVar[int] = names.MAX_LABEL

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        token_header: str = "Authorization",
        headers: dict[str, str] | None = None,
        verify: bool | str = True,
        request_timeout_s: float = 30.0,
        runtime_env: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        secret_env: dict[str, str] | None = None,
        image_label_selectors: dict[str, dict[str, str]] | None = None,
        image_label_key: str | None = None,
        client_class: type[TimedJobClient] = TimedJobClient,
    ) -> None:
        self.address = address.rstrip("/")
        self._token = token
        self._headers = dict(headers or {})
        if token:
            self._headers[token_header] = f"Bearer {token}"
        self._verify = verify
        self._timeout_s = request_timeout_s
        self._runtime_env = dict(runtime_env or {})
        self._secret_env = dict(secret_env or {})
        self._env = {**(env or {}), **self._secret_env}  # the cluster-wide environment
        self._image_label_selectors = dict(image_label_selectors or {})
        self._image_label_key = image_label_key
        self.client_class = client_class  # Ray's JobSubmissionClient, with request timeouts
        self._asking = _AskingCost()

    # -- identity ------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """The dashboard address: one watcher per address."""
        return self.address

    @property
    def credentials_key(self) -> str:
        """The headers every request carries (the token's among them), hashed."""
        return names.secret_hash(*(f"{k}={v}" for k, v in sorted(self._headers.items())))

    @property
    def secrets(self) -> list[str]:
        """The token, every extra header value and the secret cluster env values, to redact."""
        return [v for v in [self._token, *self._headers.values(), *self._secret_env.values()] if v]

    def handle(self, job_id: str) -> JobHandle:
        """The job's handle with a link to its page in the Ray dashboard."""
        return JobHandle(
            backend=self.kind,
            cluster=self.address,
            job_id=job_id,
            links={"dashboard": f"{self.address}/#/jobs/{job_id}"},
        )

    # -- client and error mapping ---------------------------------------------------------------

    @property
    def client(self) -> TimedJobClient:
        """The Ray client of this cluster, shared in the process (creating one checks version
        and auth with one request, so it is done once per cluster and credentials)."""
        key = (
            self.address,
            tuple(sorted(self._headers.items())),
            str(self._verify),
            self._timeout_s,
            self.client_class,
        )
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = self._call(
                    lambda: self.client_class(
                        self.address,
                        timeout_s=self._timeout_s,
                        headers=self._headers,
                        verify=self._verify,
                    )
                )
                _clients[key] = client
            return client

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one client call, turning transport and auth failures into our errors."""
        try:
            return fn()
        except AuthenticationError as exc:
            hint = (
                "the token was rejected: set auth_token on the cluster block to the cluster's "
                "token (`ray get-auth-token` on the head node prints it)"
                if "403" in str(exc) or "Invalid" in str(exc)
                else "the cluster requires a token (Ray >= 2.59 enables token auth by default): "
                "set auth_token on the cluster block"
            )
            raise AuthenticationFailed(f"Ray cluster at {self.address}: {hint}") from None
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise BackendUnavailable(
                f"Ray dashboard at {self.address} is unreachable ({type(exc).__name__}): check "
                "the address and that the cluster is up"
            ) from None
        except (ConnectionError, TimeoutError, OSError) as exc:
            raise BackendUnavailable(
                f"Ray dashboard at {self.address} is unreachable ({type(exc).__name__})"
            ) from None
        except RuntimeError as exc:
            text = str(exc)
            if "status code 5" in text and "already exists" not in text:
                raise BackendUnavailable(
                    f"Ray dashboard at {self.address} answered a server error: "
                    f"{_server_error(text)}"
                ) from None
            raise

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Reject what the Ray Jobs API would refuse, before anything is sent."""
        refuse_launcher(spec, self.kind)
        # the head's id is only known at submit; a stand-in checks everything else
        _, selector, sources = self._placement(spec, "head-node-id")
        if selector and not self.sends_label_selectors():
            # Sending the job without its selector would place it on any node (a GPU job on
            # the CPU head, say): worse than not running it, so stop here instead.
            raise InvalidJobSpec(
                f"{' and '.join(sources)}: the job needs the entrypoint label selector "
                f"{selector}, which the Ray client here cannot send ({self.client_class.__name__}"
                f" of ray {ray.__version__}; entrypoint_label_selector needs ray >= "
                f"{LABEL_SELECTOR_RAY}): upgrade ray on this machine to >= {LABEL_SELECTOR_RAY}, "
                "or drop the selector (the job is not sent without it)"
            )
        try:
            json.dumps({**self._runtime_env, **spec.runtime_env}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidJobSpec(
                f"JobSpec.runtime_env: must be JSON-serializable for the Ray Jobs API ({exc})"
            ) from None

    def check_access(self) -> None:
        """Reach the dashboard and prove the token works: creating the client asks Ray's
        version endpoint, which checks the token like every other endpoint."""
        _ = self.client

    def find(self, job_id: str) -> JobStatus | None:
        """The job's status, or None when the cluster has no such job."""
        info = self._details(job_id)
        return None if info is None else self._status(info, functools.cache(self._node_resources))

    def _details(self, job_id: str) -> JobDetails | None:
        try:
            return self._call(lambda: self.client.get_job_info(job_id))
        except RuntimeError as exc:
            if "404" in str(exc) or "does not exist" in str(exc):
                return None
            raise

    def _status(
        self, details: JobDetails, nodes: Callable[[], list[dict[str, float]]]
    ) -> JobStatus:
        """The job's status; a PENDING job whose entrypoint asks for resources no alive node
        has is QUEUED (Ray's PENDING covers that wait and the runtime_env set-up alike; its
        message says "It may be waiting for resources ... to become available" whenever
        entrypoint resources were asked). `nodes` lists the alive nodes' total resources,
        asked only for such a job."""
        status = _status_from_details(details)
        ask = entrypoint_ask(details) if status.state is JobState.PENDING else {}
        missing = unmet(ask, nodes()) if ask else {}
        if not missing:
            return status
        wanted = ", ".join(f"{k}: {n:g}" for k, n in missing.items())
        reason = f"{status.message} (no alive node has {wanted} yet)".lstrip()
        queue = QueueInfo(queue=f"Ray cluster {self.address}", reason=reason)
        return status.model_copy(update={"state": JobState.QUEUED, "queue": queue})

    def _node_resources(self) -> list[dict[str, float]]:
        """The total resources of each alive node."""
        return [
            {k: float(v) for k, v in (row.get("resources_total") or {}).items()}
            for row in self._state_nodes()
            if row.get("state") == "ALIVE"
        ]

    def _state_nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes, as the dashboard's state API lists them."""
        response = self._call(lambda: self.client._do_request("GET", "/api/v0/nodes?limit=1000"))
        if response.status_code != 200:
            raise BackendUnavailable(
                f"Ray dashboard at {self.address} answered {response.status_code} to "
                f"/api/v0/nodes: {response.text[:200]}"
            )
        rows: list[dict[str, Any]] = (
            response.json().get("data", {}).get("result", {}).get("result", [])
        )
        return rows

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Submit the spec under job_id; JobAlreadyExists if someone took the id first."""
        head = self.head_node_id() if spec.placement and spec.placement.exclude_head else None
        request = self._request(spec, job_id, metadata, head_node_id=head)
        try:
            self._call(lambda: self.client.submit_job(**request))
        except RuntimeError as exc:
            if "already exists" in str(exc):
                raise JobAlreadyExists(f"Ray job '{job_id}' already exists") from None
            raise
        return self.handle(job_id)

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """The submission `submit` would send (JobSubmissionClient.submit_job's arguments); the
        head node's id, which excluding the head needs, is left as a placeholder."""
        head = "<the head node's id>" if spec.placement and spec.placement.exclude_head else None
        request = self._request(spec, job_id, metadata, head_node_id=head)
        return [{"kind": "RayJobSubmission", "address": self.address, "request": request}]

    def _request(
        self,
        spec: JobSpec,
        job_id: str,
        metadata: dict[str, str],
        *,
        head_node_id: str | None,
    ) -> dict[str, Any]:
        """The keyword arguments of `submit_job` for this job."""
        runtime_env = {**self._runtime_env, **spec.runtime_env}
        if self._image_labels(runtime_env):
            # the image names the nodes that run it (their labels), not a container for Ray
            # to start there with podman
            del runtime_env["image_uri"]
        runtime_env["env_vars"] = {**self._env, **spec.plain_env(), **OVERRIDE_RUNTIME_ENV}
        if spec.working_dir is not None:
            tree = collect_source(spec.working_dir, exclude=spec.exclude)
            # Content-addressed staging: an unchanged tree maps to the same directory, whose
            # package Ray finds already uploaded (its client checks before uploading).
            runtime_env["working_dir"] = str(stage_source(tree))
        request: dict[str, Any] = {
            "entrypoint": spec.entrypoint,
            "submission_id": job_id,
            "runtime_env": runtime_env,
            "metadata": {**spec.metadata, **metadata},
        }
        res = spec.resources
        if res.cpus is not None:
            request["entrypoint_num_cpus"] = res.cpus
        if res.gpus is not None:
            request["entrypoint_num_gpus"] = res.gpus
        if res.memory_bytes is not None:
            request["entrypoint_memory"] = res.memory_bytes
        if res.custom:
            request["entrypoint_resources"] = dict(res.custom)
        placed, selector, _ = self._placement(spec, head_node_id)
        request.update(placed)
        ask = {
            "CPU": request.get("entrypoint_num_cpus"),
            "GPU": request.get("entrypoint_num_gpus"),
            "memory": request.get("entrypoint_memory"),
            **request.get("entrypoint_resources", {}),
        }
        if ask := {k: n for k, n in ask.items() if n}:
            request["metadata"][META_ASK] = json.dumps(ask, sort_keys=True)
        if selector:  # older clients raise TypeError even for None: send only when set
            request["entrypoint_label_selector"] = selector
        return request

    def _placement(
        self, spec: JobSpec, head_node_id: str | None
    ) -> tuple[dict[str, float], dict[str, str], list[str]]:
        """The job's entrypoint resources from its placement, its label selector, and the
        fields the selector comes from. The job's own keys (label_selector, placement) win
        over the image's: image-derived labels only fill gaps, as in NeMo-Skills."""
        placed: dict[str, float] = {}
        selector = dict(spec.label_selector)
        sources = ["JobSpec.label_selector"] if selector else []
        if spec.placement is not None:  # JobSpec refuses it together with cpus/gpus/selector
            placed, selector = _entrypoint_placement(spec.placement, head_node_id)
            sources = ["JobSpec.placement"] if selector else []
        image_labels = self._image_labels({**self._runtime_env, **spec.runtime_env})
        for key, value in image_labels.items():
            selector.setdefault(key, value)
        if image_labels:
            sources.append("runtime_env['image_uri'] (RayJobsCluster.image_label_selectors)")
        return placed, selector, sources

    def _image_labels(self, runtime_env: dict[str, Any]) -> dict[str, str]:
        """The node labels the block maps the job's image (runtime_env image_uri) to."""
        image = runtime_env.get("image_uri")
        if not isinstance(image, str) or not image:
            return {}
        return image_labels(image, self._image_label_selectors, self._image_label_key)

    def _submit_params(self) -> set[str]:
        """The keyword arguments this Ray client's submit_job takes."""
        return set(inspect.signature(self.client_class.submit_job).parameters)

    def sends_label_selectors(self) -> bool:
        """Whether this Ray client can send an entrypoint label selector (ray >= 2.54.0)."""
        return "entrypoint_label_selector" in self._submit_params()

    @property
    def selects_by_image(self) -> bool:
        """Whether the block itself gives jobs label selectors (image_label_selectors/key)."""
        return bool(self._image_label_selectors or self._image_label_key)

    def cluster_ray_version(self) -> str:
        """The Ray version the cluster runs, from its dashboard's version endpoint."""
        response = self._call(lambda: self.client._do_request("GET", "/api/version"))
        if response.status_code != 200:
            self._call(lambda: self.client._raise_error(response))
        return str(response.json().get("ray_version", "unknown"))

    def head_node_id(self) -> str:
        """The Ray id of the cluster's head node, from the dashboard's state API (which lists
        no node for a few seconds after the cluster starts: asked again, up to ~3 s)."""
        for attempt in range(4):
            rows = self._state_nodes()
            head = Topology.from_state_nodes(rows).head
            if head is not None:
                return head.node_id
            if attempt < 3:
                time.sleep(1.0)
        raise BackendUnavailable(
            f"Ray dashboard at {self.address} lists no alive head node, so "
            "JobSpec.placement.exclude_head cannot name it: check the cluster, or use a worker "
            "label in placement.node_labels instead"
        )

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """The watched jobs' statuses, asked the cheaper way (`_AskingCost`): one list_jobs
        for all of them, or one get_job_info each."""
        wanted = set(job_ids)
        nodes = functools.cache(self._node_resources)  # once per poll, if a job waits
        started = time.monotonic()
        if self._asking.each(len(wanted)):
            found = {job_id: self._details(job_id) for job_id in wanted}
            self._asking.asked_each(len(wanted), time.monotonic() - started)
            return {job_id: self._status(d, nodes) for job_id, d in found.items() if d is not None}
        details = self._call(self.client.list_jobs)
        self._asking.listed(len(details), time.monotonic() - started)
        return {
            d.submission_id: self._status(d, nodes) for d in details if d.submission_id in wanted
        }

    def owned_jobs(self) -> list[OwnedJob]:
        """The cluster's live jobs that carry our metadata (one list_jobs)."""
        return [
            OwnedJob(
                job_id=d.submission_id,
                state=JobState(str(d.status.value)),
                flow_run_id=(d.metadata or {}).get(META_FLOW_RUN) or None,
                submitted_at=_ms_to_datetime(d.start_time),
            )
            for d in self._call(self.client.list_jobs)
            if d.submission_id
            and META_KEY in (d.metadata or {})
            and not JobState(str(d.status.value)).is_terminal()
        ]

    def request_stop(self, job_id: str) -> None:
        """Ask Ray to stop the job (SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S)."""
        try:
            self._call(lambda: self.client.stop_job(job_id))
        except RuntimeError as exc:
            if "404" not in str(exc) and "does not exist" not in str(exc):
                raise

    def logs(self, job_id: str) -> str:
        """The job's whole log, Ray's "Running entrypoint" line out of the job's lines."""
        text = self._call(lambda: self.client.get_job_logs(job_id))
        if ray_logs.cut_at(text, job_id) is None:
            return text
        try:
            return ray_logs.mended(text, job_id, self._entrypoint(job_id))
        except RuntimeError:  # the job is gone: its log as Ray wrote it is still the log
            return text

    async def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """Chunks of the job's log as Ray writes them; ends when the job ends.

        Reads Ray's websocket endpoint `/api/jobs/{id}/logs/tail` itself: Ray's own
        `tail_job_logs` leaves the websocket open when the consumer stops early.
        """
        url = f"{self.address}/api/jobs/{job_id}/logs/tail"
        async with (
            aiohttp.ClientSession(headers=self._headers) as session,
            # No heartbeat: Ray's dashboard proxy never answers pings, so aiohttp would cut the
            # stream every ~45 s; the watcher, not the socket, decides when a job has ended.
            session.ws_connect(url, ssl=self._ssl_context()) as ws,
        ):
            mender = ray_logs.LineMender(job_id)
            async for message in ws:
                if message.type is aiohttp.WSMsgType.TEXT:
                    text = mender.feed(message.data)
                    if mender.wants_entrypoint:
                        mender.entrypoint = await asyncio.to_thread(self._entrypoint, job_id)
                        text += mender.feed("")
                    if text:
                        yield text
                elif message.type is aiohttp.WSMsgType.ERROR:
                    raise BackendUnavailable(f"log stream of {job_id} broke: {ws.exception()}")
            if rest := mender.flush():
                yield rest

    def _entrypoint(self, job_id: str) -> str:
        return self._call(lambda: self.client.get_job_info(job_id)).entrypoint

    def close(self) -> None:
        """Nothing to stop: this backend starts no threads (clients are shared per cluster)."""

    def _ssl_context(self) -> ssl.SSLContext | bool:
        if self._verify is False:
            return False
        if isinstance(self._verify, str):
            return ssl.create_default_context(cafile=self._verify)
        return True


def _entrypoint_placement(
    placement: PlacementSpec, head_node_id: str | None
) -> tuple[dict[str, float], dict[str, str]]:
    """to_ray_entrypoint, its errors naming the JobSpec field."""
    try:
        return to_ray_entrypoint(placement, head_node_id=head_node_id)
    except PlacementError as exc:
        raise InvalidJobSpec(f"JobSpec.placement: {exc}") from None


def image_labels(
    image: str, selectors: dict[str, dict[str, str]], label_key: str | None
) -> dict[str, str]:
    """Node labels for a container image, as NeMo-Skills' Ray backend derives them: the labels
    of every glob pattern the image matches (an earlier pattern's key wins), else, with a
    label_key, that key set to the image name made a label value."""
    labels: dict[str, str] = {}
    for pattern, pattern_labels in selectors.items():
        if fnmatch.fnmatch(image, pattern):
            for key, value in pattern_labels.items():
                labels.setdefault(key, value)
    if not labels and label_key:
        labels[label_key] = image_label_value(image)
    return labels


def image_label_value(image: str) -> str:
    """An image name as a label value: lower case, runs of other characters as one '-'."""
    value = re.sub(r"-+", "-", re.sub(r"[^a-z0-9_.-]", "-", image.lower())).strip("-._")
    return value or "unknown"
