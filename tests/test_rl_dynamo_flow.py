"""The rl_with_dynamo flow end to end: loopback Kubernetes API server (strict CRD validation),
the Dynamo and KubeRay operator simulators, a real local Ray running the training job, and a
real Prefect API."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from flows.rl_dynamo import rl_with_dynamo
from prefect_nemo import JobFailed, JobStopped
from prefect_nemo.backends.dynamo import DgdFailed, DgdNotReady, dgd_kind
from prefect_nemo.backends.kuberay import KubeRayBackend
from prefect_nemo.kube import RAY_CLUSTER, RAY_JOB
from prefect_nemo.tasks.dgd import dgd_rows

pytestmark = pytest.mark.slow

RAY_IMAGE = "rayproject/ray:2.60.0"
AGG = "flows/manifests/dgd-vllm-agg.yaml"
JUDGE = "flows/manifests/dgd-judge-with-bench.yaml"
# Writes down what training was told: the env var and the config override appended to it.
TELL = (
    "python -c \"import json, os, sys; json.dump([os.environ['DYNAMO_FRONTEND_URL'], "
    "sys.argv[1:]], open('{out}', 'w'))\""
)
TRAIN = "python -c \"print('training')\""
# Training takes the recipe's overrides as arguments: commands here take and ignore them.
SLEEP = 'python -c "import sys, time; time.sleep(float(sys.argv[1]))" {}'
MUTATING = ("POST", "PUT", "PATCH", "DELETE")


def cluster_spec() -> dict[str, Any]:
    """A small, complete rayClusterSpec (head + one worker)."""
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {
            "rayStartParams": {},
            "template": {"spec": {"containers": [{"name": "ray-head", "image": RAY_IMAGE}]}},
        },
        "workerGroupSpecs": [
            {
                "groupName": "workers",
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 1,
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "w", "image": RAY_IMAGE}]}},
            }
        ],
    }


@pytest.fixture
def env(
    kube_server: Any,
    dynamo_sim: Any,
    kuberay: Any,
    kube_block: Any,
    ray_head: Any,
    prefect_api: str,
) -> dict[str, Any]:
    """Everything a test needs, plus a unique experiment and DGD names."""
    tag = uuid.uuid4().hex[:6]
    return {
        "server": kube_server,
        "sim": dynamo_sim,
        "kube": kube_block,
        "ray": ray_head,
        "experiment": f"rl-{tag}",
        "tag": tag,
        "prefect_api": prefect_api,
    }


def ray_block(env: dict[str, Any], **kw: Any) -> Any:
    from prefect_nemo.blocks import KubeRayCluster

    kw.setdefault("ray_cluster_spec", cluster_spec())
    kw.setdefault("ttl_seconds_after_finished", 0)
    return KubeRayCluster(kubernetes=env["kube"], ray_token=env["ray"].token, **kw)


def dgds(env: dict[str, Any]) -> dict[str, dict[str, Any]]:
    items, _ = env["kube"].api().list(dgd_kind())
    return {o["metadata"]["name"]: o for o in items if env["tag"] in o["metadata"]["name"]}


def rayjobs(env: dict[str, Any]) -> list[dict[str, Any]]:
    items, _ = env["kube"].api().list(RAY_JOB)
    return [o for o in items if o["metadata"]["name"].startswith(env["experiment"])]


def ours_changed(env: dict[str, Any]) -> list[str]:
    """Mutating requests the flow could have made. The simulators keep working on other
    tests' objects meanwhile, but they never create DGDs, RayJobs or Secrets, nor touch ours."""
    created_by_flow = ("/dynamographdeployments", "/rayjobs", "/secrets", "/configmaps")
    return [
        f"{e.method} {e.path}"
        for e in env["server"].requests.entries
        if e.method in MUTATING
        and (env["tag"] in e.path or (e.method == "POST" and e.path.endswith(created_by_flow)))
    ]


def wait_until(predicate: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def run(env: dict[str, Any], **kw: Any) -> Any:
    kw.setdefault("dgd_manifests", [AGG])
    kw.setdefault("dgd_names", [f"roll-{env['tag']}"])
    kw.setdefault("train_entrypoint", TRAIN)
    kw.setdefault("cluster", ray_block(env))
    kw.setdefault("ready_timeout_s", 30)
    kw.setdefault("timeout_s", 120)
    return rl_with_dynamo(experiment=env["experiment"], **kw)


def test_success_end_to_end_with_owner_cascade(
    env: dict[str, Any], caplog: Any, tmp_path: Any
) -> None:
    """nrl-k8s (`_inject_dynamo_into_recipe`): "Stamp the DGD's name into the recipe ... Only
    applies when exactly one DGD is declared": `policy.generation.backend=dynamo` and
    `policy.generation.dynamo_cfg.dgd_name=<resolved name>` (the name after overrides)."""
    name = f"roll-{env['tag']}"
    told = tmp_path / "told.json"
    out = run(env, keep_dgds=True, train_entrypoint=TELL.format(out=told))
    url = f"http://{name}-frontend.default.svc.cluster.local:8000"
    assert out["job_state"] == "SUCCEEDED" and out["frontend_urls"] == [url]
    assert out["dgds"][0]["outcome"] == "created" and out["dgds"][0]["created_by_this_run"]
    assert json.loads(told.read_text()) == [
        url,
        ["++policy.generation.backend=dynamo", f"++policy.generation.dynamo_cfg.dgd_name={name}"],
    ]
    assert f"DGD {name} is ready" in caplog.text

    # The DGD is owned by the training RayCluster (not as controller) ...
    rj = rayjobs(env)[0]
    cluster_name = rj["status"]["rayClusterName"]
    assert cluster_name.startswith(rj["metadata"]["name"] + "-")
    # ... so when KubeRay deletes that cluster after the job (TTL 0), the DGD goes with it.
    assert wait_until(lambda: name not in dgds(env)), "the DGD outlived its RayCluster"
    assert env["kube"].api().get(RAY_CLUSTER, cluster_name) is None

    rows = [r for r in _rows_for(env) if r["name"] == name]
    assert rows and rows[0]["outcome"] == "created" and rows[0]["frontend_url"] == url
    assert rows[0]["owner"] == f"RayCluster/{cluster_name}"


def _rows_for(env: dict[str, Any]) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[env["experiment"]]))
        )
    return [row for r in runs for row in dgd_rows(str(r.id))]


def test_owner_reference_is_on_the_dgd_while_training_runs(env: dict[str, Any]) -> None:
    name = f"roll-{env['tag']}"
    seen = _owner_refs_while(env, name, lambda: run(env, train_entrypoint=SLEEP.format(3)))
    ref = seen[0]
    assert ref["kind"] == "RayCluster" and ref["controller"] is False
    assert ref["name"].startswith(env["experiment"])
    assert wait_until(lambda: name not in dgds(env)), "teardown left the DGD"


def _owner_refs_while(env: dict[str, Any], name: str, run_flow: Any, ns: str = "default") -> Any:
    """Run the flow, looking at the DGD's owner references while training runs."""
    seen: dict[str, Any] = {"refs": None}

    def spy() -> None:
        def owned() -> bool:
            obj = env["kube"].api().get(dgd_kind(), name, ns)
            seen["refs"] = (obj or {}).get("metadata", {}).get("ownerReferences")
            return bool(seen["refs"])

        wait_until(owned, 60)

    watcher = threading.Thread(target=spy)
    watcher.start()
    out = run_flow()
    watcher.join()
    seen["out"] = out
    return seen["refs"]


def test_dgds_go_where_the_rayjob_goes_and_outlive_the_start_of_training(
    env: dict[str, Any],
) -> None:
    """Kubernetes (Owners and Dependents): "A namespaced owner must exist in the same
    namespace as the dependent. If it does not, the owner reference is treated as absent, and
    the dependent is subject to deletion". The KubeRayCluster's `namespace` wins over its
    Kubernetes block's: one resolver says where its RayJob goes, and the DGDs go there too,
    so their owner (the RayJob's RayCluster) is in their namespace and they survive."""
    from prefect_nemo.kube import NAMESPACE

    api = env["kube"].api()
    if api.get(NAMESPACE, "training") is None:
        api.create(NAMESPACE, {"apiVersion": "v1", "kind": "Namespace",
                               "metadata": {"name": "training"}})  # fmt: skip
    name = f"roll-{env['tag']}"
    block = ray_block(env, namespace="training")
    refs = _owner_refs_while(
        env, name, lambda: run(env, cluster=block, train_entrypoint=SLEEP.format(3)), ns="training"
    )
    assert refs and refs[0]["kind"] == "RayCluster", "the DGD was gone before it was owned"
    (job,) = [
        o for o in api.list(RAY_JOB, "training")[0] if env["experiment"] in o["metadata"]["name"]
    ]
    assert refs[0]["name"] == job["status"]["rayClusterName"]
    assert wait_until(lambda: api.get(dgd_kind(), name, "training") is None)


def test_rollback_when_the_second_dgd_fails(env: dict[str, Any]) -> None:
    first, second = f"roll-{env['tag']}", f"judge-{env['tag']}"
    env["sim"].configure(second, fail=True, fail_message="judge worker crashed")
    env["server"].requests.clear()
    with pytest.raises(DgdFailed, match="judge worker crashed"):
        run(env, dgd_manifests=[AGG, JUDGE], dgd_names=[first, second], image="judge:1")
    assert wait_until(lambda: not dgds(env)), f"left behind: {list(dgds(env))}"
    assert rayjobs(env) == [], "training must not start before the graphs serve"
    changes = ours_changed(env)  # (also proves the dry-run test's detector sees our writes)
    assert sum(c.startswith("POST") and "dynamographdeployments" in c for c in changes) == 2
    assert any(c.startswith("DELETE") and first in c for c in changes)
    assert events_of(env, first, "prefect-nemo.dgd.deleted") >= {
        "prefect-nemo.dgd.ready",
        "prefect-nemo.dgd.deleted",
    }
    assert "prefect-nemo.dgd.failed" in events_of(env, second, "prefect-nemo.dgd.failed")


def events_of(env: dict[str, Any], name: str, until: str) -> set[str]:
    """The prefect-nemo.dgd.* events of a DGD (waits for `until`: events arrive async)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and until not in seen:
        response = httpx.post(
            f"{env['prefect_api']}/events/filter",
            json={
                "filter": {"resource": {"id": [f"prefect-nemo.dgd.default.{name}"]}},
                "limit": 50,
            },
        )
        seen = {e["event"] for e in response.json()["events"]}
        time.sleep(0.3)
    return seen


def test_rerun_attaches_instead_of_duplicating(env: dict[str, Any]) -> None:
    name = f"roll-{env['tag']}"
    keep = ray_block(env, shutdown_after_job_finishes=False)
    first = run(env, cluster=keep, keep_dgds=True)
    second = run(env, cluster=keep, keep_dgds=True)
    assert first["dgds"][0]["outcome"] == "created"
    assert second["dgds"][0]["outcome"] == "attached"  # no drift from the new flow run id
    assert not second["dgds"][0]["created_by_this_run"]
    assert second["job_id"] == first["job_id"]  # the RayJob was attached to, not resubmitted
    assert list(dgds(env)) == [name] and len(rayjobs(env)) == 1
    # tidy up: the RayJob (and its cluster) and the DGD
    api = env["kube"].api()
    api.delete(RAY_JOB, first["job_id"])
    api.delete(dgd_kind(), name)


def test_failed_training_deletes_what_the_run_created(env: dict[str, Any], tmp_path: Any) -> None:
    """Also: the tee wrapper around the entrypoint keeps the exit status (Ray runs it with sh)."""
    name = f"roll-{env['tag']}"
    log = tmp_path / "train.log"
    with pytest.raises(JobFailed, match="exit code 3"):
        run(
            env,
            train_entrypoint="echo training-breaks; exit 3; :",
            train_log_path=str(log),
        )
    assert wait_until(lambda: name not in dgds(env))
    assert log.read_text() == "training-breaks\n"


def test_rollback_when_the_rayjob_cannot_be_submitted(env: dict[str, Any]) -> None:
    """nrl-k8s (`run --rayjob`): when applying the RayJob fails, the DGDs created for it are
    deleted ("stranded" DGDs), so nothing is left serving for a training that never started."""
    from prefect_nemo import AuthenticationFailed

    name = f"roll-{env['tag']}"
    env["server"].forbid("create", "rayjobs", "ray.io")
    try:
        with pytest.raises(AuthenticationFailed, match="create"):
            run(env)
    finally:
        env["server"].allow("create", "rayjobs", "ray.io")
    assert wait_until(lambda: name not in dgds(env)), "the DGD outlived the failed submit"
    assert rayjobs(env) == []
    changes = ours_changed(env)
    assert any(c.startswith("DELETE") and name in c for c in changes)


def test_rerun_attaches_to_a_rayjob_that_already_finished(env: dict[str, Any], caplog: Any) -> None:
    """A re-run of the experiment attaches to its RayJob, which already finished and whose
    RayCluster KubeRay already removed (shutdownAfterJobFinishes, TTL 0): there is no owner to
    add, the run reports the job's result, and the DGDs it created are deleted at its end."""
    name = f"roll-{env['tag']}"
    first = run(env)
    assert wait_until(lambda: name not in dgds(env))
    caplog.set_level("INFO")
    second = run(env)
    assert second["job_id"] == first["job_id"] and second["job_state"] == "SUCCEEDED"
    assert second["dgds"][0]["created_by_this_run"], "the second run brought its DGD up again"
    assert "already ended and its RayCluster is gone" in caplog.text
    assert len(rayjobs(env)) == 1
    assert wait_until(lambda: name not in dgds(env)), "the second run left its DGD"


def test_a_dgd_we_only_attached_to_is_left_alone(env: dict[str, Any]) -> None:
    from prefect_nemo.backends.dynamo import apply_dgd, load_dgd, render_dgd

    name = f"shared-{env['tag']}"
    api = env["kube"].api()
    apply_dgd(api, render_dgd(load_dgd(AGG), name=name, namespace="default"))
    with pytest.raises(JobFailed):
        run(env, dgd_names=[name], train_entrypoint='python -c "raise SystemExit(1)"')
    assert name in dgds(env), "someone else's DGD was deleted"
    assert not dgds(env)[name]["metadata"].get("ownerReferences")
    api.delete(dgd_kind(), name)


def test_a_user_managed_dgd_is_addressed_by_frontend_url_and_never_touched(
    env: dict[str, Any], tmp_path: Any
) -> None:
    """NeMo-RL dynamo_cfg: `frontend_url` is the "escape hatch ... when pointing at a
    hand-rolled DGD"; the flow stamps it (with backend=dynamo) and never applies, owns or
    deletes that DGD."""
    from prefect_nemo.backends.dynamo import apply_dgd, load_dgd, render_dgd

    name = f"theirs-{env['tag']}"
    api = env["kube"].api()
    apply_dgd(api, render_dgd(load_dgd(AGG), name=name, namespace="default"))
    url = f"http://{name}-frontend.default.svc.cluster.local:8000/v1"
    told = tmp_path / "told.json"
    env["server"].requests.clear()
    out = run(env, dgd_manifests=[], dgd_names=None, frontend_url=url,
              train_entrypoint=TELL.format(out=told))  # fmt: skip
    assert out["job_state"] == "SUCCEEDED" and out["dgds"] == []
    assert json.loads(told.read_text()) == [
        url,
        [
            "++policy.generation.backend=dynamo",
            f"++policy.generation.dynamo_cfg.frontend_url={url}",
        ],
    ]
    written = [c for c in ours_changed(env) if f"dynamographdeployments/{name}" in c]
    assert all(c.endswith("/status") for c in written), (
        "their DGD was written to (not by its operator)"
    )
    theirs = dgds(env)[name]
    assert not theirs["metadata"].get("ownerReferences")
    api.delete(dgd_kind(), name)


def _cancel_when(env: dict[str, Any], ready: Any, **kw: Any) -> BaseException | None:
    """Run the flow in a thread, cancel its run through the API once `ready()`, and return
    what the flow raised."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Cancelling

    raised: list[BaseException | None] = [None]

    def target() -> None:
        try:
            run(env, **kw)
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=target)
    thread.start()
    assert wait_until(ready, 60)
    with get_client(sync_client=True) as c:
        (flow_run,) = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[env["experiment"]]))
        )
        c.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    thread.join(90)
    assert not thread.is_alive(), "the flow did not notice the cancellation"
    return raised[0]


def test_cancel_during_training_deletes_dgds_and_stops_the_job(env: dict[str, Any]) -> None:
    name = f"roll-{env['tag']}"

    def training() -> bool:
        jobs = rayjobs(env)
        return bool(jobs) and jobs[0].get("status", {}).get("jobStatus") == "RUNNING"

    raised = _cancel_when(env, training, train_entrypoint=SLEEP.format(60))
    assert isinstance(raised, JobStopped), raised
    assert wait_until(lambda: name not in dgds(env))
    # stopped in Ray (the RayJob reads STOPPED); or, where the RayJob did not read STOPPED
    # within STOP_ESCALATE_S (KubeRay's status lags on busy cores), stopped by deleting the
    # RayJob and the RayCluster it brought up (KubeRayBackend.stop)
    if jobs := rayjobs(env):
        status = jobs[0].get("status", {})
        assert status.get("jobStatus") == "STOPPED", status
    else:
        assert raised.result.message == KubeRayBackend.deleted_message, raised.result


def test_cancel_while_waiting_for_the_dgd(env: dict[str, Any]) -> None:
    name = f"roll-{env['tag']}"
    env["sim"].configure(name, start_delay_s=60)
    raised = _cancel_when(env, lambda: name in dgds(env))
    assert isinstance(raised, DgdNotReady) and "interrupted" in str(raised), raised
    assert wait_until(lambda: name not in dgds(env))
    assert rayjobs(env) == []


def test_dry_run_changes_nothing_and_renders_valid_manifests(env: dict[str, Any]) -> None:
    server = env["server"]
    server.requests.clear()
    out = run(
        env,
        dgd_manifests=[AGG, JUDGE],
        dgd_names=[f"roll-{env['tag']}", f"judge-{env['tag']}"],
        image="default:1",
        image_pull_secrets=["ngc"],
        dry_run=True,
    )
    assert ours_changed(env) == []
    assert dgds(env) == {} and rayjobs(env) == []
    kinds = [m["kind"] for m in out["manifests"]]
    assert kinds == ["DynamoGraphDeployment", "DynamoGraphDeployment", "RayJob"]
    assert not any(m["metadata"].get("ownerReferences") for m in out["manifests"])
    rayjob = out["manifests"][-1]
    url = f"http://roll-{env['tag']}-frontend.default.svc.cluster.local:8000"
    assert url in rayjob["spec"]["runtimeEnvYAML"]  # DYNAMO_FRONTEND_URL
    # nrl-k8s: "With multiple DGDs the user is expected to wire dgd_name themselves"
    assert rayjob["spec"]["entrypoint"] == TRAIN, "two DGDs: the recipe is left alone"
    assert "kind: RayJob" in out["yaml"]
    # Every manifest passes the server's schema, no field unknown to it (server-side dry run:
    # nothing stored).
    custom = k8s.CustomObjectsApi(server.api_client())
    for manifest in out["manifests"]:
        group, version = manifest["apiVersion"].split("/")
        plural = "rayjobs" if manifest["kind"] == "RayJob" else "dynamographdeployments"
        custom.create_namespaced_custom_object(
            group, version, "default", plural, manifest, dry_run="All", field_validation="Strict"
        )
    assert dgds(env) == {} and rayjobs(env) == []


def test_bad_input_fails_before_any_api_call(env: dict[str, Any], tmp_path: Any) -> None:
    from prefect_nemo import InvalidJobSpec

    pod_only = tmp_path / "pod.yaml"
    pod_only.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    server = env["server"]
    server.requests.clear()
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    config = env["server"].kubeconfig()
    in_training = KubeRayCluster(
        kubernetes=KubernetesCluster(kubeconfig=config, namespace="training"),
        ray_cluster_spec=cluster_spec(),
    )
    in_rollouts = KubernetesCluster(kubeconfig=config, namespace="rollouts")
    user_url = "http://their-dgd-frontend.serving.svc.cluster.local:8000/v1"
    cases = [
        ({"dgd_names": ["Bad_Name"]}, "not valid"),
        ({"dgd_manifests": [str(pod_only)], "dgd_names": None}, "no document of kind"),
        ({"dgd_version": "v9"}, "not known"),
        ({"dgd_manifests": [AGG, AGG], "dgd_names": ["same", "same"]}, "same DGD name"),
        # NeMo-RL dynamo_cfg: dgd_name and frontend_url are mutually exclusive
        ({"frontend_url": user_url}, "mutually exclusive.*frontend_url="),
        (
            {"train_entrypoint": f"{TRAIN} ++policy.generation.dynamo_cfg.frontend_url={user_url}"},
            "mutually exclusive.*the entrypoint's policy.generation.dynamo_cfg.frontend_url",
        ),
        ({"frontend_port": 70000}, "frontend_port 70000 is not a TCP port"),
        ({"frontend_port": 9000}, "frontend_port 9000: .* listens on 8000 .*--http-port"),
        # the new user: DGDs in `rollouts`, the KubeRayCluster's Kubernetes in `training`
        ({"cluster": in_training, "kube": in_rollouts}, "namespace 'rollouts' .* in 'training'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidJobSpec, match=message):
            run(env, **kwargs)
    assert ours_changed(env) == []
