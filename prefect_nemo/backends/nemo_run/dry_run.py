"""Dry runs of NeMo-Run's service executors: their own submission code, with every HTTP call
answered here and nothing sent.

NeMo-Run's Lepton and DGX Cloud executors build each request inside the call that sends it
(``create_lepton_job``, ``create_training_job``, ``DGXCloudRayJob.start``,
``LeptonRayCluster.create``), so the one way to show exactly what a submit sends is to run that
same code with a transport that keeps what it is handed. Inside `recording(...)` (a context
variable: other threads and tasks are untouched) the leptonai ``APIClient`` NeMo-Run creates
talks to a `requests` session whose adapter answers locally, the ``requests`` calls of NeMo-Run's
DGX Cloud modules go to that same adapter, and their ``time.sleep`` returns at once. The caller
answers each request (placeholders for what only the service knows: ids, tokens) and chooses
which to keep. Outside a recording context the stand-ins are the real modules.

The same leptonai stand-in adds the labels NeMo-Run's ``create_lepton_job`` cannot set (its
``Metadata(id=name)`` has none) to the job it creates, in a dry run and in a real submit alike:
inside `job_labels(job_id, labels)` the created job with that id carries them.

Nothing here imports Prefect.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import BaseAdapter

from prefect_nemo.backends.nemo_run.isolation import nemo_run
from prefect_nemo.packaging.transport import ENV_PREFIX

#: (method, URL path, JSON body) -> (HTTP status, JSON answer)
Answer = Callable[[str, str, Any], tuple[int, Any]]
_CHUNK = re.compile(re.escape(ENV_PREFIX) + r"(\d+)")

_recording: ContextVar[Recorder | None] = ContextVar("prefect_nemo_recording", default=None)
_labels: ContextVar[tuple[str, dict[str, str]] | None] = ContextVar(
    "prefect_nemo_job_labels", default=None
)
_install_lock = threading.Lock()
_installed = False


@dataclass(frozen=True)
class Sent:
    """One request the submission code made (and that the recorder kept)."""

    method: str
    path: str
    body: Any


@dataclass
class Recorder:
    """Answers the requests of one dry run and keeps those `keep` selects."""

    answer: Answer
    keep: Callable[[str, str], bool]
    client_args: dict[str, Any] = field(default_factory=dict)  # leptonai APIClient(**...)
    sent: list[Sent] = field(default_factory=list)

    def respond(self, request: requests.PreparedRequest) -> requests.Response:
        method, path = str(request.method), urlsplit(str(request.url)).path
        # the request's text, then (when it parses) its JSON document
        body: Any = request.body.decode() if isinstance(request.body, bytes) else request.body
        with contextlib.suppress(TypeError, ValueError):
            body = json.loads(body) if body else None
        if self.keep(method, path):
            self.sent.append(Sent(method, path, body))
        status, payload = self.answer(method, path, body)
        response = requests.Response()
        response.status_code = status
        response._content = json.dumps(payload).encode()
        response.headers["Content-Type"] = "application/json"
        response.encoding = "utf-8"
        response.url, response.request = str(request.url), request
        return response

    def session(self) -> requests.Session:
        """A requests session whose every request this recorder answers."""
        session = requests.Session()
        adapter = _Adapter(self)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return session


@contextlib.contextmanager
def recording(
    answer: Answer, keep: Callable[[str, str], bool], client_args: dict[str, Any] | None = None
) -> Iterator[Recorder]:
    """Within the block, NeMo-Run's service calls in this context are answered by `answer`."""
    _install()
    recorder = Recorder(answer, keep, dict(client_args or {}))
    token = _recording.set(recorder)
    try:
        yield recorder
    finally:
        _recording.reset(token)


@contextlib.contextmanager
def job_labels(job_id: str, labels: dict[str, str]) -> Iterator[None]:
    """Within the block, the Lepton job NeMo-Run creates with id `job_id` (in this context)
    carries `labels` in its ``metadata.labels``, sent or recorded."""
    _install()
    token = _labels.set((job_id, dict(labels)))
    try:
        yield
    finally:
        _labels.reset(token)


def code_chunks_summarized(value: Any) -> Any:
    """A copy of a request whose code chunks (env values named PREFECT_NEMO_CODE_<n>: the
    working_dir archive, base64) are shown by size: unreadable, and opaque to secret masking."""
    if isinstance(value, list):
        return [code_chunks_summarized(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: code_chunks_summarized(v) for k, v in value.items()}
    match = _CHUNK.fullmatch(str(out.get("name", "")))
    if match and isinstance(out.get("value"), str):
        out["value"] = (
            f"<{len(out['value'])} characters of the code archive (base64), chunk {match[1]}>"
        )
    return out


class _Adapter(BaseAdapter):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def send(
        self, request: requests.PreparedRequest, *args: Any, **kwargs: Any
    ) -> requests.Response:
        return self.recorder.respond(request)

    def close(self) -> None:
        """Nothing is open."""


class _Requests:
    """`requests` for NeMo-Run's DGX Cloud modules: the real module outside a recording."""

    def __getattr__(self, name: str) -> Any:
        return getattr(requests, name)

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        recorder = _recording.get()
        if recorder is None:
            return requests.request(method, url, **kwargs)
        with recorder.session() as session:
            return session.request(method, url, **kwargs)

    def get(self, url: str, params: Any = None, **kwargs: Any) -> requests.Response:
        return self.request("GET", url, params=params, **kwargs)

    def post(self, url: str, data: Any = None, json: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", url, data=data, json=json, **kwargs)

    def patch(self, url: str, data: Any = None, **kwargs: Any) -> requests.Response:
        return self.request("PATCH", url, data=data, **kwargs)

    def put(self, url: str, data: Any = None, **kwargs: Any) -> requests.Response:
        return self.request("PUT", url, data=data, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("DELETE", url, **kwargs)


class _Client:
    """leptonai's `APIClient` for NeMo-Run's Lepton modules: in a recording, one whose session
    the recorder answers (made from the recorder's arguments, not the process env)."""

    def __init__(self, real: type) -> None:
        self.real = real

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recorder = _recording.get()
        if recorder is None:
            client = self.real(*args, **kwargs)
        else:
            client = self.real(**recorder.client_args) if recorder.client_args else self.real()
            client._session = recorder.session()
        labels = _labels.get()
        if labels is not None:
            _label_created_job(client, *labels)
        return client


def _label_created_job(client: Any, job_id: str, labels: dict[str, str]) -> None:
    """Make `client.job.create` add `labels` to the job it creates with id `job_id`."""
    create = client.job.create

    def labelled(job: Any) -> Any:
        if job.metadata is not None and job.metadata.id_ == job_id:
            job.metadata.labels = {**(job.metadata.labels or {}), **labels}
        return create(job)

    client.job.create = labelled


class _Time:
    """`time` for NeMo-Run's service modules: no waiting in a recording (nothing runs)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if _recording.get() is None:
            time.sleep(seconds)


def _install() -> None:
    """Put the stand-ins into NeMo-Run's service modules, once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        nemo_run()
        dgx, lepton, dgx_ray, lepton_ray = (
            importlib.import_module(f"nemo_run.{name}")
            for name in (
                "core.execution.dgxcloud",
                "core.execution.lepton",
                "run.ray.dgxcloud",
                "run.ray.lepton",
            )
        )
        # names of NeMo-Run's modules, which mypy sees only as ModuleType
        for module in (dgx, dgx_ray):
            module.requests = _Requests()  # type: ignore[attr-defined]
        for module in (lepton, lepton_ray):
            module.APIClient = _Client(module.APIClient)  # type: ignore[attr-defined]
        for module in (dgx, dgx_ray, lepton, lepton_ray):
            module.time = _Time()  # type: ignore[attr-defined]
        _installed = True
