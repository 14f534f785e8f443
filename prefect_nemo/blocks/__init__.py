"""Blocks: where jobs run and with which credentials, one module per engine."""

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.kubeflow import KubeflowTrainerCluster
from prefect_nemo.blocks.kuberay import KubeRayCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.blocks.ray_jobs import RayJobsCluster

__all__ = [
    "ClusterBlock",
    "KubeRayCluster",
    "KubeflowTrainerCluster",
    "KubernetesCluster",
    "RayJobsCluster",
]
