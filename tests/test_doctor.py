"""`prefect-nemo doctor`: real engines answer each check. A missing CRD and an operator too old
to serve the version we use, on the loopback API server (the real control plane's CRDs are
shared by the other files of its process: see test_real_doctor.py); Ray's dashboard and an old
Ray client against the real local Ray head; this machine's clock against the real Prefect
server's; the command end to end, its exit codes, its table, and no secret in its output."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from prefect_nemo.doctor import (
    THIS_MACHINE,
    Check,
    Status,
    check_backend,
    clock_check,
    failed,
    table,
)
from tests.conftest import subprocess_env


def rows_of(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def doctor_cli(prefect_api: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`prefect-nemo doctor ARGS` against the session's Prefect API, wide enough not to wrap."""
    return subprocess.run(
        [sys.executable, "-m", "prefect_nemo.cli", "doctor", *args],
        env=subprocess_env(prefect_api, COLUMNS="400"), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


# -- Kubernetes: one list of verbs; CRDs missing or too old -----------------------------------


def test_the_kuberay_backend_declares_the_documented_role() -> None:
    """One list: the verbs the doctor asks about are the KubeRay block's documented Role (the
    README's, which test_real_control_plane.py proves is enough on the real API server)."""
    from prefect_nemo.blocks import KubeRayCluster, KubernetesCluster
    from tests.test_kuberay import cluster_spec
    from tests.test_real_control_plane import KUBERAY_RULES

    nowhere = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "c", "user": {"token": "unused-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "c"}}],
    }  # fmt: skip  # building the backend sends no request
    block = KubeRayCluster(
        kubernetes=KubernetesCluster(kubeconfig=nowhere), ray_cluster_spec=cluster_spec()
    )
    assert [need.rule() for need in block.backend().access()] == KUBERAY_RULES


@pytest.fixture(scope="module")
def trainer_only() -> Iterator[Any]:
    """An API server with Kubeflow Trainer's CRDs and no KubeRay."""
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    crds = sorted(crd_dir().glob("trainer.kubeflow.org_*.yaml"))
    with LoopbackKubeServer(crds=crds) as server:
        yield server


def kuberay_block(server: Any, **fields: Any) -> Any:
    from prefect_nemo.blocks import KubeRayCluster, KubernetesCluster
    from tests.test_kuberay import cluster_spec

    kube = KubernetesCluster(kubeconfig=server.kubeconfig())
    return KubeRayCluster(kubernetes=kube, ray_cluster_spec=cluster_spec(), **fields)


def test_a_missing_crd_fails_with_the_operator_to_install(trainer_only: Any) -> None:
    """KubeRay not installed: both of its CRDs fail, naming what to install, and the doctor
    fails (exit 1); a Kubeflow block on the same server passes its CRD rows."""
    from prefect_nemo.blocks import KubeflowTrainerCluster, KubernetesCluster

    checks = check_backend("kube-ray-cluster/t", kuberay_block(trainer_only).backend())
    rows = rows_of(checks)
    for crd in ("rayjobs.ray.io", "rayclusters.ray.io"):
        row = rows[f"crd {crd}"]
        assert row.status is Status.FAIL, row
        assert "not installed: the API server does not serve" in row.detail
        assert row.fix == "install the KubeRay operator (its CRDs) in the cluster"
    assert failed(checks)
    assert rows["kubernetes credentials"].status is Status.OK
    kube = KubernetesCluster(kubeconfig=trainer_only.kubeconfig())
    trainer = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim")
    rows = rows_of(check_backend("kubeflow-trainer-cluster/t", trainer.backend()))
    assert rows["crd trainjobs.trainer.kubeflow.org"].status is Status.OK
    assert rows["crd clustertrainingruntimes.trainer.kubeflow.org"].detail == (
        "served: v1alpha1; storage v1alpha1"
    )


@pytest.fixture(scope="module")
def old_kuberay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An API server whose KubeRay is from before 1.0: ray.io/v1alpha1 served, no v1."""
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    folder = tmp_path_factory.mktemp("old-kuberay")
    for plural in ("rayjobs", "rayclusters"):
        crd = yaml.safe_load((crd_dir() / f"ray.io_{plural}.yaml").read_text())
        old = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
        crd["spec"]["versions"] = [{**old[0], "storage": True}]
        (folder / f"ray.io_{plural}.yaml").write_text(yaml.safe_dump(crd))
    with LoopbackKubeServer(crds=[folder]) as server:
        yield server


def test_a_crd_served_at_another_version_is_named(old_kuberay: Any) -> None:
    """KubeRay 0.x served only ray.io/v1alpha1 (v1 came with 1.0; REFERENCE: "ray.io/v1alpha1
    is deprecated"): the row names the version served, the one we use, and the upgrade."""
    rows = rows_of(check_backend("kube-ray-cluster/t", kuberay_block(old_kuberay).backend()))
    row = rows["crd rayjobs.ray.io"]
    assert row.status is Status.FAIL
    assert row.detail == "served at v1alpha1 only; prefect-nemo uses ray.io/v1"
    assert row.fix == (
        "install the KubeRay operator (its CRDs) in the cluster: a release that serves ray.io/v1"
    )


def test_the_loopback_server_without_access_reviews_is_a_warning(kube_server: Any) -> None:
    """An API server that does not answer SelfSubjectAccessReview (our loopback one): RBAC is
    not checked, which is said (a warning), not passed silently and not failed."""
    checks = check_backend("kube-ray-cluster/t", kuberay_block(kube_server).backend())
    rows = rows_of(checks)
    assert rows["rbac"].status is Status.WARN and "not checked" in rows["rbac"].detail
    assert not failed(checks)


def test_rejected_credentials_fail_at_once_naming_where_they_come_from(kube_server: Any) -> None:
    """A token the API server does not take: one failed row naming the block's field (where
    the credentials come from), no further row, and the token in no row."""
    from prefect_nemo.blocks import KubernetesCluster

    bad = "not-the-token-" + uuid.uuid4().hex
    config = kube_server.kubeconfig(token=bad)
    block = kuberay_block(kube_server).model_copy(
        update={"kubernetes": KubernetesCluster(kubeconfig=config)}
    )
    checks = check_backend("kube-ray-cluster/t", block.backend())
    assert [(c.name, c.status) for c in checks] == [("kubernetes credentials", Status.FAIL)]
    assert "rejected the credentials (401)" in checks[0].detail
    assert "the kubeconfig field of KubernetesCluster" in checks[0].fix
    assert bad not in checks[0].detail + checks[0].fix


def test_kuberay_on_an_existing_cluster_reaches_its_dashboard_through_the_proxy(
    kube_server: Any, kuberay: Any, kube_block: Any, ray_head: Any
) -> None:
    """KubeRay on an existing RayCluster (the simulator's, its head forwarding to the real
    Ray): the cluster row, then Ray's own rows through the API server's service proxy; a
    cluster name that does not exist fails naming the field."""
    from prefect_nemo.backends.kuberay import ensure_ray_cluster, wait_ray_cluster_ready
    from prefect_nemo.blocks import KubeRayCluster
    from tests.test_kuberay import cluster_spec

    api = kube_block.api()
    ensure_ray_cluster(api, cluster_spec(), "doctor-shared")
    wait_ray_cluster_ready(api, "doctor-shared", timeout_s=60)
    block = KubeRayCluster(
        kubernetes=kube_block, ray_cluster_name="doctor-shared", ray_token=ray_head.token
    )
    checks = check_backend("kube-ray-cluster/t", block.backend())
    rows = rows_of(checks)
    assert rows["raycluster doctor-shared"].detail == "exists (ready)"
    assert rows["ray dashboard"].status is Status.OK
    assert "/services/doctor-shared-head-svc:8265/proxy" in rows["ray dashboard"].detail
    assert rows["ray versions"].status is Status.OK
    assert not failed(checks) and ray_head.token not in table(checks)
    gone = block.model_copy(update={"ray_cluster_name": "no-such-cluster"})
    row = rows_of(check_backend("kube-ray-cluster/t", gone.backend()))["raycluster no-such-cluster"]
    assert row.status is Status.FAIL and "KubeRayCluster.ray_cluster_name" in row.fix


# -- Ray: the dashboard, the versions, an old client -------------------------------------------


def test_ray_dashboard_and_versions_pass_on_the_real_head(ray_head: Any) -> None:
    """The real head: the dashboard answers with the block's token, Ray's version there and
    here, label selectors supported."""
    import ray

    rows = rows_of(check_backend("ray-jobs-cluster/t", ray_head.block().backend()))
    assert rows["ray dashboard"] == Check(
        "ray dashboard", Status.OK, f"Ray {ray.__version__} answers at {ray_head.dashboard_url}",
        block="ray-jobs-cluster/t",
    )  # fmt: skip
    assert rows["ray versions"].status is Status.OK
    assert "label selectors supported" in rows["ray versions"].detail


def test_an_old_ray_client_says_label_selectors_are_not_supported(ray_head: Any) -> None:
    """Ray 2.53's JobSubmissionClient has no entrypoint_label_selector: the versions row says
    label selectors are not supported here and which ray to install. A warning while only
    jobs may ask for selectors; a failure when the block's own image_label_selectors would
    give its jobs one (they would all stop before being sent)."""
    from tests.old_ray import Ray253Cluster

    old = Ray253Cluster(dashboard_url=ray_head.dashboard_url, auth_token=ray_head.token)
    row = rows_of(check_backend("ray-jobs-cluster/old", old.backend()))["ray versions"]
    assert row.status is Status.WARN
    assert "label selectors are not supported" in row.detail
    assert "Ray253Client" in row.detail and "cannot send entrypoint_label_selector" in row.detail
    assert row.fix == (
        "upgrade ray on this machine to >= 2.54.0 (pip install -U 'ray[default]>=2.54.0')"
    )
    mapped = old.model_copy(update={"image_label_selectors": {"nvcr.io/*": {"pool": "gpu"}}})
    row = rows_of(check_backend("ray-jobs-cluster/old", mapped.backend()))["ray versions"]
    assert row.status is Status.FAIL and "image_label_selectors" in row.detail


def test_a_wrong_ray_token_fails_naming_the_field(ray_head: Any) -> None:
    """Ray >= 2.59 token auth: a token the head does not take fails the dashboard row with the
    field to set; the token itself is masked wherever it would appear."""
    bad = "wrong-ray-token-" + uuid.uuid4().hex
    block = ray_head.block().model_copy(update={"auth_token": SecretStr(bad)})
    checks = check_backend("ray-jobs-cluster/t", block.backend())
    assert [(c.name, c.status) for c in checks] == [("ray dashboard", Status.FAIL)]
    assert "RayJobsCluster.auth_token" in checks[0].fix and "ray get-auth-token" in checks[0].fix
    assert bad not in table(checks)


def test_an_unreachable_dashboard_fails_naming_the_address() -> None:
    """Nothing listens at the address: the row names it and the field to check."""
    from prefect_nemo.blocks import RayJobsCluster
    from prefect_nemo.local_ray import free_port

    url = f"http://127.0.0.1:{free_port()}"
    checks = check_backend("ray-jobs-cluster/t", RayJobsCluster(dashboard_url=url).backend())
    assert checks[0].status is Status.FAIL and url in checks[0].detail
    assert "RayJobsCluster.dashboard_url" in checks[0].fix


# -- the clock ------------------------------------------------------------------------------------


def test_the_clock_against_the_real_prefect_server(prefect_api: str) -> None:
    """The Date of the real server's answer: this machine's own clock passes; a clock 60 s
    ahead fails (past one heartbeat, 15 s by default, the sweeper's judgement of run leases
    goes wrong); 6 s off is a warning."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.tasks.doctor import prefect_clock

    with temporary_settings({PREFECT_API_URL: prefect_api}):
        now = prefect_clock()
        ahead = prefect_clock(lambda: time.time() + 60)
        off = prefect_clock(lambda: time.time() - 6)
    assert now.status is Status.OK and now.block == THIS_MACHINE, now
    assert "run leases are 30s (heartbeats every 15s)" in now.detail
    assert ahead.status is Status.FAIL and "ahead of the Prefect server's" in ahead.detail
    assert "NTP" in ahead.fix
    assert off.status is Status.WARN and "behind" in off.detail


def test_the_clock_check_reads_whole_seconds_with_their_margin() -> None:
    """The Date header has whole seconds: a skew within half a second plus half the round
    trip is no finding; a missing header is a warning that says to check by hand."""
    date = "Tue, 01 Dec 2026 12:00:00 GMT"
    at = 1796126400.0  # that second
    assert clock_check(date, at + 0.4, at + 0.6, heartbeat_s=15).status is Status.OK
    assert clock_check(date, at + 20, at + 20.2, heartbeat_s=15).status is Status.FAIL
    assert clock_check(date, at + 20, at + 20.2, heartbeat_s=30).status is Status.WARN
    assert clock_check(None, at, at, heartbeat_s=15).status is Status.WARN


# -- the table and the command --------------------------------------------------------------------


def test_the_table_wraps_long_cells_and_counts_each_outcome() -> None:
    checks = [
        Check("ssh", Status.OK, "fine", block="slurm-cluster/a"),
        Check("slurm accounting", Status.FAIL, "x " * 80, "turn it on " * 10, "slurm-cluster/a"),
        Check("ray versions", Status.WARN, "old", "upgrade", "ray-jobs-cluster/b"),
    ]
    text = table(checks, width=120)
    lines = text.splitlines()
    assert lines[0].split() == ["BLOCK", "CHECK", "STATUS", "DETAIL", "FIX"]
    assert all(len(line) <= 120 for line in lines)
    assert sum("slurm accounting" in line for line in lines) == 1 and len(lines) > 6
    assert lines[-1] == "3 checks: 1 ok, 1 warning(s), 1 failed"


def test_the_command_end_to_end(prefect_api: str, ray_head: Any) -> None:
    """`prefect-nemo doctor NAME ...` on saved blocks: exit 0 with every row passing, the
    table and the clock row printed; exit 1 when a check fails; exit 2 for a block that does
    not exist; no token (the right one or the wrong one) in stdout or stderr."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    good, bad = f"doctor-good-{uuid.uuid4().hex[:6]}", f"doctor-bad-{uuid.uuid4().hex[:6]}"
    wrong = "wrong-token-" + uuid.uuid4().hex
    with temporary_settings({PREFECT_API_URL: prefect_api}):
        ray_head.block().save(good)
        ray_head.block().model_copy(update={"auth_token": SecretStr(wrong)}).save(bad)

    passed = doctor_cli(prefect_api, f"ray-jobs-cluster/{good}")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    lines = passed.stdout.splitlines()
    assert lines[0].split() == ["BLOCK", "CHECK", "STATUS", "DETAIL", "FIX"]
    assert any("clock vs Prefect" in line and " ok " in line for line in lines)
    assert any(f"ray-jobs-cluster/{good}" in ln and "ray dashboard" in ln for ln in lines)
    assert lines[-1].startswith("3 checks: 3 ok")

    both = doctor_cli(prefect_api, f"ray-jobs-cluster/{good}", f"ray-jobs-cluster/{bad}")
    assert both.returncode == 1, both.stdout + both.stderr
    row = next(ln for ln in both.stdout.splitlines() if f"ray-jobs-cluster/{bad}" in ln)
    assert "ray dashboard" in row and "FAIL" in row
    assert "RayJobsCluster.auth_token" in both.stdout

    missing = doctor_cli(prefect_api, "ray-jobs-cluster/no-such-block")
    assert missing.returncode == 2
    assert "'ray-jobs-cluster/no-such-block': no such block document" in missing.stderr
    for done in (passed, both, missing):
        output = done.stdout + done.stderr
        assert ray_head.token not in output and wrong not in output


def test_every_saved_block_of_our_types_is_listed(prefect_api: str, kube_server: Any) -> None:
    """Without names the doctor checks every saved block of prefect-nemo's types, the
    Kubernetes block included (a KubeRay block's nested one is a document of its own)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.blocks import KubernetesCluster
    from prefect_nemo.tasks._blocks import cluster_block_types, saved_block_names
    from prefect_nemo.tasks.doctor import block_checks

    name = f"doctor-kube-{uuid.uuid4().hex[:6]}"
    with temporary_settings({PREFECT_API_URL: prefect_api}):
        KubernetesCluster(kubeconfig=kube_server.kubeconfig()).save(name)
        listed = saved_block_names([*cluster_block_types(), KubernetesCluster])
        rows = block_checks(f"kubernetes-cluster/{name}")
    assert f"kubernetes-cluster/{name}" in listed
    assert rows[0].name == "kubernetes credentials" and rows[0].status is Status.OK
    assert all(r.block == f"kubernetes-cluster/{name}" for r in rows)
    assert kube_server.token not in table(rows)
    assert kube_server.url in rows[0].detail, "the server's address is no secret"


def test_a_nemo_run_block_without_the_extra_says_which_to_install(
    prefect_api: str, tmp_path: Path
) -> None:
    """The core install builds a Slurm block's backend but cannot use it: one row says to
    install the nemo-run extra (the core environment runs this; the extras one has it)."""
    import importlib.util

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.blocks import SlurmCluster
    from prefect_nemo.tasks.doctor import block_checks

    if importlib.util.find_spec("nemo_run") is not None:
        pytest.skip("nemo-run is installed in this environment")
    name = f"doctor-slurm-{uuid.uuid4().hex[:6]}"
    block = SlurmCluster(host="127.0.0.1", port=1, user="me", identity=str(tmp_path / "key"),
                         job_dir="/jobs", account="a")  # fmt: skip
    with temporary_settings({PREFECT_API_URL: prefect_api}):
        block.save(name)
        rows = block_checks(f"slurm-cluster/{name}")
    assert [(r.name, r.status) for r in rows] == [("backend", Status.FAIL)]
    assert rows[0].fix == "pip install 'prefect-nemo[nemo-run]' on this machine"
