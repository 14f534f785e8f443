"""RayJobs and RayClusters of our KubeRay simulator on the REAL kube-apiserver +
kube-controller-manager (the `control_plane` fixture, built from Go modules).

The loopback tests of tests/test_kuberay.py named in KUBERAY_REAL run here again, unchanged,
over the real API server: the real CRD validation and defaulting of RayJob and RayCluster, real
Pods bound to the simulator's own Node (it is their kubelet: `_node.SimNode`), the RayJob's
owner references and the real garbage collector taking a finished job's cluster, its pods and
its Secret, the Ray dashboard reached through the real service proxy and the real EndpointSlice
controller (the head pod answers on its pod address and forwards to the session's real Ray),
and pod logs through `pods/log` from the simulator's kubelet endpoint. The real KubeRay operator
has its own module (tests/test_real_kuberay.py: one Ray pod at a time, ~35 s a test); this one
keeps every behaviour test of the simulator honest against the real API server at the cost of
the loopback runs. The others stay loopback-only: they drive loopback controls (the request
log, forbid, drop_watches) or start a loopback server of their own.
"""

from __future__ import annotations

import pytest

from tests import test_kuberay as loopback_kuberay
from tests.conftest import kuberay_in_default_fixture, real_kube_server_fixture

pytestmark = [pytest.mark.slow]

# tests/test_kuberay.py tests that mean the same on a real API server (they take the fixtures
# below: `kube_server`, `kuberay`, `kube_block` are the real control plane's here)
KUBERAY_REAL = (
    "test_run_job_inline_cluster_success",
    "test_run_job_failure_has_log_tail",
    "test_validation_failed_is_surfaced",
    "test_rerun_attaches_to_the_same_rayjob",
    "test_timeout_stops_the_ray_job_and_leaves_no_cluster",
    "test_cancelling_the_run_stops_the_job_and_its_cluster",
    "test_stop_before_submission_deletes_the_rayjob",
    "test_ray_cluster_lifecycle",
    "test_ensure_never_attaches_to_a_raycluster_being_deleted",
    "test_stop_of_a_job_pending_in_ray_escalates_to_delete",
    "test_existing_cluster_with_working_dir",
    "test_inline_cluster_gets_local_code_and_a_secret_together",
    "test_ray_jobs_block_through_the_proxy",
)
for _name in KUBERAY_REAL:
    globals()[_name] = getattr(loopback_kuberay, _name)
run_logs = loopback_kuberay.run_logs  # fixtures those tests take
shared_cluster = loopback_kuberay.shared_cluster


kube_server = real_kube_server_fixture()  # the real control plane


kuberay = kuberay_in_default_fixture()
