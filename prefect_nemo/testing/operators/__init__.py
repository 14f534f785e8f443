"""Operator simulators for the loopback Kubernetes API server.

They act like the real controllers, through the same HTTP API: `KubeRaySimulator` (ray.io/v1
RayCluster and RayJob, running jobs on a real local Ray) and `DynamoSimulator` (nvidia.com
DynamoGraphDeployment, with a fake frontend behind the service proxy).
"""

from prefect_nemo.testing.operators.dynamo import DgdBehavior, DynamoSimulator
from prefect_nemo.testing.operators.kuberay import KubeRaySimulator, validate_rayjob

__all__ = ["DgdBehavior", "DynamoSimulator", "KubeRaySimulator", "validate_rayjob"]
