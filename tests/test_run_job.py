"""run_job and friends against a real Prefect API and a real local Ray cluster."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import httpx
import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_nemo import (
    JobFailed,
    JobSpec,
    JobState,
    JobTimedOut,
    StopNotConfirmed,
    lifecycle,
    run_job,
    stop_job,
    submit_job,
    wait_for_job,
)
from prefect_nemo.blocks import RayJobsCluster
from prefect_nemo.tasks.reporting import job_rows
from tests.conftest import job_events, jobs_of_run, wait_until

pytestmark = pytest.mark.slow


def test_run_job_success_streams_logs_and_reports(cluster, prefect_api, caplog):
    @flow
    def ok_flow():
        return run_job(JobSpec(entrypoint="echo hello-from-ray", name="hello"), cluster=cluster)

    state = ok_flow(return_state=True)
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    assert result.duration_s is not None and result.duration_s > 0
    assert "hello-from-ray" in caplog.text  # the job's log reached the run logger
    job_id = result.handle.job_id
    assert f"job {job_id} is SUCCEEDED" in caplog.text
    assert result.handle.links["dashboard"].endswith(job_id)
    # one line a state: the "submitted" line says a new job is pending, its event still goes
    assert f"submitted job {job_id} on " in caplog.text
    assert f"job {job_id} is PENDING" not in caplog.text
    sent = [e["event"] for e in job_events(prefect_api, result.handle.resource_id,
                                           until="prefect-nemo.job.succeeded")]  # fmt: skip
    assert sent[:2] == ["prefect-nemo.job.submitted", "prefect-nemo.job.pending"], sent

    rows = job_rows(str(state.state_details.flow_run_id))
    assert [(r["job_id"], r["state"]) for r in rows] == [(result.handle.job_id, "SUCCEEDED")]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    tables = [a for a in artifacts if a.type == "table"]
    assert len(tables) == 1, "one job table per flow run, updated in place"
    assert result.handle.job_id in str(tables[0].data) and "SUCCEEDED" in str(tables[0].data)


def test_run_job_failure_raises_with_exit_code_and_log_tail(cluster, prefect_api):
    @flow
    def failing_flow():
        run_job(JobSpec(entrypoint="echo about-to-fail; exit 7", name="boom"), cluster=cluster)

    with pytest.raises(JobFailed) as info:
        failing_flow()
    message = str(info.value)
    assert "exit code 7" in message
    assert "about-to-fail" in message
    assert info.value.result.state is JobState.FAILED
    assert info.value.result.exit_code == 7


def test_timeout_stops_the_job(cluster, prefect_api, ray_client):
    @flow
    def slow_flow():
        run_job(JobSpec(entrypoint="sleep 60", name="sleepy", timeout_s=3), cluster=cluster)

    with pytest.raises(JobTimedOut) as info:
        slow_flow()
    assert "timeout of 3s" in str(info.value)
    job_id = info.value.result.handle.job_id
    assert ray_client.get_job_status(job_id).value == "STOPPED"


def test_submit_wait_stop_split(cluster, prefect_api, ray_client):
    @flow
    def split_flow():
        handle = submit_job(JobSpec(entrypoint="sleep 60", name="split"), cluster=cluster)
        again = submit_job(JobSpec(entrypoint="sleep 60", name="split"), cluster=cluster)
        assert again == handle, "a second submit of the same job in the same run attaches"
        stopped = stop_job(handle, cluster=cluster)
        return handle, stopped

    handle, stopped = split_flow()
    assert stopped.state is JobState.STOPPED
    assert ray_client.get_job_status(handle.job_id).value == "STOPPED"

    @flow
    def wait_flow():
        handle = submit_job(JobSpec(entrypoint="echo waited", name="w"), cluster=cluster)
        return wait_for_job(handle, cluster=cluster)

    assert wait_flow().state is JobState.SUCCEEDED


def test_task_retry_attaches_instead_of_resubmitting(cluster, prefect_api, ray_client):
    marker = uuid.uuid4().hex[:8]
    attempts: list[str] = []

    @task(retries=1, retry_delay_seconds=0)
    def submit_then_crash():
        handle = submit_job.fn(JobSpec(entrypoint="sleep 5", name=f"retry-{marker}"), cluster)
        attempts.append(handle.job_id)
        if len(attempts) == 1:
            raise RuntimeError("simulated crash right after submit")
        return handle

    @flow
    def retry_flow():
        handle = submit_then_crash()
        return wait_for_job(handle, cluster=cluster)

    result = retry_flow()
    assert result.state is JobState.SUCCEEDED
    assert attempts[0] == attempts[1], "the retry derived the same job id"
    assert len([j for j in ray_client.list_jobs() if j.submission_id == attempts[0]]) == 1


def test_rerun_of_failed_job_submits_a_new_attempt(cluster, prefect_api):
    """A FAILED attempt is over: re-running the experiment retries under '-r1'."""
    from prefect_nemo import start_experiment

    name = f"attempts-{uuid.uuid4().hex[:6]}"

    @flow
    def exp_flow(fail: bool):
        start_experiment(name)
        return run_job(JobSpec(entrypoint="exit 1" if fail else "true", name="step"),
                       cluster=cluster)

    with pytest.raises(JobFailed) as info:
        exp_flow(True)
    first = info.value.result.handle.job_id
    second = exp_flow(False)
    assert second.handle.job_id == f"{first}-r1"
    again = exp_flow(False)  # succeeded already: attach, do not run it again
    assert again.handle.job_id == second.handle.job_id and again.attached


def test_parallel_jobs_share_one_poller(cluster, prefect_api):
    """Six jobs waited on at once cost one statuses() call per tick, and no lookups of their
    own (a tick may ask Ray for each job: see the next test)."""
    from prefect_nemo.watcher import watcher_for

    watcher = watcher_for(cluster.backend())
    backend = watcher.backend
    calls = {"statuses": 0, "find": 0}
    real_statuses, real_find = backend.statuses, backend.find
    in_tick = threading.local()

    def counting_statuses(job_ids):
        calls["statuses"] += 1
        in_tick.on = True
        try:
            return real_statuses(job_ids)
        finally:
            in_tick.on = False

    def counting_find(job_id):
        calls["find"] += not getattr(in_tick, "on", False)
        return real_find(job_id)

    @flow
    def fan_out():
        futures = [
            run_job.submit(JobSpec(entrypoint="sleep 2", name=f"fan-{i}"), cluster=cluster)
            for i in range(6)
        ]
        return [f.result() for f in futures]

    # Instrument the shared watcher's backend (the real one: calls still reach Ray).
    backend.statuses, backend.find = counting_statuses, counting_find
    try:
        ticks_before = watcher.ticks
        results = fan_out()
        ticks = watcher.ticks - ticks_before
    finally:
        del backend.statuses, backend.find
    assert all(r.state is JobState.SUCCEEDED for r in results)
    assert calls["find"] == 0, "waiting must not look jobs up one by one outside the poll"
    assert 0 < calls["statuses"] <= ticks + 1


def test_a_poll_asks_for_the_watched_job_not_the_clusters_whole_history(ray_head, ray_client):
    """Ray keeps every job a cluster ever ran and list_jobs returns them all (ray-project/ray
    #55010: the dashboard slows down as they accumulate), so a poll for one job on a cluster
    with a long history asks for that job (GET /api/jobs/<id>), not for the list: the first
    poll lists (which tells how many jobs there are), every later one asks for the job."""
    from prefect_nemo.backends.ray_jobs import RayJobsBackend, TimedJobClient

    # a history of 20 jobs at least (the session's head has run more by now, as a rule)
    history = [ray_client.submit_job(entrypoint="true")
               for _ in range(20 - len(ray_client.list_jobs()))]  # fmt: skip
    wait_until(lambda: all(ray_client.get_job_status(i).is_terminal() for i in history), 120)
    asked: list[tuple[str, str]] = []

    class Counting(TimedJobClient):  # the real client, its requests noted on the way out
        def _do_request(self, method, endpoint, **kwargs):
            asked.append((method, endpoint))
            return super()._do_request(method, endpoint, **kwargs)

    backend = RayJobsBackend(
        ray_head.dashboard_url, token=ray_head.token, client_class=Counting
    )
    job = ray_client.submit_job(entrypoint="sleep 30")
    try:
        polls = []
        for _ in range(4):
            del asked[:]
            assert backend.statuses([job])[job].state in {JobState.PENDING, JobState.RUNNING}
            polls.append(list(asked))
        first, *later = polls
        assert ("GET", "/api/jobs/") in first
        assert all(poll == [("GET", f"/api/jobs/{job}")] for poll in later), polls
    finally:
        ray_client.stop_job(job)


def test_concurrency_cap_serialises_jobs(ray_head, prefect_api):
    capped = ray_head.block(max_concurrent_jobs=1)

    @flow
    def capped_flow():
        futures = [
            run_job.submit(JobSpec(entrypoint="sleep 1", name=f"cap-{i}"), cluster=capped)
            for i in range(2)
        ]
        return [f.result() for f in futures]

    first, second = sorted(capped_flow(), key=lambda r: r.start_time)
    assert first.end_time <= second.start_time, "the cap of 1 let two jobs overlap"


def test_stop_of_pending_job_is_confirmed_or_reported(cluster, prefect_api, ray_client):
    """Ray accepts a stop on a PENDING job but only acts once it is scheduled."""
    backend = cluster.backend()
    job_id = f"pending-{uuid.uuid4().hex[:8]}"
    spec = JobSpec(entrypoint="sleep 30", resources={"custom": {"slot": 4}})
    blocker = f"blocker-{uuid.uuid4().hex[:8]}"
    backend.submit(JobSpec(entrypoint="sleep 4", resources={"custom": {"slot": 4}}), blocker, {})
    time.sleep(1)
    backend.submit(spec, job_id, {})
    assert backend.find(job_id).state is JobState.PENDING
    with pytest.raises(StopNotConfirmed, match="PENDING"):
        lifecycle.stop_and_confirm(backend, job_id, timeout_s=1)
    # Once the blocker ends the queued stop takes effect, and stop_and_confirm sees it.
    status = lifecycle.stop_and_confirm(backend, job_id, timeout_s=60)
    assert status.state is JobState.STOPPED


def test_events_are_emitted_on_state_changes(cluster, prefect_api):
    seen: list[str] = []

    @flow
    def evented():
        return run_job(JobSpec(entrypoint="true", name="evented"), cluster=cluster)

    result = evented()
    job_resource = result.handle.resource_id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = httpx.post(
            f"{prefect_api}/events/filter",
            json={"filter": {"resource": {"id": [job_resource]}}, "limit": 50},
        )
        seen = sorted(e["event"] for e in response.json()["events"])
        if "prefect-nemo.job.succeeded" in seen:
            break
        time.sleep(0.5)
    assert {"prefect-nemo.job.submitted", "prefect-nemo.job.succeeded"} <= set(seen), seen


@pytest.mark.parametrize(
    ("token", "expected"),
    [("not-the-token", "token was rejected"), (None, "requires a token")],
    ids=["wrong-token", "missing-token"],
)
def test_bad_auth_fails_clearly_before_submitting(ray_head, prefect_api, ray_client, token,
                                                  expected, monkeypatch):
    from prefect_nemo import AuthenticationFailed, RayJobsCluster

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/nonexistent")  # no token from Ray's own places
    block = RayJobsCluster(dashboard_url=ray_head.dashboard_url, auth_token=token)

    @flow
    def unauthorised():
        run_job(JobSpec(entrypoint="true", name="auth"), cluster=block)

    state = unauthorised(return_state=True)
    with pytest.raises(AuthenticationFailed, match=expected) as info:
        state.result()
    assert "auth_token" in str(info.value), "the message names the field to fix"
    assert jobs_of_run(ray_client, state.state_details.flow_run_id) == []


# -- Ray Jobs like NeMo-Skills' Ray backend (issue 14 item 5) ------------------------------------


def test_cluster_env_reaches_every_job(ray_head, prefect_api):
    """NeMo-Skills' cluster config: "You can define environment variables in the cluster config
    file, which will be set inside the container", and its Ray backend forwards them into the
    job ("test_ray_backend_forwards_required_env_vars_to_runtime_env": runtime_env["env_vars"]
    ["MY_JUDGE_KEY"] == "secret-123"). Plain and secret values arrive; the job's own env wins
    for a name both set."""
    secret = f"judge-{uuid.uuid4().hex}"
    block = ray_head.block(
        env={"HF_HOME": "/models/hf", "SHARED": "cluster"}, secret_env={"JUDGE_KEY": secret}
    )
    script = 'echo "home=$HF_HOME shared=$SHARED"; printf %s "$JUDGE_KEY" | sha256sum'

    @flow
    def env_flow():
        return run_job(
            JobSpec(entrypoint=script, name="cluster-env", env={"SHARED": "job"}), cluster=block
        )

    result = env_flow()
    assert result.state is JobState.SUCCEEDED
    logs = block.backend().logs(result.handle.job_id)
    assert "home=/models/hf shared=job" in logs
    assert hashlib.sha256(secret.encode()).hexdigest() in logs, "the secret value arrived"


def test_a_ray_client_without_label_selectors_runs_jobs_that_need_none(ray_head, prefect_api):
    """Ray's submit_job has `entrypoint_label_selector` only from 2.54.0, and "older clients
    raise TypeError even for None: send it only when set" (as NeMo-Skills' backend does since
    it "passes the kwarg conditionally"): a Ray 2.53 client runs every job that has no selector,
    with the cluster env."""
    from tests.old_ray import Ray253Cluster

    block = Ray253Cluster(
        dashboard_url=ray_head.dashboard_url, auth_token=ray_head.token, env={"WHO": "old-client"}
    )

    @flow
    def old_client_flow():
        return run_job(
            JobSpec(entrypoint='echo "from=$WHO"', name="old-client", resources={"cpus": 1}),
            cluster=block,
        )

    result = old_client_flow()
    assert result.state is JobState.SUCCEEDED
    assert "from=old-client" in block.backend().logs(result.handle.job_id)


def test_image_labels_fill_the_selector_and_the_jobs_own_keys_win(ray_head, prefect_api):
    """NeMo-Skills' Ray backend: "Image-derived selectors only fill gaps; explicit
    entrypoint_label_selector keys win" (selector.setdefault). The block maps the job's image to
    {ray.io/node-id: !<head>}, which no node of this one-node cluster matches; the job's own
    {ray.io/node-id: <head>} wins, so the job runs (with update it would never be scheduled). The
    image picks nodes: no container is started (Ray has no podman here, so a sent image_uri
    would fail the job)."""
    head = ray_head.block().backend().head_node_id()
    block = ray_head.block(
        image_label_selectors={"registry.example/train:*": {"ray.io/node-id": f"!{head}"}}
    )
    spec = JobSpec(
        entrypoint="echo placed",
        name="image-labels",
        label_selector={"ray.io/node-id": head},
        runtime_env={"image_uri": "registry.example/train:1"},
        timeout_s=120,  # a regression leaves the job unschedulable: fail, do not hang
    )
    [doc] = block.backend().render(spec, "j", {})
    assert doc["request"]["entrypoint_label_selector"] == {"ray.io/node-id": head}

    @flow
    def image_flow():
        return run_job(spec, cluster=block)

    result = image_flow()
    assert result.state is JobState.SUCCEEDED
    assert "placed" in block.backend().logs(result.handle.job_id)


@pytest.mark.parametrize(
    ("block_fields", "job_selector", "image", "expected"),
    [
        pytest.param(
            {"image_label_key": "nemo/image"},
            {"type": "worker"},
            "nvcr.io/nvidia/pytorch:25.02-py3",
            {"type": "worker", "nemo/image": "nvcr.io-nvidia-pytorch-25.02-py3"},
            id="image-label-key",
        ),
        pytest.param(
            {"image_label_key": "nemo/image"},
            {"type": "worker", "nemo/image": "preset-image-label"},
            "nvcr.io/nvidia/pytorch:25.02-py3",
            {"type": "worker", "nemo/image": "preset-image-label"},
            id="explicit-key-not-overridden",
        ),
        pytest.param(
            {
                "image_label_selectors": {
                    "/containers/nemo-skills.sqsh": {"key": "nemo/workload", "value": "skills"},
                    "/containers/nemo-rl.sqsh": {"nemo/workload": "rl"},
                }
            },
            {"type": "worker"},
            "/containers/nemo-skills.sqsh",
            {"type": "worker", "nemo/workload": "skills"},
            id="key-value-pairs",
        ),
        pytest.param(
            {"image_label_selectors": {"/containers/nemo-skills.sqsh": {"nemo/workload": "dyn"}}},
            {"nemo/workload": "static"},
            "/containers/nemo-skills.sqsh",
            {"nemo/workload": "static"},
            id="static-keys-preferred",
        ),
        pytest.param(
            {
                "image_label_selectors": {"nvcr.io/nvidia/*": {"pool": "nv", "tier": "gpu"}},
                "image_label_key": "nemo/image",
            },
            {},
            "nvcr.io/nvidia/nemo:25.07",
            {"pool": "nv", "tier": "gpu"},
            id="a-matching-pattern-before-the-label-key",
        ),
        pytest.param(
            {"image_label_selectors": {"nvcr.io/nvidia/*": {"pool": "nv"}}},
            {},
            "docker.io/library/python:3.12",
            None,
            id="no-match-no-selector",
        ),
    ],
)
def test_image_labels_follow_nemo_skills(block_fields, job_selector, image, expected):
    """The cases of NeMo-Skills' own tests of its Ray backend, on our request builder:
    test_kubernetes_ray_selector_with_image_label_translation (image_label_key → the image as a
    label value, "nvcr.io-nvidia-pytorch-25.02-py3"),
    test_image_translation_does_not_override_explicit_selector_value,
    test_image_label_selectors_add_explicit_key_value_pairs ({"key": ..., "value": ...}),
    test_image_label_selectors_prefer_static_selector_keys; and its rule that image_label_key
    applies only when no pattern matched ("elif self.image_label_key")."""
    block = RayJobsCluster(dashboard_url="http://127.0.0.1:1", **block_fields)
    spec = JobSpec(entrypoint="true", label_selector=job_selector, runtime_env={"image_uri": image})
    [doc] = block.backend().render(spec, "j", {})
    assert doc["request"].get("entrypoint_label_selector") == expected
    mapped = expected is not None
    assert ("image_uri" in doc["request"]["runtime_env"]) is not mapped, (
        "an image the block maps picks nodes; any other stays Ray's image_uri"
    )


def test_a_dashboard_server_error_names_the_exception_it_ended_with():
    """The dashboard answers an unexpected failure with a 500 whose body is the traceback (Ray's
    job_head/job_agent: `Response(text=traceback.format_exc(), status=500)`); its first line says
    nothing, so the error carries the exception the traceback ends with."""
    from prefect_nemo.backends.ray_jobs import _server_error

    body = (
        "Request failed with status code 500: Traceback (most recent call last):\n"
        '  File "job_head.py", line 420, in submit_job\n'
        "    resp = await job_agent_client.submit_job_internal(submit_request)\n"
        "KeyError: 'Agent info not found in internal KV for node 66e7'\n"
    )
    assert _server_error(body) == (
        "Request failed with status code 500: KeyError: 'Agent info not found in internal KV "
        "for node 66e7'"
    )
    assert _server_error("Request failed with status code 502: bad gateway") == (
        "Request failed with status code 502: bad gateway"
    )
