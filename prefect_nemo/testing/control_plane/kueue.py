"""Kueue (v0.17.0) on the real control plane: its manager as a process, and queues per test.

ControlPlane starts Kueue's manager (built by `build.build_kueue()`) as a local process, like the
Trainer's: its Configuration (config.kueue.x-k8s.io/v1beta2, the version cmd/kueue decodes) turns
on only the RayJob and TrainJob integrations, leaves jobs without a queue label alone
(`manageJobsWithoutQueueName: false`), no waitForPodsReady, no leader election. Its webhooks are
Kueue's own (the module's config/components/webhook, copied beside the binary at build), those of
Kueue's kinds and of the two integrations, reached by URL with a certificate made here; the job
webhooks only in the namespaces where the real engines run (kuberay, trainer-real), so the
simulators' jobs elsewhere never wait on Kueue. It runs as its own static-token user bound to
Kueue's own ClusterRole (config/components/rbac/role.yaml) and the metrics role's
tokenreviews/subjectaccessreviews, which its visibility server needs for delegated auth.

The visibility API (`visibility.kueue.x-k8s.io`, pending workloads and their positions) is an
aggregated API served by the manager itself: kube-apiserver runs with the aggregation layer's
flags (front-proxy CA and client certificate, run.py) and an APIService points at an ExternalName
Service `localhost`, which the aggregator dials at the APIService's port (kube-apiserver's
ResolveCluster), with `insecureSkipTLSVerify` as Kueue's own APIService manifests have it.

Kueue reads two certificates from fixed paths when it does not manage its own (cmd/kueue/main.go:
/etc/kueue/metrics/certs; pkg/visibility/server.go: /visibility): written once, if missing, for
every control plane of this machine (the content is a throwaway self-signed pair), so Kueue needs
root here (as the node agent does).

`make_queues(plane, namespace, cpu=...)` gives a test its ResourceFlavor, ClusterQueue (nominal
quota), LocalQueue and WorkloadPriorityClasses, deleted at the end.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import fcntl
import json
import os
import secrets
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from prefect_nemo.local_ray import free_ports
from prefect_nemo.testing.control_plane import build
from prefect_nemo.testing.control_plane.controllers import Controller, _write_cert
from prefect_nemo.testing.kube_api.tls import server_cert_pems


class AdminApi(Protocol):
    """What Kueue's set-up needs of a ControlPlane (run.py, which starts Kueue from here):
    admin requests to its API server."""

    def request(self, method: str, path: str, body: dict | None = None) -> bytes: ...

    def get(
        self, kind_plural: str, namespace: str | None, name: str, group: str = "",
        version: str = "v1",
    ) -> dict | None: ...  # fmt: skip


USER = "prefect-nemo-kueue"  # Kueue's identity in the static token file
NAMESPACE = "kueue-system"  # Kueue's own namespace (its config `namespace`)
# Kueue v0.17.0's names (pkg/controller/jobs/rayjob, .../trainjob: FrameworkName)
FRAMEWORKS = ("ray.io/rayjob", "trainer.kubeflow.org/trainjob")
JOB_RESOURCES = ("rayjobs", "trainjobs")  # what FRAMEWORKS' webhooks match
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue docs, "Run A RayJob": "Queue selection"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass's name
VISIBILITY = "visibility.kueue.x-k8s.io"
VISIBILITY_SERVICE = "kueue-visibility"
# read by Kueue at these fixed paths when internalCertManagement is off
FIXED_CERT_DIRS = (Path("/etc/kueue/metrics/certs"), Path("/visibility"))
CRD_FOLDER = "kueue"  # below the kit's crds/: the loopback server does not load it


def unavailable_reason() -> str | None:
    """Why Kueue cannot start here (None when it can)."""
    if not build.kueue_binary().is_file() or not all(
        build.kueue_config(name).is_file() for name in build.KUEUE_CONFIG
    ):
        return "Kueue is not built: run `make control-plane`"
    missing = [d for d in FIXED_CERT_DIRS if not (d / "tls.crt").is_file()]
    if missing and os.geteuid() != 0:
        return (f"Kueue reads certificates from {', '.join(map(str, missing))} (fixed paths); "
                "writing them needs root")  # fmt: skip
    return None


def crd_documents() -> list[dict[str, Any]]:
    """Kueue's CRDs, as the kit ships them (crds/kueue)."""
    from prefect_nemo.testing.kube_api import PACKAGED_CRDS
    from prefect_nemo.testing.kube_api.schema import read_crd_documents

    return read_crd_documents([PACKAGED_CRDS / CRD_FOLDER])


@dataclass
class KueueSetup:
    """What ControlPlane does to run Kueue: start `controller`; once it is ready, create
    `objects` ((collection path, body): webhooks, the visibility Service and APIServices)."""

    controller: Controller
    objects: list[tuple[str, dict[str, Any]]]
    visibility_port: int


def prepare(workdir: Path, kubeconfig: Path, namespaces: tuple[str, ...]) -> KueueSetup:
    """Write Kueue's configuration and webhook certificate under `workdir`; `namespaces` are
    those whose RayJobs and TrainJobs pass Kueue's webhooks."""
    _ensure_fixed_certs()
    certs = workdir / "certs"
    ca_pem = _write_cert(certs, "kueue-webhook")
    probe_port, webhook_port, visibility_port, metrics_port = free_ports(4)
    probe = f"127.0.0.1:{probe_port}"
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": probe},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": _in_namespaces(namespaces),
        "integrations": {"frameworks": list(FRAMEWORKS)},
        "visibilityServer": {"bindAddress": "127.0.0.1", "bindPort": visibility_port},
    }  # fmt: skip
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    controller = Controller("kueue", [
        str(build.kueue_binary()), f"--config={workdir / 'config.yaml'}",
        f"--kubeconfig={kubeconfig}",  # also what its visibility server delegates auth with
        "--zap-encoder=console",
    ], {}, f"http://{probe}/readyz")  # fmt: skip
    objects = [*_webhooks(ca_pem, webhook_port, namespaces), *_visibility(visibility_port)]
    return KueueSetup(controller, objects, visibility_port)


def rbac() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): Kueue's own roles (its manifests'), bound to USER: its
    ClusterRole with the metrics role's tokenreviews/subjectaccessreviews, its Secrets Role in
    its namespace; and the reader Role of kube-system's extension-apiserver-authentication
    ConfigMap (its visibility server reads the front-proxy CA there)."""
    rules = [*_manifest("role.yaml")[0]["rules"], *_manifest("metrics_auth_role.yaml")[0]["rules"]]
    subject = [{"kind": "User", "name": USER, "apiGroup": "rbac.authorization.k8s.io"}]
    base = "/apis/rbac.authorization.k8s.io/v1"

    def ref(kind: str, name: str) -> dict[str, str]:
        return {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}

    secrets = {"metadata": {"name": USER},
               "rules": _manifest("manager_secrets_role.yaml")[0]["rules"]}  # fmt: skip
    return [
        ("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}}),
        (f"{base}/clusterroles", {"metadata": {"name": USER}, "rules": rules}),
        (f"{base}/clusterrolebindings", {"metadata": {"name": USER}, "subjects": subject,
                                         "roleRef": ref("ClusterRole", USER)}),
        (f"{base}/namespaces/{NAMESPACE}/roles", secrets),
        (f"{base}/namespaces/{NAMESPACE}/rolebindings", {"metadata": {"name": USER},
                                                         "subjects": subject,
                                                         "roleRef": ref("Role", USER)}),
        (f"{base}/namespaces/kube-system/rolebindings", {
            "metadata": {"name": USER}, "subjects": subject,
            "roleRef": ref("Role", "extension-apiserver-authentication-reader")}),
    ]  # fmt: skip


def front_proxy_pems() -> tuple[bytes, bytes, bytes]:
    """(CA, client certificate, key) PEMs for kube-apiserver's aggregation layer: the client
    certificate it presents to aggregated API servers (`--proxy-client-cert-file`), signed by the
    CA they trust for request headers (`--requestheader-client-ca-file`)."""
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=7))
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefect-nemo-front-proxy-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    client = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                          FRONT_PROXY_CLIENT)]))
              .issuer_name(ca_name).public_key(key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(valid[0]).not_valid_after(valid[1])
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))  # fmt: skip
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    return ca.public_bytes(pem), client.public_bytes(pem), key_pem


FRONT_PROXY_CLIENT = "front-proxy-client"  # the name `--requestheader-allowed-names` allows


# -- per-test queues ----------------------------------------------------------------------------


@dataclass
class QueueSet:
    """One test's ResourceFlavor, ClusterQueue, LocalQueue (in `namespace`) and
    WorkloadPriorityClasses; `delete()` (or the `with` block's end) removes them."""

    plane: AdminApi
    namespace: str
    flavor: str
    cluster_queue: str
    local_queue: str
    priorities: dict[str, str] = field(default_factory=dict)  # ours -> WorkloadPriorityClass

    def labels(self, priority: str | None = None) -> dict[str, str]:
        """The labels that send a job to this queue (at one of `priorities`)."""
        labels = {QUEUE_LABEL: self.local_queue}
        if priority is not None:
            labels[PRIORITY_LABEL] = self.priorities[priority]
        return labels

    def workload(self, owner_uid: str) -> dict[str, Any] | None:
        """The Workload Kueue made for the job with this uid (its `kueue.x-k8s.io/job-uid`
        label), None until it exists."""
        path = (f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/workloads"
                f"?labelSelector=kueue.x-k8s.io/job-uid={owner_uid}")  # fmt: skip
        items = json.loads(self.plane.request("GET", path))["items"]
        return items[0] if items else None

    def local_queue_status(self) -> dict[str, Any]:
        """The LocalQueue's status (pendingWorkloads, admittedWorkloads, conditions...)."""
        lq = self.plane.get("localqueues", self.namespace, self.local_queue, GROUP, VERSION)
        return (lq or {}).get("status") or {}

    def pending_workloads(self) -> list[dict[str, Any]] | None:
        """The LocalQueue's pending workloads from Kueue's visibility API (each with
        `positionInLocalQueue`, `positionInClusterQueue`, `priority`), in queue order; None
        while the API is not served (503: the APIService is not available yet)."""
        path = (f"/apis/{VISIBILITY}/{VERSION}/namespaces/{self.namespace}/localqueues/"
                f"{self.local_queue}/pendingworkloads")  # fmt: skip
        try:
            return json.loads(self.plane.request("GET", path)).get("items") or []
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 503):
                return None
            raise

    def delete(self, timeout_s: float = 30.0) -> None:
        """Delete what make_queues created and wait (up to `timeout_s`) until it is gone. Kueue
        holds a ClusterQueue (its `resource-in-use` finalizer), and so its flavor, while
        workloads still reserve quota in it: those go with their jobs, which a test deletes
        after its queues, so while they are there the wait stops (it could only time out; the
        queues' names are unique, so the next test is not affected)."""
        base, ns = f"/apis/{GROUP}/{VERSION}", f"/namespaces/{self.namespace}"
        cluster_queue = f"{base}/clusterqueues/{self.cluster_queue}"
        paths = [
            f"{base}{ns}/localqueues/{self.local_queue}",
            cluster_queue,
            f"{base}/resourceflavors/{self.flavor}",
            *(f"{base}/workloadpriorityclasses/{n}" for n in self.priorities.values()),
        ]
        for path in paths:
            with contextlib.suppress(urllib.error.HTTPError):  # 404: gone already
                self.plane.request("DELETE", path)
        deadline = time.monotonic() + timeout_s
        for path in paths:
            while _exists(self.plane, path) and time.monotonic() < deadline:
                if self._reserving(cluster_queue):
                    return
                time.sleep(0.2)

    def _reserving(self, cluster_queue: str) -> bool:
        """True while workloads reserve quota in the ClusterQueue (its status counts them)."""
        try:
            status = json.loads(self.plane.request("GET", cluster_queue)).get("status") or {}
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise
        return bool(status.get("reservingWorkloads") or status.get("admittedWorkloads"))

    def __enter__(self) -> QueueSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()


def make_queues(
    plane: AdminApi,
    namespace: str,
    *,
    cpu: str = "1",
    memory: str = "4Gi",
    gpus: int | None = None,
    preemption: str = "LowerPriority",
    priorities: dict[str, int] | None = None,
) -> QueueSet:
    """A ClusterQueue whose nominal quota is `cpu`, `memory` and `gpus` (nvidia.com/gpu, when
    given) of one new ResourceFlavor, its LocalQueue in `namespace` (the ClusterQueue takes
    workloads of that namespace only), and one WorkloadPriorityClass per `priorities` entry
    (name -> value; default low 100, high 1000). `preemption` is the ClusterQueue's
    `preemption.withinClusterQueue` (Never, LowerPriority, LowerOrNewerEqualPriority). Names are
    unique per call; the LocalQueue is never `default` (Kueue would send every job of the
    namespace without a queue label to it)."""
    suffix = secrets.token_hex(3)
    quota = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    queues = QueueSet(plane, namespace, f"pn-flavor-{suffix}", f"pn-cq-{suffix}",
                      f"pn-lq-{suffix}")  # fmt: skip
    base = f"/apis/{GROUP}/{VERSION}"
    try:
        plane.request("POST", f"{base}/resourceflavors", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor",
            "metadata": {"name": queues.flavor}})  # fmt: skip
        for name, value in (priorities or {"low": 100, "high": 1000}).items():
            queues.priorities[name] = f"pn-{name}-{suffix}"
            plane.request("POST", f"{base}/workloadpriorityclasses", {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "WorkloadPriorityClass",
                "metadata": {"name": queues.priorities[name]}, "value": value})  # fmt: skip
        plane.request("POST", f"{base}/clusterqueues", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue",
            "metadata": {"name": queues.cluster_queue},
            "spec": {
                "namespaceSelector": _in_namespaces((namespace,)),
                "preemption": {"withinClusterQueue": preemption},
                "resourceGroups": [{"coveredResources": list(quota), "flavors": [{
                    "name": queues.flavor,
                    "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()],
                }]}],
            },
        })  # fmt: skip
        plane.request("POST", f"{base}/namespaces/{namespace}/localqueues", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue",
            "metadata": {"name": queues.local_queue, "namespace": namespace},
            "spec": {"clusterQueue": queues.cluster_queue}})  # fmt: skip
    except BaseException:
        queues.delete(timeout_s=0)
        raise
    return queues


# -- internals ----------------------------------------------------------------------------------


def _manifest(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(build.kueue_config(name).read_text()) if d]


def _in_namespaces(namespaces: tuple[str, ...]) -> dict[str, Any]:
    return {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                  "values": list(namespaces)}]}  # fmt: skip


def _webhooks(ca_pem: bytes, port: int, namespaces: tuple[str, ...]) -> list[tuple[str, dict]]:
    """Kueue's webhook configurations (its manifests'), cut to its own kinds and FRAMEWORKS':
    the webhook server serves no others, and a webhook it does not serve fails closed."""
    bundle = base64.b64encode(ca_pem).decode()
    out = []
    for doc in _manifest("webhooks.yaml"):
        hooks = []
        for hook in doc["webhooks"]:
            rules = hook["rules"]
            ours = any(GROUP in r["apiGroups"] for r in rules)
            job = any(set(r["resources"]) & set(JOB_RESOURCES) for r in rules)
            if not (ours or job):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook = {**hook, "clientConfig": {"url": f"https://127.0.0.1:{port}{path}",
                                             "caBundle": bundle}}  # fmt: skip
            if job:
                hook["namespaceSelector"] = _in_namespaces(namespaces)
            hooks.append(hook)
        plural = doc["kind"].lower() + "s"
        out.append((f"/apis/admissionregistration.k8s.io/v1/{plural}", {
            "apiVersion": doc["apiVersion"], "kind": doc["kind"],
            "metadata": {"name": f"prefect-nemo-kueue-{doc['kind'][0].lower()}"},
            "webhooks": hooks}))  # fmt: skip
    return out


def _visibility(port: int) -> list[tuple[str, dict[str, Any]]]:
    """The Service and APIServices of Kueue's visibility API (its config/components/visibility,
    the Service an ExternalName to this machine: APIService ports reach it, see above)."""
    service = {"metadata": {"name": VISIBILITY_SERVICE, "namespace": NAMESPACE},
               "spec": {"type": "ExternalName", "externalName": "localhost"}}  # fmt: skip
    return [(f"/api/v1/namespaces/{NAMESPACE}/services", service), *(
        ("/apis/apiregistration.k8s.io/v1/apiservices", {
            "metadata": {"name": f"{version}.{VISIBILITY}"},
            "spec": {"group": VISIBILITY, "version": version, "groupPriorityMinimum": 100,
                     "versionPriority": 100, "insecureSkipTLSVerify": True,
                     "service": {"name": VISIBILITY_SERVICE, "namespace": NAMESPACE,
                                 "port": port}},
        }) for version in ("v1beta1", "v1beta2"))]  # fmt: skip


def _ensure_fixed_certs() -> None:
    """Kueue's metrics and visibility certificates at their fixed paths, written when missing
    or within a day of expiry (they last a week; other control planes of this machine may be
    using them: never removed, replaced atomically, key first, then the certificate)."""
    for folder in FIXED_CERT_DIRS:
        if _certs_fresh(folder):
            continue
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:  # two planes starting at once: one pair
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _certs_fresh(folder):
                continue
            _, cert_pem, key_pem = server_cert_pems("kueue")
            for name, data in (("tls.key", key_pem), ("tls.crt", cert_pem)):
                tmp = folder / f".{name}.{os.getpid()}"
                tmp.write_bytes(data)
                tmp.chmod(0o600)
                os.replace(tmp, folder / name)


def _certs_fresh(folder: Path) -> bool:
    """A key and a certificate in `folder`, the certificate good for another day."""
    if not (folder / "tls.key").is_file() or not (folder / "tls.crt").is_file():
        return False
    cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    return left > datetime.timedelta(days=1)


def _exists(plane: AdminApi, path: str) -> bool:
    try:
        plane.request("GET", path)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise
    return True
