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

The Trainer's status server (feature gate TrainJobStatus, alpha in v2.3.0) runs when we are root:
trainer containers then post their progress to it and it stores `status.trainerStatus`. It
needs what an in-cluster controller has, at paths it hard-codes: its ServiceAccount token and
namespace under /var/run/secrets/kubernetes.io/serviceaccount (the token's issuer is where it
discovers the keys that verify the pods' tokens; the namespace is its "operator namespace") and
its certificate in /tmp/k8s-webhook-server/serving-certs. The controller gets them in a mount
namespace of its own (`unshare --mount`, tmpfs over /var/run and /tmp, its work folder bound
back), so nothing is written to the machine's /var/run or /tmp, and all of it goes with the
process. The pods reach it as `STATUS_SERVICE.TRAINER_SYSTEM_NAMESPACE.svc` (the node agent's
/etc/hosts entry, an address on `lo` of its own: the server listens on every address), the name
its certificate carries;
the CA is in WEBHOOK_SECRET's `ca.crt`, which the Trainer copies into each TrainJob's ConfigMap.
The pods' projected token needs a ServiceAccount: `default_account_policy`.
"""

from __future__ import annotations

import base64
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefect_nemo.local_ray import free_ports  # the control plane's processes all bind 127.0.0.1
from prefect_nemo.testing.control_plane import build
from prefect_nemo.testing.control_plane.pod_network import service_names
from prefect_nemo.testing.kube_api.tls import server_cert_pems

# the namespace whose TrainJobs run to their end: the node agent serves it (the simulators'
# TrainJobs live in `default`, where no JobSet is ever written)
TRAINER_NAMESPACE = "trainer-real"
JOBSET_WEBHOOKS = (  # name, path, operations: JobSet's config/components/webhook/manifests.yaml
    ("mjobset.kb.io", "/mutate-jobset-x-k8s-io-v1alpha2-jobset", ("CREATE",)),
    ("vjobset.kb.io", "/validate-jobset-x-k8s-io-v1alpha2-jobset", ("CREATE", "UPDATE")),
)


USER = "prefect-nemo-trainer-controllers"  # their identity in the static token file
# the Trainer's own namespace, ServiceAccount, Service and webhook Secret (its manifests' and its
# Configuration's default names: the status server's URL and CA are derived from them)
TRAINER_SYSTEM_NAMESPACE = "kubeflow-system"
SERVICE_ACCOUNT = "kubeflow-trainer-controller-manager"
STATUS_SERVICE = "kubeflow-trainer-controller-manager"  # certManagement.webhookServiceName
WEBHOOK_SECRET = "kubeflow-trainer-webhook-cert"  # certManagement.webhookSecretName
# run in the controller's mount namespace: tmpfs over /var/run and /tmp (the work folder bound
# back where it was), then the ServiceAccount files and the status server's certificate at the
# paths the Trainer reads (pkg/statusserver/auth.go, pkg/util/cert/cert.go)
_IN_OWN_MOUNTS = """set -e
mount -t tmpfs -o mode=755 prefect-nemo /var/run
mkdir -p /var/run/prefect-nemo-work
mount --bind "$PN_WORKDIR" /var/run/prefect-nemo-work
mount -t tmpfs -o mode=1777 prefect-nemo /tmp
mkdir -p "$PN_WORKDIR"
mount --bind /var/run/prefect-nemo-work "$PN_WORKDIR"
mkdir -p /var/run/secrets/kubernetes.io/serviceaccount /tmp/k8s-webhook-server/serving-certs
cp "$PN_ACCOUNT"/token "$PN_ACCOUNT"/namespace /var/run/secrets/kubernetes.io/serviceaccount/
cp "$PN_CERTS"/tls.crt "$PN_CERTS"/tls.key /tmp/k8s-webhook-server/serving-certs/
exec "$@"
"""


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


def status_unavailable_reason() -> str | None:
    """Why the Trainer's status server cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the Trainer's status server needs root (a mount namespace of its own)"
    if not (shutil.which("unshare") and shutil.which("mount")):
        return "the Trainer's status server needs `unshare` and `mount` (util-linux)"
    return None


def status_account() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): the Trainer's namespace and ServiceAccount, whose token
    tells its status server the issuer of the pods' tokens."""
    return [
        ("/api/v1/namespaces", {"metadata": {"name": TRAINER_SYSTEM_NAMESPACE}}),
        (f"/api/v1/namespaces/{TRAINER_SYSTEM_NAMESPACE}/serviceaccounts",
         {"metadata": {"name": SERVICE_ACCOUNT}}),
    ]  # fmt: skip


def prepare(
    workdir: Path, kubeconfig: Path, account_token: str | None = None
) -> tuple[list[Controller], list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
    """Write each controller's configuration and certificate under `workdir`; the controllers
    to start, the webhook configurations and the other objects to create. With
    `account_token` (the Trainer's ServiceAccount's) its status server runs too."""
    trainer_dir, jobset_dir = workdir / "trainer", workdir / "jobset"
    # the Trainer reads its webhooks' certificate from the default cert dir under its TMPDIR
    certs = trainer_dir / "k8s-webhook-server" / "serving-certs"
    status_names = tuple(service_names(STATUS_SERVICE, TRAINER_SYSTEM_NAMESPACE))
    trainer_ca = _write_cert(certs, "trainer-controller", status_names)
    trainer_probe_port, trainer_port, jobset_probe_port, jobset_port, status_port = free_ports(5)
    trainer_probe = f"127.0.0.1:{trainer_probe_port}"
    trainer_config: dict[str, Any] = {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": trainer_probe}, "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": trainer_port},
        "leaderElection": {"leaderElect": False}, "certManagement": {"enable": False},
    }  # fmt: skip
    trainer_argv = [str(build.trainer_binary()), f"--config={trainer_dir / 'config.yaml'}",
                    "--zap-encoder=console"]  # fmt: skip
    trainer_env = {"KUBECONFIG": str(kubeconfig), "TMPDIR": str(trainer_dir)}
    objects: list[tuple[str, dict[str, Any]]] = []
    if account_token is not None:
        trainer_config["featureGates"] = {"TrainJobStatus": True}
        trainer_config["statusServer"] = {"port": status_port}
        account = trainer_dir / "serviceaccount"
        account.mkdir(mode=0o700, parents=True, exist_ok=True)
        (account / "token").write_text(account_token)
        (account / "token").chmod(0o600)
        (account / "namespace").write_text(TRAINER_SYSTEM_NAMESPACE)
        own_mounts = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c"]
        trainer_argv = [*own_mounts, _IN_OWN_MOUNTS, "trainer-controller-manager", *trainer_argv]
        trainer_env.update(PN_WORKDIR=str(workdir.parent), PN_ACCOUNT=str(account),
                           PN_CERTS=str(certs))  # fmt: skip
        secret = {"metadata": {"name": WEBHOOK_SECRET}, "type": "kubernetes.io/tls",
                  "data": {name: base64.b64encode((certs / name).read_bytes()).decode()
                           for name in ("tls.crt", "tls.key")}}  # fmt: skip
        secret["data"]["ca.crt"] = base64.b64encode(trainer_ca).decode()
        objects.append((f"/api/v1/namespaces/{TRAINER_SYSTEM_NAMESPACE}/secrets", secret))
    (trainer_dir / "config.yaml").write_text(yaml.safe_dump(trainer_config))
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
        Controller("trainer-controller-manager", trainer_argv, trainer_env,
                   f"http://{trainer_probe}/readyz"),
        Controller("jobset-controller", [
            str(build.jobset_binary()), f"--config={jobset_dir / 'config.yaml'}",
            "--zap-encoder=console"], env, f"http://{jobset_probe}/readyz"),
    ]  # fmt: skip
    return controllers, _jobset_webhooks(ca_pem, jobset_port), objects


def rbac() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): read everything anywhere, write only in TRAINER_NAMESPACE."""
    subject = [{"kind": "User", "name": USER, "apiGroup": "rbac.authorization.k8s.io"}]
    base, name = "/apis/rbac.authorization.k8s.io/v1", USER
    read = [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list", "watch"]},
            # the status server's OIDC discovery of the pods' token issuer (the API server)
            {"nonResourceURLs": ["/.well-known/openid-configuration", "/openid/v1/jwks"],
             "verbs": ["get"]}]  # fmt: skip
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


def default_account_policy() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): a MutatingAdmissionPolicy giving a pod of TRAINER_NAMESPACE
    without a ServiceAccount the namespace's `default`, as the ServiceAccount admission plugin
    does on a real cluster. That plugin is off here (run.py: it would also mount a token into
    every pod and refuse pods of a namespace whose `default` account is not made yet), but the
    API server refuses a pod with a projected ServiceAccount token and no account ("must not
    be specified when serviceAccountName is not set"), and the Trainer's TrainJobStatus plugin
    gives each trainer pod one, whichever runtime it comes from."""
    name, base = "prefect-nemo-default-service-account", "/apis/admissionregistration.k8s.io/v1"
    policy = {
        "metadata": {"name": name},
        "spec": {
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["pods"]}]},
            "matchConditions": [{"name": "no-account",
                                 "expression": "!has(object.spec.serviceAccountName) || "
                                               "object.spec.serviceAccountName == ''"}],
            "failurePolicy": "Fail", "reinvocationPolicy": "Never",
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {
                "expression": 'Object{spec: Object.spec{serviceAccountName: "default"}}'}}],
        },
    }  # fmt: skip
    binding = {"metadata": {"name": name}, "spec": {"policyName": name, "matchResources": {
        "namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": TRAINER_NAMESPACE}}}}}  # fmt: skip
    return [(f"{base}/mutatingadmissionpolicies", policy),
            (f"{base}/mutatingadmissionpolicybindings", binding)]  # fmt: skip


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


def _write_cert(folder: Path, name: str, dns_names: tuple[str, ...] = ()) -> bytes:
    """A server certificate for 127.0.0.1 (and `dns_names`) as tls.crt/tls.key in `folder`;
    its CA's PEM."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_pem, cert_pem, key_pem = server_cert_pems(name, dns_names)
    (folder / "tls.crt").write_bytes(cert_pem)
    (folder / "tls.key").write_bytes(key_pem)
    (folder / "tls.key").chmod(0o600)
    return ca_pem
