"""A simulator's own Node on a real API server: what a kubelet does for the pods bound to it.

The real kube-apiserver routes a Service through EndpointSlices, which the real EndpointSlice
controller fills only with pods that are bound to an existing Node and have a podIP ("If the
Node specified by the Pod doesn't exist ... update the EndpointSlice without the problematic
Pod", k8s.io/endpointslice reconciler.go); its service proxy then dials that podIP (never a
loopback address). And a bound pod, once deleted, keeps its deletionTimestamp until its kubelet
confirms the containers stopped. So on a real API server a
simulator registers a Node, binds its pods to it, gives each running pod an address from a
`PodNetwork`, may serve HTTP there, and finishes each pod's deletion itself. `serve_logs()` also
answers the kubelet's `/containerLogs` on the Node's own address, where the API server fetches
`pods/log` from: "By default, the apiserver does not verify the kubelet's serving
certificate" (Kubernetes, kubelet authentication), so a self-signed one does.
"""

from __future__ import annotations

import contextlib
import http.server
import ssl
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from prefect_nemo.testing.control_plane.pod_network import PodNetwork
from prefect_nemo.testing.kube_api.tls import server_cert_pems

Obj = dict[str, Any]
# handler(method, path, headers, body) -> (status, headers, body), as the loopback proxy takes
Handler = Callable[[str, str, Any, bytes], tuple[int, dict[str, str], bytes]]
LogSource = str | Callable[[], str]
KUBELET_PORT = 10250


class SimNode:
    """One Node, the pod addresses of its pods, and the HTTP listeners on them."""

    def __init__(self, core: client.CoreV1Api, name: str, network: PodNetwork | None = None):
        self.core = core
        self.name = name
        self.network = network or PodNetwork()
        self._own_network = network is None
        self._ips: dict[tuple[str, str], str] = {}  # (namespace, pod) -> address
        self._servers: dict[tuple[str, str], http.server.ThreadingHTTPServer] = {}
        self._logs: dict[tuple[str, str, str | None], LogSource] = {}
        self._lock = threading.Lock()

    def register(self) -> None:
        """Create the Node (kept if it exists: a real node outlives its kubelet's restarts)."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name}},
        }
        try:
            self.core.create_node(body, field_validation="Strict")  # as the simulators write
        except ApiException as exc:
            if exc.status != 409:  # 409: there already
                raise

    def serve_logs(self) -> None:
        """Answer the kubelet's `/containerLogs/{ns}/{pod}/{container}` on an address of the
        Node's own, and publish it in the Node's status as its InternalIP and kubelet port."""
        node = {"metadata": {"namespace": "", "name": f"node/{self.name}"}}
        pems = server_cert_pems("kubelet")
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory(prefix="sim-kubelet-") as folder:
            (Path(folder) / "cert.pem").write_bytes(pems[1])
            (Path(folder) / "key.pem").write_bytes(pems[2])
            tls.load_cert_chain(Path(folder) / "cert.pem", Path(folder) / "key.pem")
        self.serve(node, KUBELET_PORT, self._container_log, tls)
        status = {"addresses": [{"type": "InternalIP", "address": self.address(node)}],
                  "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}}}  # fmt: skip
        self.core.patch_node_status(self.name, {"status": status}, field_validation="Strict")

    def set_log(self, namespace: str, pod: str, source: LogSource, container: str | None) -> None:
        """What `pods/{pod}/log` answers (a callable: asked on each read; container None: any)."""
        with self._lock:
            self._logs[(namespace, pod, container)] = source

    def _container_log(self, method: str, path: str, headers: Any, body: bytes) -> Any:
        url = urllib.parse.urlsplit(path)
        parts = url.path.strip("/").split("/")
        if method != "GET" or len(parts) != 4 or parts[0] != "containerLogs":
            return 404, {}, b"not found"
        _, ns, pod, container = parts
        with self._lock:
            source = self._logs.get((ns, pod, container), self._logs.get((ns, pod, None)))
        if source is None:
            return 404, {}, f"no log for {ns}/{pod}/{container}".encode()
        text = source() if callable(source) else source
        tail = urllib.parse.parse_qs(url.query).get("tailLines")
        if tail:
            text = "".join(text.splitlines(keepends=True)[-int(tail[0]) :])
        return 200, {"Content-Type": "text/plain"}, text.encode()

    def address(self, pod: Obj) -> str:
        """The pod's address (allocated on first use)."""
        key = _key(pod)
        with self._lock:
            if key in self._ips:
                return self._ips[key]
        ip = self.network.allocate()
        with self._lock:
            self._ips[key] = ip
        return ip

    def serve(
        self, pod: Obj, port: int, handler: Handler, tls: ssl.SSLContext | None = None
    ) -> None:
        """Answer HTTP (HTTPS with `tls`) on the pod's address and `port` (once per pod)."""
        key = _key(pod)
        with self._lock:
            if key in self._servers:
                return
        server = http.server.ThreadingHTTPServer((self.address(pod), port), _handler_class(handler))
        server.daemon_threads = True
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True, name=f"pod-{key[1]}").start()
        with self._lock:
            self._servers[key] = server

    def unserve(self, pod: Obj) -> None:
        """Stop answering on the pod's address (it keeps the address: connections are refused)."""
        with self._lock:
            server = self._servers.pop(_key(pod), None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def forget(self, namespace: str, pod: str) -> None:
        """The pod is gone or going: stop its listener, take its address off `lo`."""
        self.unserve({"metadata": {"namespace": namespace, "name": pod}})
        with self._lock:
            ip = self._ips.pop((namespace, pod), None)
            for key in [k for k in self._logs if k[:2] == (namespace, pod)]:
                del self._logs[key]
        if ip is not None:
            self.network.release(ip)

    def finish_deletion(self, pod: Obj) -> None:
        """What the kubelet does once a bound pod is asked to go: stop it, then delete it for
        good (grace period 0, only this uid)."""
        meta = pod["metadata"]
        self.forget(meta["namespace"], meta["name"])
        options = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])
        )
        with contextlib.suppress(ApiException):  # gone already, or another uid now
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=options)

    def close(self) -> None:
        """Stop every listener and release every address (the Node object stays)."""
        with self._lock:
            keys = set(self._ips) | set(self._servers)
        for ns, pod in keys:
            self.forget(ns, pod)
        if self._own_network:
            self.network.close()


def _key(pod: Obj) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]


def _handler_class(handler: Handler) -> type[http.server.BaseHTTPRequestHandler]:
    class _Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            status, headers, body = handler(
                self.command, self.path, self.headers, self.rfile.read(length)
            )
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:  # quiet: tests read their own output
            pass

    return _Handler
