"""`python -m prefect_nemo.testing.control_plane build | up | down | status`."""

from __future__ import annotations

import os
import sys
import time

from prefect_nemo.testing.control_plane import ControlPlane, build
from prefect_nemo.testing.control_plane.run import state_file


def main(argv: list[str]) -> int:
    """build: the binaries (once); up: build, start and leave running; down: stop it by pid."""
    command = argv[0] if argv else "build"
    if command == "build":
        if build.missing() and build.go_binary() is None:
            reason = build.unavailable_reason()
            in_ci = os.environ.get("CI", "").lower() == "true"
            print(f"{'FAILED' if in_ci else 'skipped'}: {reason}", file=sys.stderr)
            return 1 if in_ci else 0
        build.build()
        build.build_trainer()  # the real Kubeflow Trainer controller (test_real_dynamo_trainer)
        build.build_jobset()  # ... and the JobSet controller that runs the Trainer's JobSets
        build.build_kueue()  # Kueue: queues and quotas for RayJobs and TrainJobs
        print(f"control-plane binaries: {build.cache_dir()}")
        return 0
    if command == "up":
        if plane := ControlPlane.attach():
            print(f"control plane already running at {plane.url} ({state_file()})")
            return 0
        build.build()
        t0 = time.monotonic()
        plane = ControlPlane().start()
        plane.save_state()
        print(f"control plane up at {plane.url} in {time.monotonic() - t0:.1f}s; "
              f"kubeconfig {plane.workdir / 'admin.kubeconfig'}; pids {plane.pids}")  # fmt: skip
        for why in (
            plane.agent_unavailable,
            plane.controllers_unavailable,
            plane.kueue_unavailable,
        ):
            if why:
                print(f"not started: {why}")
        return 0
    if command == "down":
        if plane := ControlPlane.attach(own=True):
            plane.stop()
            print("control plane stopped")
        else:
            print("no control plane running")
        return 0
    if command == "status":
        plane = ControlPlane.attach()
        print(f"running at {plane.url}, pids {plane.pids}" if plane else "not running")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
