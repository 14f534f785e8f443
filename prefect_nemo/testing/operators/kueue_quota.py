"""Kueue's admission by quota, played for the loopback API server (where no Kueue runs).

By Kueue's documented rules ("Run A RayJob": a RayJob with a `kueue.x-k8s.io/queue-name`
label is created suspended, and Kueue "controls the spec.suspend field", unsuspending it once
admitted; a StrictFIFO ClusterQueue admits in creation order), `QuotaAdmitter` unsuspends the
oldest held RayJobs of one LocalQueue while fewer than `quota` are admitted and not ended. It
writes nothing else (no Workloads): a held RayJob reads QUEUED by its label. The real Kueue runs
on the real control plane (tests/test_real_kueue.py); this one lets runs of many jobs on a
quota (tests/test_run_jobs_quota.py, `bench.scale quota`) cost no Go process.
"""

from __future__ import annotations

import heapq
from typing import Any

from kubernetes import client

from prefect_nemo.backends._kueue import QUEUE_LABEL
from prefect_nemo.testing.operators._controller import Controller, Key, Obj
from prefect_nemo.testing.operators.kuberay import GROUP, RAYJOBS, VERSION

_ENDED = ("Complete", "Failed")


class QuotaAdmitter(Controller):
    """Admits the held RayJobs of LocalQueue `queue` in `namespace`, at most `quota` at once,
    on each change its watch sees (as Kueue does: a list per pass made the loopback server copy
    every RayJob, quadratic at 1,000); its requests go through `api_client` (give it a user
    agent of its own to tell them from the flow's). `peak`: the most admitted at once;
    `admitted`: how many it admitted. A context manager: its threads run inside the `with`."""

    def __init__(
        self, api_client: Any, queue: str, quota: int, *, namespace: str = "default"
    ) -> None:
        super().__init__(api_client, namespace=namespace, name="kueue-quota")
        self.api = client.CustomObjectsApi(api_client)
        self.queue, self.quota = queue, quota
        self.peak = 0
        self.admitted = 0
        self._key: Key = ("localqueues", namespace, queue)
        self._unsuspended: set[str] = set()  # admitted by us; the cache has not seen it yet
        self.watch(RAYJOBS, label_selector=f"{QUEUE_LABEL}={queue}", map_to=lambda _: [self._key])

    def __enter__(self) -> QuotaAdmitter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reconcile(self, key: Key) -> float | None:
        """Unsuspend the oldest held RayJobs that fit, from the watch's cache (one pass: it
        runs on every change of any of them; only the controller's one worker calls it)."""
        _, namespace, _ = key
        live, waiting, suspended = 0, list[Obj](), set[str]()
        for obj in self.cached_all("rayjobs"):
            name = obj["metadata"]["name"]
            phase = (obj.get("status") or {}).get("jobDeploymentStatus")
            if obj["spec"].get("suspend"):
                suspended.add(name)
                if name not in self._unsuspended:
                    if phase == "Suspended":
                        waiting.append(obj)
                    continue
            if phase not in _ENDED:
                live += 1
        self._unsuspended &= suspended  # the cache saw the rest unsuspended
        room = max(0, self.quota - live)
        admit = heapq.nsmallest(
            room, waiting,
            key=lambda o: (o["metadata"]["creationTimestamp"], o["metadata"]["name"]),
        )  # fmt: skip
        self._unsuspended.update(o["metadata"]["name"] for o in admit)
        self.admitted += len(admit)
        self.peak = max(self.peak, live + len(admit))
        for obj in admit:
            self.api.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "rayjobs", obj["metadata"]["name"],
                {"spec": {"suspend": False}},
            )  # fmt: skip
        return None
