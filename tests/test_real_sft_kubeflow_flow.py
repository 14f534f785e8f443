"""The sft_kubeflow flow on the REAL kube-apiserver + kube-controller-manager (the
`control_plane` fixture), with the TrainJob simulator as the kubelet of a node of its own.

The flow tests of tests/test_sft_kubeflow_flow.py named in SFT_REAL run here again, unchanged:
the TrainJob, its code ConfigMaps and its Secret validated and stored by the real API server,
their owner references honoured by the real garbage collector (a timed-out or cancelled
TrainJob takes what it owns with it), the node logs read through `pods/log` from the
simulator's kubelet endpoint, and no secret in any stored object, log, event or artifact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import test_sft_kubeflow_flow as loopback_flow
from tests.conftest import real_kube_server_fixture

pytestmark = [pytest.mark.slow]

SFT_REAL = (
    "test_success_ships_the_code_and_streams_real_logs",
    "test_secret_reaches_no_log_event_artifact_or_object",
    "test_failure_has_the_log_tail",
    "test_rerun_attaches_to_the_same_trainjob",
    "test_timeout_deletes_the_trainjob_and_what_it_owns",
    "test_cancel_through_the_api_stops_the_job",
    "test_two_nodes_reassemble_the_code",
)
for _name in SFT_REAL:
    globals()[_name] = getattr(loopback_flow, _name)
env = loopback_flow.env  # the fixture those tests take


kube_server = real_kube_server_fixture()  # the real control plane


@pytest.fixture(scope="module")
def trainer(kube_server: Any) -> Iterator[Any]:
    """The TrainJob simulator in `default` only (the real Trainer controller's are elsewhere)."""
    from prefect_nemo.testing.operators import TrainJobSimulator

    with TrainJobSimulator(kube_server, namespace="default") as sim:
        yield sim
