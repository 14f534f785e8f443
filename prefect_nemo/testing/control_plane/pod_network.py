"""Pod addresses and Service names on one machine, for the real control plane's pods.

A real cluster gives each pod its own IP and resolves `<svc>.<ns>.svc.cluster.local` through its
DNS. Here each pod gets an address of its own on the loopback interface, from a /24 of
10.244.0.0/16 chosen per network (not 127.0.0.0/8: kube-apiserver's service proxy refuses to
dial loopback addresses), and names resolve through /etc/hosts entries in a block this network
owns. `close()` removes both. Needs root (`ip addr add ... dev lo`, writing /etc/hosts).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

HOSTS = Path(os.environ.get("PREFECT_NEMO_HOSTS_FILE", "/etc/hosts"))
POD_CIDR = ipaddress.ip_network("10.244.0.0/16")
CLUSTER_DOMAIN = "cluster.local"


def unavailable_reason() -> str | None:
    """Why pod addresses cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "the pod network needs root (addresses on `lo`, entries in /etc/hosts)"
    if not shutil.which("ip"):
        return "the pod network needs `ip` (Debian package iproute2; `make system` installs it)"
    return None


def service_names(name: str, namespace: str) -> list[str]:
    """The names a pod may use for a Service (the cluster DNS's search path forms)."""
    return [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc",
            f"{name}.{namespace}"]  # fmt: skip


class PoolExhausted(RuntimeError):
    """Every address of the network's /24 is held by a pod."""


class PodNetwork:
    """One /24 of pod addresses on `lo` and one block of /etc/hosts entries; `close()` removes
    what it added (also what a killed predecessor with the same subnet left)."""

    def __init__(self) -> None:
        if reason := unavailable_reason():
            raise RuntimeError(reason)
        self.subnet = self._free_subnet()
        self._marker = f"prefect-nemo pod network {self.subnet}"
        # .1 left out: a gateway in a real cluster
        self._free: list[ipaddress.IPv4Address] = list(self.subnet.hosts())[1:]
        self._used: set[str] = set()
        self._lock = threading.Lock()

    def allocate(self) -> str:
        """A pod address, up on `lo`: the one free longest (a released address goes to the back
        of the pool, so a new pod is not at once reachable under its predecessor's address).
        Raises PoolExhausted when every address is in use."""
        with self._lock:
            if not self._free:
                raise PoolExhausted(f"every pod address of {self.subnet} is in use")
            ip = str(self._free.pop(0))
            self._used.add(ip)
        _ip("addr", "add", f"{ip}/32", "dev", "lo")
        return ip

    def release(self, ip: str) -> None:
        """Take a pod address off `lo` (its pod ended) and back into the pool."""
        with self._lock:
            if ip not in self._used:
                return
            self._used.discard(ip)
        _ip("addr", "del", f"{ip}/32", "dev", "lo", check=False)
        with self._lock:
            self._free.append(ipaddress.IPv4Address(ip))

    def set_hosts(self, names: Mapping[str, str]) -> None:
        """Make /etc/hosts resolve exactly `names` (name -> address) for this network."""
        lines = [f"{ip} {name}" for name, ip in sorted(names.items())]
        with _locked_hosts() as text:
            kept = _without_block(text[0], self._marker)
            block = [f"# begin {self._marker}", *lines, f"# end {self._marker}"] if lines else []
            text[0] = kept + ("\n".join(block) + "\n" if block else "")

    def close(self) -> None:
        """Remove this network's addresses and /etc/hosts entries."""
        self.set_hosts({})
        for ip in list(self._used):
            self.release(ip)

    def __enter__(self) -> PodNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        taken = {ipaddress.ip_interface(m).network.supernet(new_prefix=24) for m in re.findall(
            r"inet (10\.244\.\S+)", _ip("-o", "-4", "addr", "show", "dev", "lo"))}  # fmt: skip
        subnets = list(POD_CIDR.subnets(new_prefix=24))
        return random.choice([s for s in subnets if s not in taken])


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _without_block(text: str, marker: str) -> str:
    pattern = rf"# begin {re.escape(marker)}\n.*?# end {re.escape(marker)}\n"
    return re.sub(pattern, "", text, flags=re.S)


@contextlib.contextmanager
def _locked_hosts() -> Iterator[list[str]]:
    """/etc/hosts under an exclusive lock, rewritten in place (it may be a bind mount, which a
    rename would not replace); yields [text] to change."""
    with open(HOSTS, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = [f.read()]
        before = text[0]
        yield text
        if text[0] != before:
            f.seek(0)
            f.write(text[0])
            f.truncate()
