"""The real Kubeflow Trainer and JobSet controllers, as ControlPlane starts them (when built).

The Trainer (v2.3.0) turns a TrainJob into a JobSet; the JobSet controller (v0.12.0) turns that
into Jobs, the real Job controller makes their pods, and the node agent runs the pods of
TRAINER_NAMESPACE. Neither manages certificates: each serves its webhooks with a self-signed
certificate written here. The Trainer's webhooks are not registered with the API server (the
previous session's choice: its TrainJob validation is not needed to run one); JobSet's jobset
webhooks are, by URL, because its controller relies on their defaulting (a nil successPolicy or
network would panic its reconciler: "Default performs defaulting of jobset values as defined in
the JobSet API", jobset pkg/webhooks/jobset_webhook.go). JobSet's pod webhooks act only on
exclusive placement, which no prefect-nemo runtime asks for, so they are left out.

Both watch every namespace (neither can be told one), while the simulators run their own
TrainJobs on the same API server: RBAC confines them. Their user may read everything but write
only in TRAINER_NAMESPACE, so a TrainJob elsewhere gets no JobSet and no status from them (the
Trainer logs "forbidden" and backs off), as a real cluster confines a controller's
ServiceAccount. Nothing cluster-scoped is written: the runtimes get no "in use" finalizer.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefect_nemo.local_ray import free_ports  # the control plane's processes all bind 127.0.0.1
from prefect_nemo.testing.control_plane import build
from prefect_nemo.testing.kube_api.tls import server_cert_pems

# the namespace whose TrainJobs run to their end: the node agent serves it (the simulators'
# TrainJobs live in `default`, where no JobSet is ever written)
TRAINER_NAMESPACE = "trainer-real"
JOBSET_WEBHOOKS = (  # name, path, operations: JobSet's config/components/webhook/manifests.yaml
    ("mjobset.kb.io", "/mutate-jobset-x-k8s-io-v1alpha2-jobset", ("CREATE",)),
    ("vjobset.kb.io", "/validate-jobset-x-k8s-io-v1alpha2-jobset", ("CREATE", "UPDATE")),
)


USER = "prefect-nemo-trainer-controllers"  # their identity in the static token file


@dataclass
class Controller:
    """One controller process to start: its argv, extra env and readiness URL."""

    name: str
    argv: list[str]
    env: dict[str, str]
    ready_url: str


def unavailable_reason() -> str | None:
    """Why the Trainer + JobSet controllers cannot start (None once both are built)."""
    todo = [p.name for p in (build.trainer_binary(), build.jobset_binary()) if not p.is_file()]
    if not todo:
        return None
    return (f"the real Kubeflow Trainer / JobSet controllers are not built ({', '.join(todo)}): "
            "run `make control-plane`")  # fmt: skip


def prepare(workdir: Path, kubeconfig: Path) -> tuple[list[Controller], list[dict[str, Any]]]:
    """Write each controller's configuration and certificate under `workdir`; the controllers
    to start and the webhook configurations to create."""
    trainer_dir, jobset_dir = workdir / "trainer", workdir / "jobset"
    # the Trainer reads its certificate from the default cert dir under its TMPDIR
    _write_cert(trainer_dir / "k8s-webhook-server" / "serving-certs", "trainer-controller")
    trainer_probe_port, trainer_port, jobset_probe_port, jobset_port = free_ports(4)
    trainer_probe = f"127.0.0.1:{trainer_probe_port}"
    (trainer_dir / "config.yaml").write_text(yaml.safe_dump({
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": trainer_probe}, "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": trainer_port},
        "leaderElection": {"leaderElect": False}, "certManagement": {"enable": False},
    }))  # fmt: skip
    ca_pem = _write_cert(jobset_dir / "certs", "jobset-webhook")
    jobset_probe = f"127.0.0.1:{jobset_probe_port}"
    (jobset_dir / "config.yaml").write_text(yaml.safe_dump({
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": jobset_probe}, "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": jobset_port,
                    "certDir": str(jobset_dir / "certs")},
        "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
    }))  # fmt: skip
    env = {"KUBECONFIG": str(kubeconfig)}
    controllers = [
        Controller("trainer-controller-manager", [
            str(build.trainer_binary()), f"--config={trainer_dir / 'config.yaml'}",
            "--zap-encoder=console"], {**env, "TMPDIR": str(trainer_dir)},
            f"http://{trainer_probe}/readyz"),
        Controller("jobset-controller", [
            str(build.jobset_binary()), f"--config={jobset_dir / 'config.yaml'}",
            "--zap-encoder=console"], env, f"http://{jobset_probe}/readyz"),
    ]  # fmt: skip
    return controllers, _jobset_webhooks(ca_pem, jobset_port)


def rbac() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): read everything anywhere, write only in TRAINER_NAMESPACE."""
    subject = [{"kind": "User", "name": USER, "apiGroup": "rbac.authorization.k8s.io"}]
    base, name = "/apis/rbac.authorization.k8s.io/v1", USER
    read = [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list", "watch"]}]
    write = [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]
    in_ns = f"{base}/namespaces/{TRAINER_NAMESPACE}"
    return [
        (f"{base}/clusterroles", {"metadata": {"name": name}, "rules": read}),
        (f"{base}/clusterrolebindings", {"metadata": {"name": name}, "subjects": subject,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": name}}),
        (f"{in_ns}/roles", {"metadata": {"name": name}, "rules": write}),
        (f"{in_ns}/rolebindings", {"metadata": {"name": name}, "subjects": subject,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}}),
    ]  # fmt: skip


def _jobset_webhooks(ca_pem: bytes, port: int) -> list[dict[str, Any]]:
    """JobSet's jobset webhooks, reached by URL (no Service: the controller is a local
    process), failing closed as its own manifests do."""
    bundle = base64.b64encode(ca_pem).decode()
    hooks = {
        kind: [{
            "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Fail",
            "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle},
            "rules": [{"apiGroups": ["jobset.x-k8s.io"], "apiVersions": ["v1alpha2"],
                       "operations": list(ops), "resources": ["jobsets"]}],
        } for name, path, ops in JOBSET_WEBHOOKS if name[0] == kind[0].lower()]
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    }  # fmt: skip
    return [{"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
             "metadata": {"name": f"prefect-nemo-jobset-{kind[0].lower()}"},
             "webhooks": webhooks} for kind, webhooks in hooks.items()]  # fmt: skip


def _write_cert(folder: Path, name: str) -> bytes:
    """A server certificate for 127.0.0.1 as tls.crt/tls.key in `folder`; its CA's PEM."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_pem, cert_pem, key_pem = server_cert_pems(name)
    (folder / "tls.crt").write_bytes(cert_pem)
    (folder / "tls.key").write_bytes(key_pem)
    (folder / "tls.key").chmod(0o600)
    return ca_pem
