"""`prefect-nemo doctor` for the NeMo-Run blocks: the real local Slurm (slurmctld, slurmd,
slurmdbd with accounting, over a real sshd), and the loopback run:ai and Lepton servers that
NeMo-Run's and leptonai's clients talk to unchanged: reachable, misconfigured, and stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster
from prefect_nemo.blocks.lepton import LeptonRayCluster, LeptonWorkspace
from prefect_nemo.doctor import Check, Status, check_backend, failed, table
from prefect_nemo.testing.lepton import LeptonServer
from prefect_nemo.testing.runai import RunaiServer

pytestmark = pytest.mark.nemo_run

SECRET = "dgx-" + "d0c70r-5ecret-41aa"
TOKEN = "lep-" + "d0c70r-t0ken-77e1"


def rows_of(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# -- Slurm ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_slurm_passes_every_row(slurm: Any, tmp_path: Path) -> None:
    """SSH with the block's key, the four commands on the PATH, slurmctld answering squeue,
    accounting on (sacct answers from slurmdbd), the account and partition, a writable job
    dir: every row passes. The key text (a secret field) is in no row."""
    from tests.test_nemo_run_slurm import slurm_block

    block = slurm_block(slurm, tmp_path / "jobs")
    checks = check_backend("slurm-cluster/t", block.backend())
    rows = rows_of(checks)
    assert list(rows) == [
        "ssh", "slurm commands", "slurm controller", "slurm accounting", "slurm account",
        "slurm partition", "job dir",
    ]  # fmt: skip
    assert [c.status for c in checks] == [Status.OK] * len(checks), table(checks)
    assert rows["ssh"].detail == f"{slurm.user}@{slurm.host}:{slurm.port}: logged in as root"
    assert "accounting_storage/slurmdbd" in rows["slurm accounting"].detail
    assert rows["slurm commands"].detail.startswith("slurm")  # Debian's says slurm-wlm 22.05.8
    assert (tmp_path / "jobs").is_dir()
    key = block.identity_key.get_secret_value()  # type: ignore[union-attr]
    assert not any(line in table(checks) for line in key.splitlines()[1:-1])


@pytest.mark.slow
def test_a_wrong_account_and_partition_fail_naming_the_fields(slurm: Any, tmp_path: Path) -> None:
    """An account the user has no association with and a partition Slurm does not have: each
    row fails naming the block field and what Slurm offers."""
    from tests.test_nemo_run_slurm import slurm_block

    block = slurm_block(slurm, tmp_path / "jobs").model_copy(
        update={"account": "no-such-account", "partition": "no-such-partition"}
    )
    rows = rows_of(check_backend("slurm-cluster/t", block.backend()))
    account, partition = rows["slurm account"], rows["slurm partition"]
    assert account.status is Status.FAIL and "SlurmCluster.account" in account.fix
    assert "no association with account 'no-such-account'" in account.detail
    assert partition.status is Status.FAIL
    assert partition.fix.startswith(
        f"SlurmCluster.partition: one of {slurm.partition}, {slurm.multi_partition}"
    )
    assert rows["slurm accounting"].status is Status.OK


def test_an_ssh_port_nobody_answers_fails_the_first_row(tmp_path: Path) -> None:
    """No sshd at the address: one failed row naming host and port, nothing else tried."""
    from prefect_nemo.blocks.slurm import SlurmCluster
    from prefect_nemo.local_ray import free_port

    key = tmp_path / "id"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----\n")
    block = SlurmCluster(host="127.0.0.1", port=free_port(), user="me", identity=str(key),
                         job_dir="/jobs", account="a", connect_timeout_s=5)  # fmt: skip
    checks = check_backend("slurm-cluster/t", block.backend())
    assert [(c.name, c.status) for c in checks] == [("ssh", Status.FAIL)], table(checks)


# -- run:ai ---------------------------------------------------------------------------------------


def runai_block(server: RunaiServer, tmp_path: Path, **fields: Any) -> DGXCloudCluster:
    return DGXCloudCluster(
        base_url=server.base_url, client_id=server.client_id, client_secret=server.client_secret,
        project_name="nemo-project", pvc_nemo_run_dir=f"{tmp_path}/nemo-run",
        pvcs=[{"path": str(tmp_path), "claimName": "nemo-pvc", "existingPvc": True}], **fields,
    )  # fmt: skip


def test_runai_reachable_then_misconfigured_then_stopped(tmp_path: Path) -> None:
    """The loopback run:ai: a token and the project pass; an unknown project fails naming the
    field; a wrong secret fails the credentials row; a stopped server fails it with the
    address to check. The client secret is in no row."""
    with RunaiServer(client_secret=SECRET) as server:
        block = runai_block(server, tmp_path)
        checks = check_backend("dgx-cloud-cluster/t", block.backend())
        rows = rows_of(checks)
        assert [c.status for c in checks] == [Status.OK, Status.OK], table(checks)
        assert rows["run:ai project"].detail.startswith("'nemo-project' (id 4501, cluster ")
        other = block.model_copy(update={"project_name": "elsewhere"})
        project = rows_of(check_backend("dgx-cloud-cluster/t", other.backend()))["run:ai project"]
        assert project.status is Status.FAIL and "DGXCloudCluster.project_name" in project.fix
        wrong = block.model_copy(update={"client_secret": "not-" + SECRET})
        creds = check_backend("dgx-cloud-cluster/t", wrong.backend())
        assert [(c.name, c.status) for c in creds] == [("run:ai credentials", Status.FAIL)]
        assert "client_secret" in creds[0].fix
    stopped = check_backend("dgx-cloud-cluster/t", block.backend())
    assert [(c.name, c.status) for c in stopped] == [("run:ai credentials", Status.FAIL)]
    assert "unreachable" in stopped[0].detail and "DGXCloudCluster.base_url" in stopped[0].fix
    for rows_checked in (checks, creds, stopped):
        assert SECRET not in table(rows_checked)


# -- Lepton ---------------------------------------------------------------------------------------


def lepton_block(server: LeptonServer, **fields: Any) -> LeptonWorkspace:
    return LeptonWorkspace(
        workspace_id=server.workspace_id, workspace_url=server.api_url, token=server.token,
        node_group="nemo-nodes", nemo_run_dir="/shared/nemo-run",
        mounts=[{"path": "/", "mount_path": "/shared", "from": "node-nfs:shared"}], **fields,
    )  # fmt: skip


def test_lepton_reachable_then_misconfigured_then_stopped() -> None:
    """The loopback Lepton workspace: the token and the node group pass (for a Lepton Ray
    cluster block too); an unknown node group fails naming the field; a stopped workspace
    fails the first row with the URL to check. The token is in no row."""
    with LeptonServer(token=TOKEN) as server:
        block = lepton_block(server)
        checks = check_backend("lepton-workspace/t", block.backend())
        assert [(c.name, c.status) for c in checks] == [
            ("lepton workspace", Status.OK), ("lepton node group", Status.OK)
        ]  # fmt: skip
        ray = LeptonRayCluster(workspace=block, ray_cluster_name="rl")
        assert not failed(check_backend("lepton-ray-cluster/t", ray.backend()))
        other = block.model_copy(update={"node_group": "elsewhere"})
        group = rows_of(check_backend("lepton-workspace/t", other.backend()))
        assert group["lepton workspace"].status is Status.OK
        assert group["lepton node group"].status is Status.FAIL
        assert "LeptonWorkspace.node_group" in group["lepton node group"].fix
    stopped = check_backend("lepton-workspace/t", block.backend())
    assert [(c.name, c.status) for c in stopped] == [("lepton workspace", Status.FAIL)]
    assert "LeptonWorkspace.workspace_url" in stopped[0].fix
    for rows_checked in (checks, stopped):
        assert TOKEN not in table(rows_checked)
