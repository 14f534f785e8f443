"""The run:ai REST API as prefect-nemo calls it (`RunaiClient`: token, project, workload
lookup, the project's workload list, the documented suspend), the DGX Cloud backend's config,
and how a dry run answers
NeMo-Run's run:ai calls (`runai_answer`) and shows a workload creation (`workload_document`).

Nothing here imports Prefect.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import requests

from prefect_nemo.backends.nemo_run.dry_run import Answer, Sent, code_chunks_summarized
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, InvalidJobSpec

#: run:ai's workload types and the path segment that names each.
KINDS = {"Training": "trainings", "Distributed": "distributed"}
#: What a dry run shows for what only run:ai knows (it sends nothing).
DRY_RUN_TOKEN = "<a run:ai access token>"
DRY_RUN_WORKLOAD = "<the workload id run:ai assigns>"


@dataclass(frozen=True)
class DGXCloudConfig:
    """What the DGXCloudCluster block hands the backend (field names as NeMo-Run's)."""

    base_url: str
    client_id: str
    client_secret: str = field(repr=False)
    project_name: str
    pvc_nemo_run_dir: str
    pvcs: list[dict[str, Any]]
    kube_apiserver_url: str = ""
    container_image: str = "nvcr.io/nvidia/nemo:25.07"
    nodes: int = 1
    gpus_per_node: int = 1
    nprocs_per_node: int = 1
    distributed_framework: str = "PyTorch"
    custom_spec: dict[str, Any] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict)
    request_timeout_s: float = 30.0


class RunaiClient:
    """The run:ai calls we make ourselves: token (cached, refreshed once on 401), project,
    workload lookup by id or name, and the documented suspend."""

    def __init__(self, config: DGXCloudConfig) -> None:
        self.config = config
        self._token: str | None = None
        self._lock = threading.Lock()
        self._session = requests.Session()
        # a block builds a backend per task: the pooled connections close when it is dropped
        self._closer = weakref.finalize(self, self._session.close)

    def close(self) -> None:
        """Close the pooled connections now (else when the client is garbage-collected)."""
        self._closer()

    @property
    def token_value(self) -> str | None:
        """The token in use (for redaction), if any."""
        return self._token

    def token(self, *, refresh: bool = False) -> str:
        """A bearer token: the cached one, or a new one from ``POST {base_url}/token``."""
        with self._lock:
            if self._token and not refresh:
                return self._token
            payload = {
                "grantType": "client_credentials",
                "clientId": self.config.client_id,
                "clientSecret": self.config.client_secret,
            }
            response = self._send("POST", "/token", json=payload)
            if response.status_code in (400, 401, 403):
                raise AuthenticationFailed(
                    f"DGX Cloud at {self.config.base_url} refused the credentials of client_id "
                    f"'{self.config.client_id}' ({response.status_code}): check "
                    "DGXCloudCluster.client_id and DGXCloudCluster.client_secret (a run:ai "
                    "application's id and secret)"
                )
            self._raise_for_server(response, "/token")
            token = _json(response).get("accessToken")
            if not token:
                raise BackendUnavailable(
                    f"DGX Cloud at {self.config.base_url} answered /token without an accessToken"
                )
            self._token = str(token)
            return self._token

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One authenticated call; an expired token is refreshed and the call retried once."""
        for attempt in range(2):
            token = self.token(refresh=attempt > 0)
            response = self._send(
                method, path, headers={"Authorization": f"Bearer {token}"}, **kwargs
            )
            if response.status_code != 401:
                self._raise_for_server(response, path)
                return response
        raise AuthenticationFailed(
            f"DGX Cloud at {self.config.base_url} rejected a fresh token for {path}: check that "
            f"the application of DGXCloudCluster.client_id may use project "
            f"'{self.config.project_name}'"
        )

    def _send(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        try:
            return self._session.request(
                method,
                self.config.base_url + path,
                timeout=self.config.request_timeout_s,
                **kwargs,
            )
        except requests.RequestException as exc:
            raise BackendUnavailable(
                f"DGX Cloud at {self.config.base_url} is unreachable ({type(exc).__name__}): "
                "check DGXCloudCluster.base_url and the network"
            ) from None

    def _raise_for_server(self, response: requests.Response, path: str) -> None:
        if response.status_code >= 500:
            raise BackendUnavailable(
                f"DGX Cloud at {self.config.base_url} answered {response.status_code} to {path}"
            )

    def project(self) -> tuple[str, str]:
        """(project id, cluster id) of the configured project, or a clear error."""
        projects = _json(self.request("GET", "/org-unit/projects")).get("projects") or []
        for project in projects:
            if project.get("name") == self.config.project_name:
                return str(project["id"]), str(project["clusterId"])
        names = sorted(str(p.get("name")) for p in projects)
        raise InvalidJobSpec(
            f"DGXCloudCluster.project_name: no project '{self.config.project_name}' is visible "
            f"to this application (visible: {names}): fix the name or the application's access"
        )

    def named(self, job_id: str) -> dict[str, Any] | None:
        """The live (not deleted) training or distributed workload created for job_id."""
        response = self.request(
            "GET", "/workloads", params={"filterBy": f"name=^{job_id}-", "limit": "500"}
        )
        workloads: list[dict[str, Any]] = _json(response).get("workloads") or []
        for item in workloads:
            rest = str(item.get("name", ""))[len(job_id) + 1 :]
            # the suffix run:ai adds has no '-'; '<job_id>-r1-<suffix>' is another attempt
            if rest and "-" not in rest and item.get("type") in KINDS:
                return item
        return None

    def workloads(self) -> list[dict[str, Any]]:
        """Every live workload of the project: ``GET /workloads`` filtered by project, paged
        (500 a page, `next` the following offset)."""
        items: list[dict[str, Any]] = []
        offset = 0
        while True:
            params = {
                "filterBy": f"projectName=={self.config.project_name}",
                "limit": "500",
                "offset": str(offset),
            }
            response = self.request("GET", "/workloads", params=params)
            if response.status_code != 200:
                raise BackendUnavailable(
                    f"DGX Cloud answered {response.status_code} listing the workloads of project "
                    f"'{self.config.project_name}': {response.text[:200]}"
                )
            body = _json(response)
            items += body.get("workloads") or []
            if body.get("next") is None:
                return items
            offset = int(body["next"])

    def workload(self, kind: str, workload_id: str) -> dict[str, Any] | None:
        """The workload's data, or None when run:ai has no such workload."""
        response = self.request("GET", f"/workloads/{kind}/{workload_id}")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise BackendUnavailable(
                f"DGX Cloud answered {response.status_code} for workload {workload_id}: "
                f"{response.text[:200]}"
            )
        return _json(response)

    def suspend(self, kind: str, workload_id: str) -> None:
        """``POST /workloads/<kind>/<id>/suspend``: stops the pods, keeps the workload."""
        response = self.request("POST", f"/workloads/{kind}/{workload_id}/suspend")
        if response.status_code not in (200, 202, 404):
            raise BackendUnavailable(
                f"DGX Cloud refused to suspend workload {workload_id}: {response.status_code} "
                f"{response.text[:200]}"
            )


def runai_answer(config: DGXCloudConfig) -> Answer:
    """How a dry run answers NeMo-Run's run:ai calls: a placeholder token, the project by
    placeholder ids, creations accepted, a data-mover workspace already Completed."""
    project = config.project_name
    listed = {
        "id": f"<id of project {project}>",
        "name": project,
        "clusterId": f"<cluster id of project {project}>",
    }

    def answer(method: str, path: str, body: Any) -> tuple[int, Any]:
        if path.endswith("/token"):
            return 200, {"accessToken": DRY_RUN_TOKEN}
        if path.endswith("/org-unit/projects"):
            return 200, {"projects": [listed]}
        if method == "POST" and "/workloads/" in path:
            name = (body or {}).get("name")
            return 202, {"workloadId": DRY_RUN_WORKLOAD, "name": name, "actualPhase": "Creating"}
        if method == "GET" and "/workloads/workspaces/" in path:
            return 200, {"actualPhase": "Completed"}
        if method == "DELETE":
            return 202, {}
        return 404, {"code": 404, "message": f"{path} does not exist yet (dry run)"}

    return answer


def workload_document(sent: Sent) -> dict[str, Any]:
    """One workload creation as a dry-run document (code chunks shown by size)."""
    return {
        "kind": "RunaiWorkload",
        "method": sent.method,
        "path": sent.path,
        "request": code_chunks_summarized(sent.body),
    }


def _json(response: requests.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        raise BackendUnavailable(
            f"DGX Cloud answered {response.status_code} with a non-JSON body"
        ) from None
    return data if isinstance(data, dict) else {}
