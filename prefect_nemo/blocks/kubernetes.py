"""Block for a Kubernetes cluster's API: kubeconfig (kept secret, never written to disk) or
in-cluster credentials, plus the namespace to work in."""

from __future__ import annotations

import base64
import copy
import os
import threading
from pathlib import Path
from typing import Annotated, Any

import yaml
from kubernetes import config as k8s_config
from kubernetes.client import ApiClient, Configuration
from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import AfterValidator, Field

from prefect_nemo.blocks.base import DOCS_URL
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.kube.api import KubeApi
from prefect_nemo.names import check_namespace, stable_hash

#: A namespace field: refused when Kubernetes could not name a namespace so.
Namespace = Annotated[str, AfterValidator(check_namespace)]
# where a Kubernetes job kind's jobs queue in Kueue (KubeRay and Kubeflow Trainer blocks alike)
KueueQueueName = Annotated[str | None, Field(
    description="The Kueue LocalQueue its jobs queue in (the kueue.x-k8s.io/queue-name "
    "label; jobs are then created suspended and Kueue starts them when quota allows); "
    "JobSpec.queue overrides it.",
)]  # fmt: skip
KueuePriorityClass = Annotated[str | None, Field(
    description="The Kueue WorkloadPriorityClass of its jobs (the "
    "kueue.x-k8s.io/priority-class label; needs a queue); JobSpec.priority overrides it.",
)]  # fmt: skip

# kubeconfig fields whose base64 data the client would write to temp files
_DATA_FIELDS = {
    "clusters": ("cluster", ("certificate-authority",)),
    "users": ("user", ("client-certificate", "client-key")),
}


class KubernetesCluster(Block):
    """Credentials and namespace for a Kubernetes API server."""

    _block_type_name = "Kubernetes Cluster"
    _block_type_slug = "kubernetes-cluster"
    _logo_url = "https://kubernetes.io/images/favicon.png"  # type: ignore[assignment]
    _documentation_url = DOCS_URL  # type: ignore[assignment]
    _description = (
        "A Kubernetes API server for prefect-nemo: a kubeconfig kept as a secret (never written "
        "to disk) or the pod's in-cluster service account, and the namespace to use."
    )
    _code_example = """
```python
from prefect_nemo.blocks import KubernetesCluster

k8s = KubernetesCluster.load("BLOCK_NAME")
api = k8s.api()  # prefect_nemo.kube.KubeApi
```
"""

    kubeconfig: SecretDict | None = Field(
        default=None,
        description="The kubeconfig document (as a mapping); empty to read $KUBECONFIG or "
        "~/.kube/config at run time, or when in_cluster is set.",
    )
    context: str | None = Field(
        default=None, description="kubeconfig context to use; empty for its current-context."
    )
    namespace: Namespace = Field(
        default="default", description="Namespace where prefect-nemo creates its objects."
    )
    in_cluster: bool = Field(
        default=False,
        description="Use the pod's service account (for flows that run inside the cluster).",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="Timeout of each request to the API server, seconds."
    )

    def api(self) -> KubeApi:
        """A KubeApi on these credentials (one client per process and credentials)."""
        document = self._kubeconfig_document()
        key = stable_hash(repr(document), str(self.context), str(self.in_cluster))
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = _api_client(document, self.context)
        return KubeApi(
            client,
            namespace=self.namespace,
            request_timeout_s=self.request_timeout_s,
            credentials=self.credentials_source(),
        )

    def describe(self) -> str:
        """This block for messages: "KubernetesCluster 'prod'" once saved or loaded by name."""
        name = self._block_document_name if not self._is_anonymous else None
        return f"{type(self).__name__} '{name}'" if name else type(self).__name__

    def credentials_source(self) -> str:
        """Where the credentials come from (block and field; never the credentials), so a 401
        or 403 says what to fix."""
        if self.in_cluster:
            return f"the pod's service account ({self.describe()} has in_cluster set)"
        if self.kubeconfig is not None:
            return f"the kubeconfig field of {self.describe()}"
        return f"the kubeconfig file {_kubeconfig_path()} ({self.describe()}.kubeconfig is empty)"

    def _kubeconfig_document(self) -> dict[str, Any] | None:
        if self.in_cluster:
            return None
        if self.kubeconfig is not None:
            return self.kubeconfig.get_secret_value()
        path = _kubeconfig_path()
        try:
            document: dict[str, Any] = yaml.safe_load(path.expanduser().read_text())
            return document
        except OSError as exc:
            raise InvalidJobSpec(
                f"KubernetesCluster.kubeconfig: empty and {path} cannot be read ({exc}); paste "
                "the kubeconfig into the block or set in_cluster=true inside a pod"
            ) from None


def _kubeconfig_path() -> Path:
    """The kubeconfig file the client would read: the first of $KUBECONFIG, else ~/.kube/config."""
    return Path(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0])


_clients: dict[str, ApiClient] = {}
_clients_lock = threading.Lock()


def _api_client(document: dict[str, Any] | None, context: str | None) -> ApiClient:
    if document is None:
        config = Configuration()
        k8s_config.load_incluster_config(client_configuration=config)
        return ApiClient(config)
    document, keep_open = _certificates_in_memory(document)
    try:
        client: ApiClient = k8s_config.new_client_from_config_dict(
            document, context=context, persist_config=False
        )
    except k8s_config.ConfigException as exc:
        raise InvalidJobSpec(f"KubernetesCluster.kubeconfig: {exc}") from None
    client._prefect_nemo_memfds = keep_open  # type: ignore[attr-defined]  # live as long as it
    return client


def _certificates_in_memory(document: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Move base64 certificate data into anonymous in-memory files (memfd) and point the
    kubeconfig at them: the client reads them by path, and nothing lands on disk (the client
    itself would write them to temp files)."""
    document = copy.deepcopy(document)
    keep_open = []
    for section, (inner, fields) in _DATA_FIELDS.items():
        for entry in document.get(section) or []:
            body = entry.get(inner) or {}
            for field in fields:
                data = body.pop(f"{field}-data", None)
                if data:
                    fd = os.memfd_create(f"kube-{field}", 0)
                    os.write(fd, base64.standard_b64decode(data))
                    keep_open.append(os.fdopen(fd, "rb"))
                    body[field] = f"/proc/self/fd/{fd}"
    return document, keep_open
