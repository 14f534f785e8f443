"""Build kube-apiserver, kube-controller-manager, etcd and the KubeRay operator from Go modules.

Each binary is built once into `~/.cache/prefect-nemo/control-plane/<versions>/bin` (outside the
repository, reused across runs and checkouts); a cold build prints its time. `k8s.io/kubernetes`
is consumed the documented way: a wrapper go.mod that pins every `k8s.io/*` staging module its
go.mod requires as `v0.0.0` to the matching published `v0.X.Y`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

KUBERNETES = "v1.37.2"
STAGING = "v0.37.2"  # the k8s.io/* staging modules published with KUBERNETES
ETCD = "v3.7.3"  # Kubernetes 1.37 supports etcd 3.6 and 3.7 (its client is 3.7)
# the newest the module proxy serves (v1.7.0: "403 This module version is not available"); the
# kit's KubeRay CRDs (testing/crds) are this module's own
KUBERAY = "v1.6.1"
BINARIES = ("kube-apiserver", "kube-controller-manager", "etcd", "ray-operator")
GO_HINT = (
    "install Go >= 1.26 (https://go.dev/dl/) and put `go` on PATH (or set PREFECT_NEMO_GO), "
    "then run `make control-plane` once to build the real Kubernetes control plane"
)


def cache_dir() -> Path:
    """Where the builds live: `$PREFECT_NEMO_CONTROL_PLANE_CACHE` or
    ~/.cache/prefect-nemo/control-plane (one folder per component and version below it)."""
    root = os.environ.get("PREFECT_NEMO_CONTROL_PLANE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "prefect-nemo" / "control-plane"


def _component_dir(folder: str) -> Path:
    # "-stamped": Kubernetes built with its version stamped in (_build_kubernetes); the folder
    # of an earlier build without it stays as it was
    version = {"kubernetes": f"{KUBERNETES}-stamped", "etcd": ETCD, "kuberay": KUBERAY}[folder]
    return cache_dir() / f"{folder}-{version}"


def binary(name: str) -> Path:
    """The path of one built binary (of the pinned version)."""
    return _component_dir(_FOLDERS[name]) / "bin" / name


def go_binary() -> str | None:
    """The Go toolchain to build with: $PREFECT_NEMO_GO, `go` on PATH, or /usr/local/go."""
    for candidate in (
        os.environ.get("PREFECT_NEMO_GO"),
        shutil.which("go"),
        "/usr/local/go/bin/go",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def missing() -> list[str]:
    """The binaries not built yet."""
    return [name for name in BINARIES if not binary(name).is_file()]


def unavailable_reason() -> str | None:
    """Why the control plane cannot start here (None once built): no Go, or not built yet (a
    cold build takes half an hour on 2 cores: too long for a test's timeout)."""
    if not (todo := missing()):
        return None
    if go_binary() is None:
        return f"no Go toolchain for the real Kubernetes control plane: {GO_HINT}"
    return f"the real control plane is not built ({', '.join(todo)}): run `make control-plane`"


def _go(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    print(f"$ go {' '.join(args)}   (in {cwd})", file=sys.stderr, flush=True)
    subprocess.run([env["GO"], *args], cwd=cwd, env=env, check=True)


def _staging_modules() -> list[str]:
    """The k8s.io/* modules k8s.io/kubernetes requires at v0.0.0 (its staging directory)."""
    proxy = os.environ.get("GOPROXY", "https://proxy.golang.org").split(",")[0].split("|")[0]
    if proxy in ("direct", "off"):
        proxy = "https://proxy.golang.org"
    with urllib.request.urlopen(f"{proxy}/k8s.io/kubernetes/@v/{KUBERNETES}.mod", timeout=60) as r:
        text = r.read().decode()
    return sorted(set(re.findall(r"^\s+(k8s\.io/[\w.-]+) v0\.0\.0\s*$", text, re.M)))


def _build_kubernetes(src: Path, out: Path, env: dict[str, str]) -> None:
    src.mkdir(parents=True, exist_ok=True)
    pins = "".join(f"\t{m} => {m} {STAGING}\n" for m in _staging_modules())
    (src / "go.mod").write_text(
        "module prefectnemo.local/controlplane/kube\n\ngo 1.26.0\n\n"
        f"require k8s.io/kubernetes {KUBERNETES}\n\nreplace (\n{pins})\n"
    )
    cmds = [
        f"k8s.io/kubernetes/cmd/{name}" for name in ("kube-apiserver", "kube-controller-manager")
    ]
    _go(["get", *(f"{c}@{KUBERNETES}" for c in cmds)], src, env)
    # the version as Kubernetes' own build stamps it (hack/lib/version.sh): unstamped, /version
    # says "v0.0.0-master+$Format:%H$", which Kueue's manager cannot parse and refuses to start
    pkg = "k8s.io/component-base/version"
    major, minor = KUBERNETES.lstrip("v").split(".")[:2]
    stamp = " ".join(f"-X {pkg}.{key}={value}" for key, value in (
        ("gitVersion", KUBERNETES), ("gitMajor", major), ("gitMinor", minor),
        ("gitTreeState", "clean")))  # fmt: skip
    _go(["build", f"-ldflags={stamp}", "-o", f"{out}/", *cmds], src, env)


def _build_etcd(src: Path, out: Path, env: dict[str, str]) -> None:
    # etcd's own main module carries replace directives (not installable with go install): a
    # two-line main around the server's etcdmain does the same
    src.mkdir(parents=True, exist_ok=True)
    (src / "go.mod").write_text("module prefectnemo.local/controlplane/etcd\n\ngo 1.26.0\n")
    (src / "main.go").write_text(
        'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
        "func main() { etcdmain.Main(os.Args) }\n"
    )
    _go(["get", f"go.etcd.io/etcd/server/v3@{ETCD}"], src, env)
    _go(["mod", "tidy"], src, env)
    _go(["build", "-o", str(out / "etcd"), "."], src, env)


def _build_kuberay(src: Path, out: Path, env: dict[str, str]) -> None:
    src.mkdir(parents=True, exist_ok=True)
    _go(
        ["install", f"github.com/ray-project/kuberay/ray-operator@{KUBERAY}"],
        src,
        dict(env, GOBIN=str(out)),
    )


_FOLDERS = {"kube-apiserver": "kubernetes", "kube-controller-manager": "kubernetes",
            "etcd": "etcd", "ray-operator": "kuberay"}  # fmt: skip
_STEPS = {"kubernetes": _build_kubernetes, "etcd": _build_etcd, "kuberay": _build_kuberay}


def build() -> None:
    """Build what is missing, printing each component's build time and the total."""
    folders = sorted({_FOLDERS[name] for name in missing()})
    if not folders:
        return
    go = go_binary()
    if go is None:
        raise RuntimeError(f"cannot build the control plane: {GO_HINT}")
    env = dict(os.environ, GO=go, GOFLAGS="-buildvcs=false")
    started = time.monotonic()
    for folder in folders:
        t0 = time.monotonic()
        base = _component_dir(folder)
        (base / "bin").mkdir(parents=True, exist_ok=True)
        _STEPS[folder](base / "src", base / "bin", env)
        print(f"control-plane build {base.name}: {time.monotonic() - t0:.0f}s", flush=True)
    print(f"control-plane cold build: {time.monotonic() - started:.0f}s", flush=True)


# -- the real Kubeflow Trainer controller (opt-in: `build_trainer()`, not part of build()) -------

# the module proxy serves v2.3.0 although its version list (`go list -m -versions`) names only
# v2.0.0, whose API has no runtimePatches (our code mounts); the kit's Trainer CRDs are v2.3.0's
TRAINER = "v2.3.0"
JOBSET = "v0.12.0"  # the JobSet API Trainer v2.3.0 requires (the kit's JobSet CRD is its own)
TRAINER_HINT = (
    "build the real Kubeflow Trainer controller once with `python -c 'from prefect_nemo.testing."
    "control_plane import build; build.build_trainer()'` (about 10 minutes on 2 cores)"
)


def trainer_binary() -> Path:
    """The Trainer manager built from `github.com/kubeflow/trainer/v2` at TRAINER."""
    return cache_dir() / f"trainer-{TRAINER}" / "bin" / "trainer-controller-manager"


def _module_dir(module: str, env: dict[str, str]) -> Path:
    """The source of one module version, downloaded into the module cache (read-only). `go
    install m@v` would ask the proxy for the module's version list, which it refuses (403) for
    sigs.k8s.io/jobset."""
    out = subprocess.run([env["GO"], "mod", "download", "-json", module], env=env, check=True,
                         capture_output=True, text=True, cwd=cache_dir())  # fmt: skip
    return Path(json.loads(out.stdout)["Dir"])


def _build_in_module(module: str, package: str, out: Path, ldflags: str = "") -> Path:
    """Build `package` of `module` (name@version, downloaded into the module cache) to `out`,
    printing the build time; the module's source folder."""
    go = go_binary()
    if go is None:
        raise RuntimeError(f"cannot build {module}: {GO_HINT}")
    t0 = time.monotonic()
    env = dict(os.environ, GO=go, GOFLAGS="-mod=mod -buildvcs=false")
    out.parent.mkdir(parents=True, exist_ok=True)
    source = _module_dir(module, env)
    flags = [f"-ldflags={ldflags}"] if ldflags else []
    _go(["build", *flags, "-o", str(out), package], source, dict(env, GOFLAGS="-buildvcs=false"))
    print(f"control-plane build {out.parent.parent.name}: {time.monotonic() - t0:.0f}s", flush=True)
    return source


def build_trainer() -> None:
    """Build the Trainer manager (once), printing the build time."""
    if not trainer_binary().is_file():
        _build_in_module(f"github.com/kubeflow/trainer/v2@{TRAINER}",
                         "./cmd/trainer-controller-manager", trainer_binary())  # fmt: skip


# -- the real JobSet controller (`build_jobset()`): runs the JobSets the Trainer writes ----------


def jobset_binary() -> Path:
    """The JobSet manager built from `sigs.k8s.io/jobset` at JOBSET."""
    return cache_dir() / f"jobset-{JOBSET}" / "bin" / "jobset-controller"


def build_jobset() -> None:
    """Build the JobSet manager (once) from the module's own source, printing the build time.
    `go install sigs.k8s.io/jobset@v` fails here (the proxy refuses the version list, 403), and
    the module's main package is its root, so it is built in the downloaded module."""
    if not jobset_binary().is_file():
        _build_in_module(f"sigs.k8s.io/jobset@{JOBSET}", ".", jobset_binary())


# -- Kueue (`build_kueue()`): queues, quotas and preemption for RayJobs and TrainJobs ------------

# the kit's Kueue CRDs (testing/crds/kueue) are this module's own
KUEUE = "v0.17.0"
# what Kueue's own manifests say about the manager, kept beside the binary (read when it starts):
# its ClusterRole, the metrics/delegated-auth role, its Secrets role in its own namespace, and its
# webhook configurations
KUEUE_CONFIG = {
    "role.yaml": "config/components/rbac/role.yaml",
    "metrics_auth_role.yaml": "config/components/rbac/metrics_auth_role.yaml",
    "manager_secrets_role.yaml": "config/components/rbac/manager_secrets_role.yaml",
    "webhooks.yaml": "config/components/webhook/manifests.yaml",
}


def kueue_binary() -> Path:
    """Kueue's manager (`cmd/kueue`) built from `sigs.k8s.io/kueue` at KUEUE."""
    return cache_dir() / f"kueue-{KUEUE}" / "bin" / "kueue"


def kueue_config(name: str) -> Path:
    """One of KUEUE_CONFIG's files, copied from the module when Kueue was built."""
    return cache_dir() / f"kueue-{KUEUE}" / "config" / name


def build_kueue() -> None:
    """Build Kueue's manager (once) in the downloaded module, as its Makefile does (`go build
    cmd/kueue`, the version stamped into pkg/version), printing the build time; copy its RBAC
    and webhook manifests beside it."""
    module = f"sigs.k8s.io/kueue@{KUEUE}"
    if kueue_binary().is_file():
        if all(kueue_config(name).is_file() for name in KUEUE_CONFIG):
            return
        go = go_binary()
        if go is None:
            raise RuntimeError(f"cannot read {module}: {GO_HINT}")
        source = _module_dir(module, dict(os.environ, GO=go, GOFLAGS="-mod=mod"))
    else:
        stamp = f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE}"
        source = _build_in_module(module, "./cmd/kueue", kueue_binary(), ldflags=stamp)
    for name, path in KUEUE_CONFIG.items():
        kueue_config(name).parent.mkdir(parents=True, exist_ok=True)
        kueue_config(name).write_bytes((source / path).read_bytes())
