"""The NeMo-Run blocks hand their backends every setting: each config field is a block field of
the same name (`config_from` matches them by name), secrets revealed, containers copied."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import SecretStr

from prefect_nemo.backends.nemo_run.dgx_cloud import DGXCloudConfig
from prefect_nemo.backends.nemo_run.lepton import LeptonConfig
from prefect_nemo.backends.nemo_run.slurm import SlurmConfig
from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster
from prefect_nemo.blocks.lepton import LeptonWorkspace
from prefect_nemo.blocks.slurm import SlurmCluster

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n"

BLOCKS: list[tuple[Callable[[], ClusterBlock], type]] = [
    (
        lambda: SlurmCluster(
            host="login",
            user="me",
            account="acct",
            job_dir="/lustre/jobs",
            identity_key=SecretStr(KEY),
            container_mounts=["/data:/data"],
            additional_parameters={"gres": "gpu:8"},
            env={"A": "1"},
        ),
        SlurmConfig,
    ),
    (
        lambda: LeptonWorkspace(
            workspace_id="ws",
            token=SecretStr("lepton-token"),
            node_group="nodes",
            mounts=[{"path": "/", "mount_path": "/shared", "from": "node-nfs:shared"}],
            secret_vars={"WANDB": "wandb-key"},
        ),
        LeptonConfig,
    ),
    (
        lambda: DGXCloudCluster(
            base_url="https://tenant.run.ai/api/v1",
            client_id="app",
            client_secret=SecretStr("runai-secret"),
            project_name="proj",
            pvc_nemo_run_dir="/pvc/nemo-run",
            pvcs=[{"path": "/pvc", "claimName": "pvc"}],
            custom_spec={"nodePools": ["a"]},
        ),
        DGXCloudConfig,
    ),
]
IDS = [config_type.__name__ for _, config_type in BLOCKS]


def revealed(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


@pytest.mark.parametrize(("make", "config_type"), BLOCKS, ids=IDS)
def test_every_config_field_comes_from_the_block(
    make: Callable[[], ClusterBlock], config_type: type
) -> None:
    """No config field silently keeps its default: the block has each one (but the name the
    errors give the block), and the backend's config holds the block's value, revealed."""
    block = make()
    names = {f.name for f in dataclasses.fields(config_type)} - {"field_prefix"}
    assert names <= set(type(block).model_fields), names - set(type(block).model_fields)
    config = block.backend().config
    for name in names:
        assert getattr(config, name) == revealed(getattr(block, name)), name


@pytest.mark.parametrize(("make", "config_type"), BLOCKS, ids=IDS)
def test_the_config_is_a_copy(make: Callable[[], ClusterBlock], config_type: type) -> None:
    """Changing the block's lists and dicts afterwards does not reach a backend built before."""
    block = make()
    config = block.backend().config
    names = [f.name for f in dataclasses.fields(config_type)]
    mutable = [n for n in names if isinstance(getattr(block, n, None), list | dict)]
    assert mutable
    for name in mutable:
        value = getattr(block, name)
        before = repr(getattr(config, name))
        if isinstance(value, list):
            value.append("changed")
        else:
            value["changed"] = "yes"
        assert repr(getattr(config, name)) == before, name
