"""The simulated Kubernetes cluster of the scale benchmark, in its own process.

A loopback API server, the KubeRay simulator on a FakeRay (jobs run on a clock: no Ray, no
process per job) and one ready RayCluster 'shared'. Kept out of the measured process, so its
RSS and threads are the flow's alone. Driven over stdin/stdout, one JSON line each way:
`{"cmd": "requests", "since": t}` (requests by anyone but the simulator since t),
`{"cmd": "completed"}` (when the simulator last wrote each RayJob's status: for an ended job,
when it ended), `{"cmd": "running"}` (jobs still running on the fake Ray), `{"cmd": "quota"}`
(what the Kueue admitter did), `{"cmd": "quit"}`. With `$SCALE_QUOTA` = `QUEUE:N`, Kueue's
admission by quota is played too (`QuotaAdmitter`: N RayJobs of LocalQueue QUEUE at once).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from prefect_nemo.backends.kuberay import ensure_ray_cluster, wait_ray_cluster_ready
from prefect_nemo.kube import KubeApi
from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir
from prefect_nemo.testing.operators import FakeRay, KubeRaySimulator, QuotaAdmitter

SIM_AGENT = "kuberay-sim"
IMAGE = "rayproject/ray:2.60.0"
CLUSTER_SPEC = {
    "rayVersion": "2.60.0",
    "headGroupSpec": {
        "rayStartParams": {},
        "template": {"spec": {"containers": [{"name": "ray-head", "image": IMAGE}]}},
    },
}


def main() -> None:
    fake = FakeRay(duration_s=5.0)
    with LoopbackKubeServer(crds=[crd_dir()]) as server:
        sim = KubeRaySimulator(server, fake, None)
        sim.api_client.user_agent = SIM_AGENT
        quota = os.environ.get("SCALE_QUOTA")
        with sim, contextlib.ExitStack() as stack:
            kueue = None
            if quota:
                queue, room = quota.split(":")
                kueue = stack.enter_context(QuotaAdmitter(sim.api_client, queue, int(room)))
            api = KubeApi(server.api_client())
            ensure_ray_cluster(api, CLUSTER_SPEC, "shared")
            wait_ray_cluster_ready(api, "shared", timeout_s=60)
            print(json.dumps({"kubeconfig": server.kubeconfig()}), flush=True)
            for line in sys.stdin:
                cmd = json.loads(line)
                if cmd["cmd"] == "quit":
                    break
                if cmd["cmd"] == "requests":
                    since = float(cmd.get("since", 0))
                    entries = [
                        e for e in list(server.requests.entries)
                        if e.agent != SIM_AGENT and e.time >= since
                    ]  # fmt: skip
                    out = {
                        "requests": len(entries),
                        "watches": sum(e.is_watch for e in entries),
                        "by_method": {
                            m: sum(e.method == m for e in entries)
                            for m in {e.method for e in entries}
                        },
                    }
                elif cmd["cmd"] == "completed":  # when the simulator last wrote each status
                    completed: dict[str, float] = {}
                    out = {"completed": completed}
                    for e in list(server.requests.entries):
                        parts = e.path.rstrip("/").split("/")
                        if e.agent == SIM_AGENT and e.method == "PATCH" and parts[-1] == "status":
                            if parts[-3] == "rayjobs":
                                completed[parts[-2]] = e.time
                elif cmd["cmd"] == "quota":
                    out = {"peak": kueue.peak, "admitted": kueue.admitted} if kueue else {}
                elif cmd["cmd"] == "running":
                    out = {"running": len(fake.running()), "jobs": len(fake.list_jobs())}
                else:
                    out = {"error": f"unknown command {cmd}"}
                out["time"] = time.time()
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
