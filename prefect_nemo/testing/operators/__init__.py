"""Operator simulators for the loopback Kubernetes API server (Dynamo and TrainJob ones also for
a real API server, where they act as the kubelet of a Node of their own: `_node.SimNode`).

They act like the real controllers, through the same HTTP API: `KubeRaySimulator` (ray.io/v1
RayCluster and RayJob, running jobs on a real local Ray), `DynamoSimulator` (nvidia.com
DynamoGraphDeployment, with a fake frontend behind the service proxy) and `TrainJobSimulator`
(trainer.kubeflow.org TrainJob + JobSet pods, running the trainer command locally); and
`QuotaAdmitter`, Kueue's admission by quota of one LocalQueue's RayJobs.
"""

from prefect_nemo.testing.operators.dynamo import DgdBehavior, DynamoSimulator
from prefect_nemo.testing.operators.fake_ray import FakeRay
from prefect_nemo.testing.operators.kuberay import KubeRaySimulator, validate_rayjob
from prefect_nemo.testing.operators.kueue_quota import QuotaAdmitter
from prefect_nemo.testing.operators.trainer import TrainJobSimulator

__all__ = [
    "DgdBehavior",
    "DynamoSimulator",
    "FakeRay",
    "KubeRaySimulator",
    "QuotaAdmitter",
    "TrainJobSimulator",
    "validate_rayjob",
]
