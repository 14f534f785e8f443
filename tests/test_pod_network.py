"""The real control plane's pod addresses (`PodNetwork`): real addresses on `lo`, as the node
agent uses them. In CI's run 49 the /24 ran out after 249 pods, most of them long gone: a released
address never went back to the pool, so from then on no new pod could start and the agent's tick
failed before it watched the running ones."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_nemo.testing.control_plane import pod_network
from prefect_nemo.testing.control_plane.pod_network import PodNetwork, PoolExhausted
from tests.conftest import IN_CI

if (reason := pod_network.unavailable_reason()) is not None:
    pytestmark = pytest.mark.skipif(not IN_CI, reason=reason)


@pytest.fixture
def network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PodNetwork]:
    monkeypatch.setattr(pod_network, "HOSTS", tmp_path / "hosts")
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    with PodNetwork() as network:
        yield network


def on_lo() -> set[str]:
    return set(os.popen("ip -o -4 addr show dev lo").read().split())


def test_released_addresses_serve_more_pods_than_the_subnet_holds(network: PodNetwork) -> None:
    size = len(list(network.subnet.hosts())) - 1  # .1 is left out
    first = [network.allocate() for _ in range(size)]
    assert len(set(first)) == size
    with pytest.raises(PoolExhausted, match=str(network.subnet)):
        network.allocate()
    for ip in first:
        network.release(ip)
    again = [network.allocate() for _ in range(size)]  # a whole second session's worth
    assert sorted(again, key=ipaddress.IPv4Address) == sorted(first, key=ipaddress.IPv4Address)
    assert f"{again[0]}/32" in on_lo()


def test_a_released_address_is_the_last_handed_out_again(network: PodNetwork) -> None:
    a, b = network.allocate(), network.allocate()
    network.release(a)
    assert f"{a}/32" not in on_lo()
    size = len(list(network.subnet.hosts())) - 1
    rest = [network.allocate() for _ in range(size - 2)]
    assert a not in rest and b not in rest
    assert network.allocate() == a
