"""The rl_with_dynamo flow on the REAL kube-apiserver + kube-controller-manager (the
`control_plane` fixture), with the KubeRay and Dynamo simulators as the kubelets of nodes of
their own and the training job on the session's real Ray.

The flow tests of tests/test_rl_dynamo_flow.py named in RL_REAL run here again, unchanged: the
DGDs the flow applies validated by the real API server, their owner reference to the training
RayCluster honoured by the real garbage collector (the cascade that deletes them with the
cluster, and the same-namespace rule that motivated these tests), cancel and failure teardown,
and re-runs attaching. The others stay on the loopback server: they read its request log
(`ours_changed`: nothing written by a dry run, bad input, a rollback), use `forbid`, or need a
second namespace (the simulator here reconciles `default` only; the same-namespace rule of
owners is checked on the real server by tests/test_real_dynamo_trainer.py and
tests/test_real_control_plane.py).
"""

from __future__ import annotations

import pytest

from tests import test_rl_dynamo_flow as loopback_flow
from tests.conftest import kuberay_in_default_fixture, real_kube_server_fixture

pytestmark = [pytest.mark.slow]

RL_REAL = (
    "test_success_end_to_end_with_owner_cascade",
    "test_rerun_attaches_instead_of_duplicating",
    "test_failed_training_deletes_what_the_run_created",
    "test_a_dgd_we_only_attached_to_is_left_alone",
    "test_cancel_during_training_deletes_dgds_and_stops_the_job",
    "test_cancel_while_waiting_for_the_dgd",
)
for _name in RL_REAL:
    globals()[_name] = getattr(loopback_flow, _name)
env = loopback_flow.env  # the fixture those tests take


kube_server = real_kube_server_fixture()  # the real control plane


kuberay = kuberay_in_default_fixture()
