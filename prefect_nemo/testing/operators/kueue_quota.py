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

import threading
from typing import Any

from prefect_nemo.backends._kueue import QUEUE_LABEL

_ENDED = ("Complete", "Failed")


class QuotaAdmitter:
    """Admits the held RayJobs of LocalQueue `queue` in `namespace`, at most `quota` at once,
    checking every `interval_s`; its requests go through `api_client` (give it a user agent of
    its own to tell them from the flow's). `peak`: the most admitted at once; `admitted`: how
    many it admitted. A context manager: its thread runs inside the `with`."""

    def __init__(
        self, api_client: Any, queue: str, quota: int, *, namespace: str = "default",
        interval_s: float = 0.2,
    ) -> None:  # fmt: skip
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.queue, self.quota, self.namespace = queue, quota, namespace
        self.interval_s = interval_s
        self.peak = 0
        self.admitted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kueue-quota", daemon=True)

    def __enter__(self) -> QuotaAdmitter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.admit_once()

    def admit_once(self) -> None:
        """One pass: read the queue's RayJobs and unsuspend the oldest held ones that fit."""
        items = self.api.list_namespaced_custom_object(
            "ray.io", "v1", self.namespace, "rayjobs",
            label_selector=f"{QUEUE_LABEL}={self.queue}",
        )["items"]  # fmt: skip

        def phase(o: dict[str, Any]) -> Any:
            return (o.get("status") or {}).get("jobDeploymentStatus")

        live = [o for o in items if not o["spec"].get("suspend") and phase(o) not in _ENDED]
        held = sorted(
            (o for o in items if o["spec"].get("suspend") and phase(o) == "Suspended"),
            key=lambda o: (o["metadata"]["creationTimestamp"], o["metadata"]["name"]),
        )
        admit = held[: max(0, self.quota - len(live))]
        for obj in admit:
            self.api.patch_namespaced_custom_object(
                "ray.io", "v1", self.namespace, "rayjobs", obj["metadata"]["name"],
                {"spec": {"suspend": False}},
            )  # fmt: skip
        self.admitted += len(admit)
        self.peak = max(self.peak, len(live) + len(admit))
