"""The embedded default cluster's start / reuse / stop.

The demo pipeline itself runs end to end from the installed wheel (`prefect-nemo demo`,
test_wheel.py), in the notebook (test_notebook.py) and on every backend
(test_one_flow_any_backend.py)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from prefect_nemo import local_ray
from tests.conftest import wait_until

pytestmark = pytest.mark.slow


def test_default_cluster_reuses_a_running_one(ray_head, monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", ray_head.dashboard_url)
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.token or "")
    monkeypatch.setattr(local_ray, "_default", None)
    block = local_ray.default_cluster()
    assert block.dashboard_url == ray_head.dashboard_url
    local_ray.stop_default()  # a reused cluster is left running
    assert block.backend().find("no-such-job") is None


def test_a_named_ray_that_answers_slowly_is_used_not_replaced(monkeypatch):
    """An address the user named gets time to answer: a busy head's Jobs API answering in 3 s
    is the cluster used. (CI, 4 workers on 2 cores: the session's head answered the 2 s probe
    too late, and default_cluster started a second cluster instead.)"""
    import http.server
    import threading
    import time

    class SlowJobsApi(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(3)
            body = b"[]"
            self.send_response(200 if self.path == "/api/jobs/" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowJobsApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("RAY_API_SERVER_ADDRESS", url)
        found = local_ray.find_local_ray()
        assert found is not None and found.dashboard_url == url
    finally:
        server.shutdown()
        server.server_close()


def test_started_cluster_is_stopped_by_process_group(prefect_api, ray_head, ray_client):
    """Also: a head started later leaves the jobs of an earlier one alone. Ray's job supervisor
    gives a driver RAY_ADDRESS resolved from "auto" in its head's temp dir
    (job_supervisor.py `_get_driver_env_vars`: `canonicalize_bootstrap_address_or_die("auto",
    temp_dir)`), where ray_current_cluster names the head that started last: in a shared temp
    dir, a driver's ray.init() reached the newest head on the machine (token refused)."""
    cluster = local_ray.start_local_ray(num_cpus=1)
    pgid = os.getpgid(cluster.process.pid)
    try:
        assert cluster.block().backend().find("nothing") is None  # serving, token accepted
        driver = "import ray; ray.init(); print('gcs', ray.get_runtime_context().gcs_address)"
        job = ray_client.submit_job(entrypoint=f'python -c "{driver}"')
        wait_until(lambda: ray_client.get_job_status(job).is_terminal(), 120)
        logs = ray_client.get_job_logs(job)
        assert ray_client.get_job_status(job).value == "SUCCEEDED", logs
        port = ray_head.gcs_address.rsplit(":", 1)[1]
        assert re.search(rf"^gcs \S+:{port}$", logs, re.MULTILINE), logs  # its own head's GCS
        # the lean head (local_ray.LEAN_NODE_ENV): a shell job leaves no idle worker behind,
        # where Ray's default prestarts one per CPU for the first driver and keeps it
        own = cluster.block().backend().client
        shell_job = own.submit_job(entrypoint="true")
        wait_until(lambda: own.get_job_status(shell_job).is_terminal(), 120)
        assert not [p for p in local_ray.session_members(cluster.process.pid)
                    if "ray::IDLE" in _command_line(p)], "an idle Ray worker was prestarted"
    finally:
        cluster.stop()  # a failed check must not leave the head running
    assert _live_processes_in_group(pgid) == [], "a process of the stopped head survived"
    # ps -g selects by session: Ray workers (own process groups, same session) count too.


def _command_line(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def _live_processes_in_group(pgid: int) -> list[str]:
    """Processes of the session that are not zombies (a container's PID 1 may not reap them)."""
    ps = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(pgid)], capture_output=True,
                        text=True)
    return [line for line in ps.stdout.splitlines() if line.strip() and line.split()[0][0] != "Z"]



def test_a_head_whose_ray_start_gave_up_is_started_again(tmp_path, monkeypatch):
    """Ray's `node.py`: "The current node timed out during startup. This could happen because
    some of the raylet failed to startup or the GCS has become overloaded." (its raylet gets a
    fixed 30 s): the dashboard may have answered meanwhile, so only `ray start`'s own "Ray
    runtime started." counts as up, and a start that gave up is tried again."""
    log_path = tmp_path / "ray.log"
    log_path.write_text("Exception: The current node timed out during startup. This ...\n")
    gave_up = subprocess.Popen(["true"])
    gave_up.wait()
    cluster = local_ray.LocalRayCluster(
        dashboard_url="http://127.0.0.1:9", process=gave_up, log_path=log_path
    )
    with pytest.raises(local_ray._StartTimedOut):
        local_ray._wait_until_serving(cluster, timeout_s=10)

    tries: list[int] = []

    def start_head(*args):
        tries.append(1)
        if len(tries) == 1:
            raise local_ray._StartTimedOut("ray start timed out during startup")
        return cluster

    monkeypatch.setattr(local_ray, "_start_head", start_head)
    assert local_ray.start_local_ray() is cluster and len(tries) == 2


def test_what_ray_keeps_on_disk_is_private_to_its_user(ray_head, ray_client):
    """Ray logs what each job was given, secret env values included (the runtime env agent
    writes the job's runtime_env to runtime_env_agent.log), and makes its temp dir and the
    folders below it world-accessible (0777; its logs 0644). A head we start keeps Ray's temp dir
    inside a folder only its user may enter (0700): another user (here `nobody`) reads nothing,
    not even after the head stopped."""
    import pwd
    import uuid

    secret = f"s3cret-{uuid.uuid4().hex}"
    job = ray_client.submit_job(entrypoint="true", runtime_env={"env_vars": {"KEY": secret}})
    wait_until(lambda: ray_client.get_job_status(job).is_terminal(), 120)
    temp_dir = ray_head.temp_dir
    assert temp_dir is not None and temp_dir.is_dir()
    found = subprocess.run(["grep", "-rl", secret, str(temp_dir)], capture_output=True,
                           text=True).stdout.split()  # fmt: skip
    assert found, "Ray no longer logs a job's env: this test should then look elsewhere"
    private = temp_dir.parent
    assert private.stat().st_mode & 0o777 == 0o700 and private.stat().st_uid == os.getuid()
    nobody = pwd.getpwnam("nobody")

    def as_nobody() -> None:
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    for path in found:
        read = subprocess.run(["cat", path], capture_output=True, text=True,
                              preexec_fn=as_nobody)  # fmt: skip
        assert read.returncode != 0 and secret not in read.stdout, f"{path} is readable"
        assert "Permission denied" in read.stderr
