"""Start the real control plane on loopback: etcd, kube-apiserver, kube-controller-manager, the
kit's CRDs (testing/crds), the KubeRay operator, and (when built) the Kubeflow Trainer and JobSet
controllers (controllers.py) and Kueue (kueue.py); stop every process by pid.

Generated per start: a CA and the API server's certificate, the ServiceAccount signing key and
an admin token (static token file, group system:masters); authorization is RBAC only, so a
ServiceAccount token gets exactly what its Roles grant. The aggregation layer is on (a front-proxy
CA and client certificate): Kueue's visibility API is an aggregated API. No scheduler and no
kubelet: with the operator comes our node agent (node_agent.py), which binds and runs the pods of
the operator's namespace and of the Trainer's (controllers.TRAINER_NAMESPACE) as local processes;
it needs the pod network (root), else `agent_unavailable` says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from prefect_nemo.local_ray import free_ports
from prefect_nemo.testing.control_plane import build, controllers, kueue, pod_network
from prefect_nemo.testing.kube_api.client_config import TokenClientConfig
from prefect_nemo.testing.kube_api.tls import server_cert_pems

ADMIN_USER = "prefect-nemo-admin"
# the one namespace the KubeRay operator reconciles: the API server tests elsewhere write RayJobs
# that no operator should touch
OPERATOR_NAMESPACE = "kuberay"
START_TIMEOUT_S = 120.0
# how long a pod tolerates an unreachable or not-ready node (the DefaultTolerationSeconds
# admission plugin's flags; its default is 300 s) before the taint-eviction-controller deletes
# it: node_agent.lose_node's pods go in seconds
UNREACHABLE_TOLERATION_S = 2
# the controllers our tests rely on (garbage collector, namespace deletion, default
# ServiceAccounts and their tokens, Jobs for KubeRay's submitter, EndpointSlices of Services,
# the eviction of a lost node's pods and, once it is marked out of service, their final delete:
# node_agent.lose_node and out_of_service). The taint-eviction-controller finds
# a node's pods by the pod informer's spec.nodeName index, which only the node lifecycle and
# DaemonSet controllers add (AddPodNodeNameIndexer); alone it logs "Index with name
# spec.nodeName does not exist" and evicts nothing: the DaemonSet controller (idle: no
# DaemonSets here) comes along for its index.
CONTROLLERS = (
    "garbage-collector-controller,namespace-controller,serviceaccount-controller,"
    "serviceaccount-token-controller,job-controller,endpointslice-controller,"
    "taint-eviction-controller,daemonset-controller,pod-garbage-collector-controller"
)


# The KubeRay operator watches RayServices too and stops when their CRD is missing; the kit's
# CRDs have none (we never write one), so a schema-less stand-in lets the operator start.
_RAYSERVICE_STANDIN = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "rayservices.ray.io"},
    "spec": {
        "group": "ray.io", "scope": "Namespaced",
        "names": {"kind": "RayService", "plural": "rayservices", "singular": "rayservice",
                  "listKind": "RayServiceList"},
        "versions": [{
            "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {"type": "object",
                                           "x-kubernetes-preserve-unknown-fields": True}},
        }],
    },
}  # fmt: skip


def state_file() -> Path:
    """Where a running control plane (started by `make control-plane up`) is described."""
    return build.cache_dir() / "running.json"


class ControlPlane(TokenClientConfig):
    """etcd + kube-apiserver + kube-controller-manager (+ the KubeRay operator) on loopback."""

    def __init__(self, *, operator: bool = True, workdir: str | Path | None = None) -> None:
        self.operator = operator
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="prefect-nemo-control-plane-"))
        self.token = secrets.token_urlsafe(24)
        self._controllers_token = secrets.token_urlsafe(24)  # controllers.USER's
        self._kueue_token = secrets.token_urlsafe(24)  # kueue.USER's
        self.ca_pem: bytes | None = None
        self.url = ""
        self.pids: dict[str, int] = {}
        self.started_s = 0.0
        self.agent_unavailable: str | None = None  # why no node agent runs the pods
        self.controllers_unavailable: str | None = None  # why no Trainer + JobSet controllers
        self.trainer_status_unavailable: str | None = None  # why no Trainer status server
        self.kueue_unavailable: str | None = None  # why no Kueue
        self._owned = True  # False when attached to one started by another process

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        """Start everything (binaries must be built: `build.build()`); returns self."""
        if self.pids:  # running already (or attached to)
            return self
        t0 = time.monotonic()
        binary = build.binary
        etcd_port, etcd_peer, api_port = free_ports(3)
        self.url = f"https://127.0.0.1:{api_port}"
        files = self._write_files()  # the admin kubeconfig names the url
        try:
            self._spawn("etcd", [
                str(binary("etcd")), "--name=default", f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync", "--log-level=warn",
            ])  # fmt: skip
            self._spawn("kube-apiserver", [
                str(binary("kube-apiserver")), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}", f"--tls-cert-file={files['cert']}",
                f"--tls-private-key-file={files['key']}", f"--token-auth-file={files['tokens']}",
                "--authorization-mode=RBAC", "--service-cluster-ip-range=10.96.0.0/24",
                # its own URL, where it serves the issuer's OIDC discovery: the Trainer's status
                # server verifies the pods' tokens by it (controllers.py)
                f"--service-account-issuer={self.url}",
                f"--service-account-key-file={files['sa_pub']}",
                f"--service-account-signing-key-file={files['sa_key']}",
                f"--cert-dir={self.workdir / 'certs'}", "--profiling=false",
                "--enable-priority-and-fairness=false", "--v=0",
                # a loopback advertise address is refused by the default lease reconciler
                "--endpoint-reconciler-type=none",
                # pods need no `default` ServiceAccount first: no kubelet mounts its token, and
                # a fresh namespace would race the ServiceAccount controller (the Trainer's pods
                # get `default` from controllers.default_account_policy instead)
                "--disable-admission-plugins=ServiceAccount",
                # as kubeadm sets it: pods/log dials a node's InternalIP first (our nodes' names
                # resolve nowhere)
                "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
                # the aggregation layer, as kubeadm sets it up (Kueue's visibility API); a
                # client CA too, which aggregated servers expect in the ConfigMap they read
                # (nothing here signs client certificates with it)
                f"--client-ca-file={files['ca']}",
                f"--requestheader-client-ca-file={files['front_proxy_ca']}",
                f"--requestheader-allowed-names={kueue.FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={files['front_proxy_cert']}",
                f"--proxy-client-key-file={files['front_proxy_key']}",
                # the DefaultTolerationSeconds admission plugin: how long a pod stays on a node
                # lost (node_agent.lose_node) before the taint-eviction-controller deletes it
                f"--default-unreachable-toleration-seconds={UNREACHABLE_TOLERATION_S}",
                f"--default-not-ready-toleration-seconds={UNREACHABLE_TOLERATION_S}",
            ])  # fmt: skip
            self._wait_ready(START_TIMEOUT_S)
            self.kueue_unavailable = (kueue.unavailable_reason() if self.operator
                                      else "started without operators")  # fmt: skip
            # before the garbage collector discovers what it watches (a CRD added later waits
            # for its next discovery, ~30 s, before its objects' dependents are collected);
            # Kueue's only when it runs (the workloads CRD alone is 1.4 MB)
            extra = [] if self.kueue_unavailable else kueue.crd_documents()
            self.install_crds([*_kit_crds(), *extra])
            self._spawn("kube-controller-manager", [
                str(binary("kube-controller-manager")), f"--kubeconfig={files['kubeconfig']}",
                f"--authentication-kubeconfig={files['kubeconfig']}",
                f"--authorization-kubeconfig={files['kubeconfig']}",
                "--leader-elect=false", f"--controllers={CONTROLLERS}",
                f"--service-account-private-key-file={files['sa_key']}",
                f"--root-ca-file={files['ca']}", "--secure-port=0", "--profiling=false",
                "--concurrent-gc-syncs=5",
            ])  # fmt: skip
            if self.operator:
                self._spawn("ray-operator", [
                    str(binary("ray-operator")), "--metrics-addr=0",
                    "--health-probe-bind-address=0", "--enable-leader-election=false",
                    "--log-stdout-encoder=console", f"--watch-namespace={OPERATOR_NAMESPACE}",
                ], env={"KUBECONFIG": str(files["kubeconfig"])})  # fmt: skip
                self._start_agent(files["kubeconfig"])
                self._start_controllers()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _start_agent(self, kubeconfig: Path) -> None:
        """The node agent, a process of its own (so a plane left running by `up` keeps it);
        stopped first, by pid, while the API server still answers its cleanup."""
        self.agent_unavailable = pod_network.unavailable_reason()
        if self.agent_unavailable is None:
            self._spawn("node_agent", [
                sys.executable, "-m", "prefect_nemo.testing.control_plane.node_agent",
                str(kubeconfig), OPERATOR_NAMESPACE, controllers.TRAINER_NAMESPACE,
                # the Trainer's status server: a local process listening on every address
                *[f"{name}=local" for name in pod_network.service_names(
                    controllers.STATUS_SERVICE, controllers.TRAINER_SYSTEM_NAMESPACE)],
            ])  # fmt: skip

    def _start_controllers(self) -> None:
        """The Trainer + JobSet controllers (when built) as controllers.USER, with its RBAC and
        JobSet's webhooks, and Kueue (when built) as kueue.USER; returns once all answer their
        readiness probe (started together: their start-ups overlap), then registers Kueue's
        webhooks and visibility API."""
        started: list[controllers.Controller] = []
        self.controllers_unavailable = controllers.unavailable_reason()
        if self.controllers_unavailable is None:
            namespace = {"metadata": {"name": controllers.TRAINER_NAMESPACE}}
            for path, body in [("/api/v1/namespaces", namespace), *controllers.rbac(),
                               *controllers.default_account_policy()]:  # fmt: skip
                self.request("POST", path, body)
            kubeconfig = self._write_kubeconfig("controllers", self._controllers_token)
            self.trainer_status_unavailable = controllers.status_unavailable_reason()
            token = None
            if self.trainer_status_unavailable is None:
                for path, body in controllers.status_account():
                    self.request("POST", path, body)
                account = (f"/api/v1/namespaces/{controllers.TRAINER_SYSTEM_NAMESPACE}"
                           f"/serviceaccounts/{controllers.SERVICE_ACCOUNT}/token")  # fmt: skip
                token = json.loads(self.request("POST", account, {"spec": {}}))["status"]["token"]
            started, webhooks, objects = controllers.prepare(
                self.workdir / "controllers", kubeconfig, token
            )
            for webhook in webhooks:
                plural = webhook["kind"].lower() + "s"
                self.request("POST", f"/apis/admissionregistration.k8s.io/v1/{plural}", webhook)
            for path, body in objects:
                self.request("POST", path, body)
        setup = None
        if self.kueue_unavailable is None:
            for path, body in kueue.rbac():
                self.request("POST", path, body)
            kubeconfig = self._write_kubeconfig("kueue", self._kueue_token)
            namespaces = (OPERATOR_NAMESPACE, controllers.TRAINER_NAMESPACE)
            setup = kueue.prepare(self.workdir / "kueue", kubeconfig, namespaces)
            started = [*started, setup.controller]
        for controller in started:
            self._spawn(controller.name, controller.argv, controller.env)
        deadline = time.monotonic() + START_TIMEOUT_S
        for controller in started:
            while not _answers(controller.ready_url):
                if not _alive(self.pids[controller.name]) or time.monotonic() > deadline:
                    log = self.log(controller.name)[-3000:]
                    raise RuntimeError(f"{controller.name} did not get ready: {log}")
                time.sleep(0.2)
        # only now: Kueue's webhooks fail closed, and an APIService nobody serves fails the
        # discovery of the namespace controller and the garbage collector
        for path, body in setup.objects if setup else []:
            self.request("POST", path, body)

    def _write_kubeconfig(self, name: str, token: str) -> Path:
        kubeconfig = self.workdir / f"{name}.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(self.kubeconfig(context=name, token=token)))
        kubeconfig.chmod(0o600)
        return kubeconfig

    def stop(self) -> None:
        """Stop every process (by pid, newest first) and remove the work folder; nothing for
        one attached to (see `attach`)."""
        if not self._owned:
            return
        for name in reversed(list(self.pids)):
            _stop_pid(self.pids.pop(name), name)
        shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(state_file().read_text()).get("workdir") == str(self.workdir):
                state_file().unlink()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- sharing one across processes (make control-plane up / down) ----------------------------

    def save_state(self) -> Path:
        """Describe this running control plane for `attach()`; the file path."""
        state = {"url": self.url, "token": self.token, "ca_pem": (self.ca_pem or b"").decode(),
                 "pids": self.pids, "workdir": str(self.workdir),
                 "trainer_status_unavailable": self.trainer_status_unavailable}  # fmt: skip
        path = state_file()
        path.write_text(json.dumps(state))
        path.chmod(0o600)
        (self.workdir / "admin.kubeconfig").chmod(0o600)
        return path

    @classmethod
    def attach(cls, *, own: bool = False) -> ControlPlane | None:
        """The control plane `make control-plane up` left running, if it still answers; its
        `stop()` stops it only with `own`."""
        try:
            state = json.loads(state_file().read_text())
        except (FileNotFoundError, ValueError):
            return None
        plane = cls(operator="ray-operator" in state["pids"], workdir=state["workdir"])
        plane.url, plane.token = state["url"], state["token"]
        plane.ca_pem, plane.pids = state["ca_pem"].encode(), dict(state["pids"])
        plane._owned = own
        plane.trainer_status_unavailable = state.get(
            "trainer_status_unavailable",
            "the control plane left running predates its status server",
        )
        if plane.operator and "node_agent" not in plane.pids:
            plane.agent_unavailable = "the control plane left running has no node agent"
        if "jobset-controller" not in plane.pids:
            plane.controllers_unavailable = (
                "the control plane left running has no Trainer + JobSet controllers: "
                "`make control-plane CP=down`, then `make control-plane CP=up`"
            )
        if "kueue" not in plane.pids:
            plane.kueue_unavailable = (
                "the control plane left running has no Kueue: `make control-plane`, then "
                "`make control-plane CP=down` and `make control-plane CP=up`"
            )
        try:
            plane._wait_ready(2.0)
        except TimeoutError:
            return None
        return plane

    # -- for tests ---------------------------------------------------------------------------

    def install_crds(self, docs: list[dict[str, Any]] | None = None) -> None:
        """Create CRDs (by default the kit's, `crd_dir()`: KubeRay, Trainer, JobSet, Dynamo) and
        wait until served; one already there is kept."""
        from kubernetes import client

        if docs is None:
            docs = _kit_crds()
        api = client.ApiextensionsV1Api(self.api_client())
        names = []
        for doc in docs:
            names.append(doc["metadata"]["name"])
            try:
                api.create_custom_resource_definition(doc)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
        deadline = time.monotonic() + 60
        for name in names:
            while not any(
                c.type == "Established" and c.status == "True"
                for c in (api.read_custom_resource_definition(name).status.conditions or [])
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRD {name} not established in 60 s")
                time.sleep(0.1)

    def get(
        self, kind_plural: str, namespace: str | None, name: str, group: str = "",
        version: str = "v1",
    ) -> dict | None:  # fmt: skip
        """One object as the API server stores it; None when absent (LoopbackKubeServer.get)."""
        base = f"/apis/{group}/{version}" if group else "/api/v1"
        where = f"/namespaces/{namespace}" if namespace else ""
        try:
            return json.loads(self.request("GET", f"{base}{where}/{kind_plural}/{name}"))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def request(self, method: str, path: str, body: dict | None = None) -> bytes:
        """One admin request to the API server; raises urllib's HTTPError on an error status."""
        ctx = ssl.create_default_context(cadata=(self.ca_pem or b"").decode())
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, data=json.dumps(body).encode() if body else None,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, context=ctx, timeout=30) as resp:
            return resp.read()

    def log(self, name: str) -> str:
        """The log of one component (kube-apiserver, etcd, ...)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- internals -----------------------------------------------------------------------------

    def _write_files(self) -> dict[str, Path]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ca_pem, cert_pem, key_pem = server_cert_pems("kube-apiserver")
        self.ca_pem = ca_pem
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        files = {name: self.workdir / name for name in (
            "ca", "cert", "key", "sa_key", "sa_pub", "tokens", "kubeconfig")}  # fmt: skip
        files["ca"].write_bytes(ca_pem)
        files["cert"].write_bytes(cert_pem)
        files["key"].write_bytes(key_pem)
        files["sa_key"].write_bytes(sa.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))  # fmt: skip
        files["sa_pub"].write_bytes(sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo,
        ))  # fmt: skip
        files["tokens"].write_text(
            f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            f"{self._controllers_token},{controllers.USER},{controllers.USER}\n"
            f"{self._kueue_token},{kueue.USER},{kueue.USER}\n"
        )
        for name, pem in zip(("front_proxy_ca", "front_proxy_cert", "front_proxy_key"),
                             kueue.front_proxy_pems(), strict=True):  # fmt: skip
            files[name] = self.workdir / name
            files[name].write_bytes(pem)
        files["kubeconfig"] = self.workdir / "admin.kubeconfig"
        files["kubeconfig"].write_text(yaml.safe_dump(self.kubeconfig(context="control-plane")))
        for path in files.values():
            path.chmod(0o600)
        return files

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip
        self.pids[name] = proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise RuntimeError(f"{name} exited: {self.log(name)[-3000:]}")
            try:
                self.request("GET", "/readyz")
                return
            except OSError as exc:
                last = exc
            time.sleep(0.2)
        raise TimeoutError(f"kube-apiserver at {self.url} not ready in {timeout_s:.0f} s: {last}")


def _kit_crds() -> list[dict[str, Any]]:
    """The kit's CRDs (crd_dir(): KubeRay, Trainer, JobSet, Dynamo) and the RayService stand-in."""
    from prefect_nemo.testing.kube_api import crd_dir
    from prefect_nemo.testing.kube_api.schema import read_crd_documents

    return [*read_crd_documents([crd_dir()]), _RAYSERVICE_STANDIN]


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (started by another process): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return waited == 0


def _stop_pid(pid: int, name: str, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`, the process `pid` if it still runs `name`."""
    try:
        if name not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return  # gone, and the pid reused by something else
        os.kill(pid, signal.SIGTERM)
    except (FileNotFoundError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
