"""Blocks: where jobs run and with which credentials, one module per engine.

The NeMo-Run blocks (Slurm, Lepton, DGX Cloud) import without the nemo-run extra; building their
backend needs it (`pip install 'prefect-nemo[nemo-run]'`).
"""

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster, DGXCloudRayCluster
from prefect_nemo.blocks.kubeflow import KubeflowTrainerCluster
from prefect_nemo.blocks.kuberay import KubeRayCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.blocks.lepton import LeptonRayCluster, LeptonWorkspace
from prefect_nemo.blocks.ray_jobs import RayJobsCluster
from prefect_nemo.blocks.slurm import SlurmCluster

__all__ = [
    "ClusterBlock",
    "DGXCloudCluster",
    "DGXCloudRayCluster",
    "KubeRayCluster",
    "KubeflowTrainerCluster",
    "KubernetesCluster",
    "LeptonRayCluster",
    "LeptonWorkspace",
    "RayJobsCluster",
    "SlurmCluster",
]
