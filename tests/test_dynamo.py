"""Dynamo backend: rendering and validation (pure), and the API side against the loopback
Kubernetes API server (strict CRD validation) with the Dynamo operator simulator; plus the
shell wrapper that tees a command's output without losing its exit status."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefect_nemo import InvalidJobSpec
from prefect_nemo.backends import dynamo
from prefect_nemo.backends.dynamo import (
    DgdCrdMissing,
    DgdFailed,
    DgdNotReady,
    DgdQueueTimedOut,
    apply_dgd,
    check_crd_installed,
    deep_merge,
    delete_dgd,
    frontend_service,
    frontend_url,
    load_dgd,
    own_by,
    render_dgd,
    resolve_frontend_url,
    wait_dgd_ready,
)
from prefect_nemo.backends.dynamo.graphs import queued_reason
from prefect_nemo.kube import KubeTimeout
from prefect_nemo.packaging import tee_command
from tests.conftest import wait_until

MANIFESTS = Path(__file__).parent.parent / "flows" / "manifests"
AGG = MANIFESTS / "dgd-vllm-agg.yaml"
JUDGE = MANIFESTS / "dgd-judge-with-bench.yaml"
SA_FIELD = "serviceAccountName"


def agg() -> dict[str, Any]:
    return load_dgd(AGG)


def beta(sa: str | None = None) -> dict[str, Any]:
    """A v1beta1 DGD (spec.components) with a frontend without container and a worker."""
    worker_pod: dict[str, Any] = {"containers": [{"name": "main", "image": "worker:1"}]}
    if sa:
        worker_pod[SA_FIELD] = sa
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "beta"},
        "spec": {
            "components": [
                {"name": "Frontend", "type": "frontend", "replicas": 1},
                {"name": "worker", "type": "worker", "podTemplate": {"spec": worker_pod}},
            ]
        },
    }


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_picks_the_dgd_out_of_a_multi_document_file() -> None:
    doc = load_dgd(JUDGE)
    assert doc["kind"] == "DynamoGraphDeployment" and doc["metadata"]["name"] == "rl-judge"


def test_load_without_a_dgd_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pod-only.yaml"
    path.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n---\nkind: ConfigMap\n")
    with pytest.raises(
        InvalidJobSpec,
        match=r"pod-only\.yaml: no document of kind "
        r"DynamoGraphDeployment.*Pod.*ConfigMap",
    ):
        load_dgd(path)
    with pytest.raises(InvalidJobSpec, match=r"no such file"):
        load_dgd(tmp_path / "missing.yaml")


def test_two_dgds_in_one_file_need_a_name(tmp_path: Path) -> None:
    first, second = agg(), agg()
    second["metadata"]["name"] = "other"
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([first, second]))
    with pytest.raises(InvalidJobSpec, match=r"two\.yaml holds 2 .*rl-rollout.*other.*name"):
        load_dgd(path)
    assert load_dgd(path, name="other")["metadata"]["name"] == "other"
    with pytest.raises(InvalidJobSpec, match=r"no DynamoGraphDeployment named 'nope'"):
        load_dgd(path, name="nope")


# ---------------------------------------------------------------------------------------------
# Rendering


def test_deep_merge_dicts_merge_lists_and_scalars_replace_none_deletes() -> None:
    base = {"a": {"x": 1, "y": [1, 2], "z": "keep"}, "b": 2, "gone": {"deep": 1}}
    over = {"a": {"x": 10, "y": [3]}, "b": None, "gone": None, "new": {"k": None, "v": 1}}
    assert deep_merge(base, over) == {"a": {"x": 10, "y": [3], "z": "keep"}, "new": {"v": 1}}
    assert base["a"]["x"] == 1, "the base is not mutated"


def test_deep_merge_into_v1beta1_components_by_name() -> None:
    comps = beta()["spec"]["components"]
    merged = deep_merge(
        comps, {"worker": {"replicas": 3}, "Frontend": None, "planner": {"type": "planner"}}
    )
    assert [c["name"] for c in merged] == ["worker", "planner"]
    assert merged[0]["replicas"] == 3 and merged[0]["podTemplate"]  # merged, not replaced
    assert deep_merge(comps, [{"name": "only"}]) == [{"name": "only"}]  # a list replaces


def test_render_sets_name_namespace_labels_and_overrides() -> None:
    doc = render_dgd(
        agg(),
        name="rollout-b",
        namespace="rl",
        labels={"team": "rl"},
        flow_run_id="run-1",
        overrides={
            "spec": {
                "services": {"VllmDecodeWorker": {"replicas": 4, "envFromSecret": None}},
                "envs": [{"name": "X", "value": "1"}],
            }
        },
    )
    meta = doc["metadata"]
    assert (meta["name"], meta["namespace"]) == ("rollout-b", "rl")
    assert meta["labels"] == {
        "team": "rl",
        "app.kubernetes.io/managed-by": "prefect-nemo",
        "prefect.io/flow-run-id": "run-1",
    }
    worker = doc["spec"]["services"]["VllmDecodeWorker"]
    assert worker["replicas"] == 4 and "envFromSecret" not in worker
    assert worker["resources"]["limits"]["gpu"] == "1"  # untouched siblings stay
    assert doc["spec"]["envs"] == [{"name": "X", "value": "1"}]
    assert agg()["metadata"]["name"] == "rl-rollout"


def test_image_is_only_a_default_v1alpha1() -> None:
    doc = render_dgd(
        load_dgd(JUDGE), namespace="ns", image="default:1", image_pull_secrets=["ngc", "ngc"]
    )
    services = doc["spec"]["services"]
    assert services["Frontend"]["extraPodSpec"]["mainContainer"]["image"].startswith("nvcr.io")
    assert services["JudgeWorker"]["extraPodSpec"]["mainContainer"]["image"] == "default:1"
    for svc in services.values():
        assert svc["extraPodSpec"]["imagePullSecrets"] == [{"name": "ngc"}]
    bare = render_dgd(load_dgd(JUDGE), namespace="ns")
    assert "image" not in bare["spec"]["services"]["JudgeWorker"]["extraPodSpec"]["mainContainer"]
    assert "imagePullSecrets" not in bare["spec"]["services"]["Frontend"]["extraPodSpec"]


def test_image_is_only_a_default_v1beta1() -> None:
    doc = render_dgd(
        beta(), namespace="ns", version="v1beta1", image="default:1", image_pull_secrets=["ngc"]
    )
    front, worker = doc["spec"]["components"]
    assert front["podTemplate"]["spec"]["containers"] == [{"name": "main", "image": "default:1"}]
    assert worker["podTemplate"]["spec"]["containers"][0]["image"] == "worker:1"
    assert worker["podTemplate"]["spec"]["imagePullSecrets"] == [{"name": "ngc"}]
    assert frontend_service(doc) == "beta-frontend"


def test_service_account_is_never_added_or_overwritten() -> None:
    def accounts(doc: dict[str, Any]) -> list[Any]:
        return [s.get("extraPodSpec", {}).get(SA_FIELD) for s in doc["spec"]["services"].values()]

    doc = render_dgd(agg(), namespace="ns", image="x", image_pull_secrets=["s"])
    assert accounts(doc) == [None, None], "the operator's per-DGD service account must win"
    mine = agg()
    mine["spec"]["services"]["Frontend"]["extraPodSpec"][SA_FIELD] = "user-sa"
    doc = render_dgd(mine, namespace="ns", image="x", image_pull_secrets=["s"])
    assert accounts(doc) == ["user-sa", None]
    over = {"spec": {"services": {"VllmDecodeWorker": {"extraPodSpec": {SA_FIELD: "from-over"}}}}}
    assert accounts(render_dgd(agg(), namespace="ns", overrides=over)) == [None, "from-over"]
    b = render_dgd(beta(sa="beta-sa"), namespace="ns", version="v1beta1", image="x")
    assert [c["podTemplate"]["spec"].get(SA_FIELD) for c in b["spec"]["components"]] == [
        None,
        "beta-sa",
    ]


@pytest.mark.parametrize("bad", ["Rollout", "roll_out", "1rollout", "rollout-", "a" * 55, ""])
def test_invalid_dgd_names_are_refused_not_renamed(bad: str) -> None:
    with pytest.raises(InvalidJobSpec, match=r"DGD name|metadata.name is missing"):
        render_dgd(agg(), name=bad, namespace="ns")


def test_version_must_be_known_and_match_the_manifest() -> None:
    with pytest.raises(InvalidJobSpec, match=r"v2.*not known"):
        render_dgd(agg(), namespace="ns", version="v2")
    with pytest.raises(InvalidJobSpec, match=r"apiVersion is 'nvidia.com/v1alpha1'.*v1beta1"):
        render_dgd(agg(), namespace="ns", version="v1beta1")
    wrong_shape = beta()
    wrong_shape["apiVersion"] = "nvidia.com/v1alpha1"
    with pytest.raises(InvalidJobSpec, match=r"spec.components is the v1beta1 shape"):
        render_dgd(wrong_shape, namespace="ns")


def test_exactly_one_frontend() -> None:
    none = agg()
    none["spec"]["services"]["Frontend"]["componentType"] = "worker"
    with pytest.raises(InvalidJobSpec, match=r"no service with componentType 'frontend'"):
        render_dgd(none, namespace="ns")
    two = agg()
    two["spec"]["services"]["Frontend2"] = {"componentType": "frontend"}
    with pytest.raises(InvalidJobSpec, match=r"2 services \['Frontend', 'Frontend2'\]"):
        render_dgd(two, namespace="ns")


def test_frontend_url_and_conflicting_settings() -> None:
    doc = render_dgd(agg(), namespace="rl")
    assert (
        frontend_url("rl-rollout", "rl") == "http://rl-rollout-frontend.rl.svc.cluster.local:8000"
    )
    assert resolve_frontend_url(doc) == frontend_url("rl-rollout", "rl")
    same = "http://rl-rollout-frontend.rl.svc:8000"
    assert resolve_frontend_url(doc, same) == same
    ingress = "https://rollouts.example.com/v1"
    assert resolve_frontend_url(doc, ingress) == ingress
    for other in (
        "http://other-frontend.rl.svc.cluster.local:8000",
        "http://rl-rollout-frontend.prod.svc.cluster.local:8000",
        "http://rl-rollout-frontend.rl.svc.cluster.local:9000",
    ):
        with pytest.raises(InvalidJobSpec, match=r"disagrees with DGD 'rl-rollout'"):
            resolve_frontend_url(doc, other)
    with pytest.raises(InvalidJobSpec, match=r"not an http"):
        resolve_frontend_url(doc, "rl-rollout-frontend:8000")


# ---------------------------------------------------------------------------------------------
# The recipe keys training gets (flows/rl_dynamo.py)


def test_recipe_keys_as_nrl_k8s_stamps_them() -> None:
    """nrl-k8s `_inject_dynamo_into_recipe`: "Only applies when exactly one DGD is declared
    ... With multiple DGDs the user is expected to wire dgd_name themselves"; it sets
    `policy.generation.backend=dynamo` and `policy.generation.dynamo_cfg.dgd_name=<resolved
    name>`. NeMo-RL's DynamoCfg: "Two ways to specify the frontend, mutually exclusive"
    (`dgd_name`, `frontend_url`), `frontend_port` "(default 8000)"."""
    from flows.rl_dynamo import recipe_overrides

    one = recipe_overrides("python run_grpo.py", ["rollout-a"])
    assert one == [
        "++policy.generation.backend=dynamo",
        "++policy.generation.dynamo_cfg.dgd_name=rollout-a",
    ]
    assert recipe_overrides("python run_grpo.py", ["a", "b"]) == []
    assert recipe_overrides("python run_grpo.py", ["a"], frontend_port=9000)[-1] == (
        "++policy.generation.dynamo_cfg.frontend_port=9000"
    )
    theirs = "http://mine-frontend.serving.svc.cluster.local:8000/v1"
    assert recipe_overrides("python run_grpo.py", [], frontend_url=theirs) == [
        "++policy.generation.backend=dynamo",
        f"++policy.generation.dynamo_cfg.frontend_url={theirs}",
    ]
    for entrypoint, names, url in [
        ("python run_grpo.py", ["a"], theirs),
        (f"python run_grpo.py +policy.generation.dynamo_cfg.frontend_url={theirs}", ["a"], None),
        ("python run_grpo.py policy.generation.dynamo_cfg.dgd_name=x", ["a", "b"], theirs),
    ]:
        with pytest.raises(InvalidJobSpec, match=r"dgd_name and .*frontend_url are mutually"):
            recipe_overrides(entrypoint, names, frontend_url=url)


def test_frontend_port_must_be_where_the_frontend_listens() -> None:
    """Dynamo: "dynamo.frontend accepts either --http-port flag or DYN_HTTP_PORT env var
    (defaults to 8000)"; a port it does not listen on fails before any request, naming the
    field and the fix."""
    doc = render_dgd(agg(), namespace="ns")  # its Frontend says --http-port 8000
    assert resolve_frontend_url(doc, port=8000).endswith(":8000")
    with pytest.raises(InvalidJobSpec, match=r"frontend_port 9000: .*listens on 8000.*--http-port"):
        resolve_frontend_url(doc, port=9000)
    moved = deep_merge(doc, {"spec": {"services": {"Frontend": {"extraPodSpec": {
        "mainContainer": {"args": ["--http-port", "9000"]}}}}}})  # fmt: skip
    assert resolve_frontend_url(moved, port=9000) == (
        "http://rl-rollout-frontend.ns.svc.cluster.local:9000"
    )
    by_env = beta()
    by_env["spec"]["components"][0]["envs"] = [{"name": "DYN_HTTP_PORT", "value": "8100"}]
    assert resolve_frontend_url(by_env, port=8100, version="v1beta1").endswith(":8100")
    for bad in (0, 70000, "8000", True):
        with pytest.raises(InvalidJobSpec, match="is not a TCP port"):
            resolve_frontend_url(doc, port=bad)


# ---------------------------------------------------------------------------------------------
# Against the loopback API server and the Dynamo operator simulator


@pytest.fixture(scope="module")
def api(kube_server: Any) -> Any:
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    return KubernetesCluster(kubeconfig=kube_server.kubeconfig()).api()


def deploy(api: Any, name: str, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = render_dgd(manifest or agg(), name=name, namespace="default", flow_run_id="run-1")
    assert apply_dgd(api, doc).outcome == "created"
    return doc


def test_example_manifests_are_valid_against_the_crd(api: Any) -> None:
    for path in sorted(MANIFESTS.glob("dgd-*.yaml")):
        doc = render_dgd(
            load_dgd(path),
            name=f"valid-{path.stem[4:]}"[:40],
            namespace="default",
            image="img:1",
            image_pull_secrets=["ngc"],
            labels={"a": "b"},
        )
        assert apply_dgd(api, doc).outcome == "created", path  # refused otherwise: Strict
        delete_dgd(api, doc["metadata"]["name"], "default")


def test_crd_probe(kube_server: Any, api: Any) -> None:
    assert check_crd_installed(api, "v1alpha1", "default") is True
    with pytest.raises(DgdCrdMissing, match=r"CRD \(nvidia.com/v1beta1\) is not installed.*Helm"):
        check_crd_installed(api, "v1beta1", "default")
    kube_server.forbid("list", "dynamographdeployments", "nvidia.com")
    try:
        assert check_crd_installed(api, "v1alpha1", "default") is False  # installed, no list
    finally:
        kube_server.allow("list", "dynamographdeployments", "nvidia.com")


def test_apply_twice_attaches_and_drift_warns(api: Any, dynamo_sim: Any, caplog: Any) -> None:
    doc = deploy(api, "twice")
    again = apply_dgd(api, doc)
    assert again.outcome == "attached" and not again.created
    changed = deep_merge(doc, {"spec": {"services": {"Frontend": {"replicas": 2}}}})
    with caplog.at_level(logging.WARNING):
        drifted = apply_dgd(api, changed)
    assert drifted.outcome == "drifted" and "different spec" in (drifted.drift or "")
    assert "different spec" in caplog.text
    assert drifted.obj["spec"]["services"]["Frontend"]["replicas"] == 1  # reused as is
    assert delete_dgd(api, "twice", "default") is True
    assert delete_dgd(api, "twice", "default") is False


def _held(api: Any, name: str) -> dict[str, Any]:
    """A DGD whose deletion a finalizer holds (as the real operator's own finalizer does while
    it tears the graph down), already asked to go: it has metadata.deletionTimestamp."""
    doc = render_dgd(agg(), name=name, namespace="default", flow_run_id="run-1")
    doc["metadata"]["finalizers"] = ["test.prefect-nemo.io/hold"]
    first = apply_dgd(api, doc).obj
    api.delete(dynamo.dgd_kind(), name, "default")
    held = api.get(dynamo.dgd_kind(), name, "default")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    return first


def _release_later(api: Any, name: str, after_s: float = 0.5) -> threading.Timer:
    """Remove the finalizer a moment from now, from another thread."""
    patch = {"metadata": {"finalizers": None}}
    timer = threading.Timer(after_s, lambda: api.patch(dynamo.dgd_kind(), name, patch, "default"))
    timer.start()
    return timer


def test_delete_waits_until_the_dgd_is_gone(api: Any) -> None:
    """nrl-k8s recreates a DGD with `delete_dgd(name, namespace)` then
    `wait_for_dgd_gone(name, namespace)` before it applies again: a delete is done when the DGD
    no longer exists, not when the API server accepted the request."""
    doc = render_dgd(agg(), name="slow-to-go", namespace="default", flow_run_id="run-1")
    doc["metadata"]["finalizers"] = ["test.prefect-nemo.io/hold"]
    apply_dgd(api, doc)
    timer = _release_later(api, "slow-to-go")
    assert delete_dgd(api, "slow-to-go", "default") is True
    assert api.get(dynamo.dgd_kind(), "slow-to-go", "default") is None, "returned before it went"
    timer.join()
    doc["metadata"]["name"] = "stuck"
    apply_dgd(api, doc)
    with pytest.raises(KubeTimeout, match=r"deletion of .*stuck"):  # a finalizer stays: named
        delete_dgd(api, "stuck", "default", wait_s=0.5)
    api.patch(dynamo.dgd_kind(), "stuck", {"metadata": {"finalizers": None}}, "default")


def test_apply_never_attaches_to_a_dgd_being_deleted(api: Any) -> None:
    """A DGD with metadata.deletionTimestamp is on its way out (its pods and frontend go with
    it): apply waits until it is gone, then creates a new one, instead of attaching."""
    old = _held(api, "being-deleted")
    timer = _release_later(api, "being-deleted")
    doc = render_dgd(agg(), name="being-deleted", namespace="default", flow_run_id="run-1")
    applied = apply_dgd(api, doc)
    timer.join()
    assert applied.outcome == "created" and applied.created
    assert applied.obj["metadata"]["uid"] != old["metadata"]["uid"]
    assert not applied.obj["metadata"].get("deletionTimestamp")
    delete_dgd(api, "being-deleted", "default")


def test_ready_when_all_three_gates_pass(api: Any, dynamo_sim: Any, kube_server: Any) -> None:
    deploy(api, "ok-graph")
    seen: list[dynamo.DgdReadiness] = []
    start = time.monotonic()
    ready = wait_dgd_ready(api, "ok-graph", "default", 20, on_change=seen.append)
    assert ready.ready and ready.state == "successful" and ready.frontend_status == 200
    assert ready.pods_total >= 2 and ready.pods_ready == ready.pods_total
    assert time.monotonic() - start < 10
    assert seen[-1].ready and not seen[0].ready  # progress was reported along the way
    delete_dgd(api, "ok-graph", "default")


def test_readiness_probes_the_configured_frontend_port(api: Any, dynamo_sim: Any) -> None:
    """NeMo-RL's dynamo_cfg `frontend_port` "(default 8000)": a frontend moved to 9000 (its
    --http-port) is probed there; probing 8000 would never see it answer."""
    moved = deep_merge(agg(), {"spec": {"services": {"Frontend": {"extraPodSpec": {
        "mainContainer": {"args": ["--http-port", "9000"]}}}}}})  # fmt: skip
    deploy(api, "port-9000", moved)
    ready = wait_dgd_ready(api, "port-9000", "default", 20, port=9000)
    assert ready.ready and ready.frontend_status == 200
    with pytest.raises(DgdNotReady, match="frontend"):
        wait_dgd_ready(api, "port-9000", "default", 1.5, port=8000)
    delete_dgd(api, "port-9000", "default")


def test_failed_state_raises_at_once_with_the_operator_message(api: Any, dynamo_sim: Any) -> None:
    dynamo_sim.configure("broken", fail=True, fail_message="image pull failed for worker")
    deploy(api, "broken")
    start = time.monotonic()
    with pytest.raises(DgdFailed, match=r"broken.*image pull failed for worker"):
        wait_dgd_ready(api, "broken", "default", 30)
    assert time.monotonic() - start < 10
    delete_dgd(api, "broken", "default")


def test_pods_not_ready_alone_keeps_it_not_ready(api: Any, dynamo_sim: Any) -> None:
    dynamo_sim.configure("slow-pods", pods_ready=False)
    deploy(api, "slow-pods")
    with pytest.raises(DgdNotReady, match=r"not ready after 1.5s: .*0/\d+ pods Ready") as info:
        wait_dgd_ready(api, "slow-pods", "default", 1.5)
    assert "status.state" not in str(info.value) or "successful" in str(info.value)
    delete_dgd(api, "slow-pods", "default")


GPU_SHORT = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def test_unschedulable_pods_are_queued_and_the_wait_is_not_timeout_time(
    api: Any, dynamo_sim: Any
) -> None:
    """Rule (Kubernetes, Pod Lifecycle): PodScheduled False with reason Unschedulable means
    "the scheduler cannot schedule the Pod right now, for example due to lack of resources":
    the DGD waits for capacity (queued, with the scheduler's message), it is not "not ready";
    that wait does not count against timeout_s (here shorter than the wait)."""
    dynamo_sim.configure("no-gpus", unschedulable=GPU_SHORT)
    deploy(api, "no-gpus")
    seen: list[dynamo.DgdReadiness] = []

    def capacity_frees() -> None:
        wait_until(lambda: any(s.queued for s in seen), timeout_s=20)
        time.sleep(2.5)
        dynamo_sim.configure("no-gpus")

    freer = threading.Thread(target=capacity_frees, daemon=True)
    freer.start()
    start = time.monotonic()
    ready = wait_dgd_ready(api, "no-gpus", "default", 2.0, on_change=seen.append)
    freer.join()
    assert ready.ready and not ready.queued and time.monotonic() - start > 2.5
    queued = next(s for s in seen if s.queued)
    assert "Unschedulable" in queued.queued and GPU_SHORT in queued.queued
    assert queued.state == "pending"  # the operator's state: queued is ours to tell
    delete_dgd(api, "no-gpus", "default")


def test_queue_timeout_ends_a_dgd_queued_for_capacity(api: Any, dynamo_sim: Any) -> None:
    """Rule: `queue_timeout_s` bounds the wait in the queue, and the error names the reason;
    a readiness timeout meanwhile says the DGD is queued, not only which gates are unmet."""
    dynamo_sim.configure("never-fits", unschedulable=GPU_SHORT)
    deploy(api, "never-fits")
    start = time.monotonic()
    with pytest.raises(DgdQueueTimedOut, match=r"never-fits.*queue_timeout_s of 1s.*Insufficient"):
        wait_dgd_ready(api, "never-fits", "default", 30, queue_timeout_s=1)
    assert time.monotonic() - start < 10
    delete_dgd(api, "never-fits", "default")


def test_insufficient_capacity_condition_is_queued() -> None:
    """Rule: a DGD condition with Dynamo's insufficient_capacity reason is a wait for capacity;
    other pending reasons (some_resources_are_not_ready) are not."""
    waiting = {"status": {"state": "pending", "conditions": [{"type": "Ready", "status": "False",
               "reason": "insufficient_capacity", "message": "need 8 GPUs, 0 free"}]}}  # fmt: skip
    assert queued_reason(waiting, []) == "insufficient_capacity: need 8 GPUs, 0 free"
    starting = {"status": {"state": "pending", "conditions": [{"type": "Ready", "status": "False",
                "reason": "some_resources_are_not_ready", "message": "pods"}]}}  # fmt: skip
    assert queued_reason(starting, []) == ""


@pytest.mark.parametrize(
    ("mode", "expect"),
    [
        ("503", "frontend answered HTTP 503"),
        ("502", "frontend answered HTTP 502"),
        ("refused", "frontend"),
    ],
)
def test_frontend_down_alone_keeps_it_not_ready(
    api: Any, dynamo_sim: Any, mode: str, expect: str
) -> None:
    name = f"front-{mode}"
    dynamo_sim.configure(name, frontend=mode)
    deploy(api, name)
    with pytest.raises(DgdNotReady) as info:
        wait_dgd_ready(api, name, "default", 1.5, probe_interval_s=0.2)
    message = str(info.value)
    assert expect in message
    assert "pods Ready" not in message and "status.state" not in message  # only this gate
    delete_dgd(api, name, "default")


def test_frontend_404_counts_as_up(api: Any, dynamo_sim: Any) -> None:
    dynamo_sim.configure("front-404", frontend="404")
    deploy(api, "front-404")
    ready = wait_dgd_ready(api, "front-404", "default", 20)
    assert ready.ready and ready.frontend_status == 404
    delete_dgd(api, "front-404", "default")


def test_waiting_is_watch_driven_and_survives_dropped_watches(
    api: Any, dynamo_sim: Any, kube_server: Any
) -> None:
    dynamo_sim.configure("dropped", start_delay_s=2.0)
    deploy(api, "dropped")
    kube_server.requests.clear()
    dropper = threading.Timer(0.7, kube_server.drop_watches)
    dropper.start()
    ready = wait_dgd_ready(api, "dropped", "default", 20)
    dropper.join()
    assert ready.ready
    # ~2 s of waiting on a watch (the simulator lists with the same selector, so count the
    # watches, which only we open): the first one, and one resumed after the drop
    watches = kube_server.requests.entries
    mine = [
        e
        for e in watches
        if e.is_watch and e.query.get("labelSelector") == f"{dynamo.GRAPH_LABEL}=dropped"
    ]
    assert 2 <= len(mine) <= 3, mine
    assert mine[1].query.get("resourceVersion"), "resumed where it left off"
    delete_dgd(api, "dropped", "default")


def test_deleted_while_waiting_fails_fast(api: Any, dynamo_sim: Any) -> None:
    dynamo_sim.configure("vanishing", start_delay_s=30)
    deploy(api, "vanishing")
    threading.Timer(0.5, delete_dgd, args=(api, "vanishing", "default")).start()
    with pytest.raises(DgdFailed, match=r"does not exist \(deleted while"):
        wait_dgd_ready(api, "vanishing", "default", 20)


def test_no_right_to_watch_pods_fails_fast(api: Any, dynamo_sim: Any, kube_server: Any) -> None:
    from prefect_nemo.errors import AuthenticationFailed

    deploy(api, "no-pods-right")
    kube_server.forbid("list", "pods")
    try:
        start = time.monotonic()
        with pytest.raises(AuthenticationFailed, match="not allowed to list pods"):
            wait_dgd_ready(api, "no-pods-right", "default", 20)
        assert time.monotonic() - start < 10
    finally:
        kube_server.allow("list", "pods")
    delete_dgd(api, "no-pods-right", "default")


def test_owner_reference_cascade_deletes_the_dgd_with_the_raycluster(
    api: Any, kube_server: Any
) -> None:
    from prefect_nemo.kube import RAY_CLUSTER

    raycluster = api.create(
        RAY_CLUSTER,
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {"name": "trainer-abcde", "namespace": "default"},
            "spec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]
                        }
                    },
                }
            },
        },
    )
    deploy(api, "owned")
    patched = own_by(api, "owned", "default", raycluster)
    refs = patched["metadata"]["ownerReferences"]
    assert refs == [
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "name": "trainer-abcde",
            "uid": raycluster["metadata"]["uid"],
            "controller": False,
            "blockOwnerDeletion": False,
        }
    ]
    assert own_by(api, "owned", "default", raycluster)["metadata"]["ownerReferences"] == refs
    api.delete(RAY_CLUSTER, "trainer-abcde", "default")
    deadline = time.monotonic() + 10
    while api.get(dynamo.dgd_kind(), "owned", "default") is not None:
        assert time.monotonic() < deadline, "the DGD outlived its RayCluster owner"
        time.sleep(0.1)


def test_an_owner_in_another_namespace_is_refused_before_any_patch(api: Any) -> None:
    """Kubernetes: "A namespaced owner must exist in the same namespace as the dependent. If it
    does not, the owner reference is treated as absent, and the dependent is subject to
    deletion": own_by refuses such an owner, naming both namespaces, and patches nothing."""
    deploy(api, "lonely")
    meta = {"name": "trainer-x", "namespace": "training", "uid": "u-1"}
    elsewhere = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta}
    with pytest.raises(InvalidJobSpec, match=r"namespace 'training'.*namespace 'default'"):
        own_by(api, "lonely", "default", elsewhere)
    assert not api.get(dynamo.dgd_kind(), "lonely", "default")["metadata"].get("ownerReferences")
    delete_dgd(api, "lonely", "default")


# ---------------------------------------------------------------------------------------------
# The tee wrapper keeps the exit status (dash has no pipefail)


def shells() -> list[str]:
    found = ["/bin/sh"]
    if shutil.which("dash"):
        found.append(shutil.which("dash") or "dash")
    return found


@pytest.mark.parametrize("shell", shells())
@pytest.mark.parametrize(
    ("command", "code", "output"),
    [
        ("echo out; echo err >&2", 0, "out\nerr\n"),
        ("echo before-fail; exit 1", 1, "before-fail\n"),
        ("false", 1, ""),
        ("echo three # trailing comment", 0, "three\n"),
        ("printf 'x\\n'; exit 3", 3, "x\n"),
        ("echo dying; sh -c 'kill -9 $$'", 137, "dying\n"),
        ('echo "it\'s quoted"; exit 4', 4, "it's quoted\n"),
        # several lines, a comment, a literal backslash-n, "$VAR": all survive the one-liner
        (
            "printf '%s\\n' 'two\\nlines' # c\ntest -n \"$HOME\" || exit 9\nexit 5",
            5,
            "two\\nlines\n",
        ),
    ],
)
def test_tee_command_keeps_exit_status_and_output(
    tmp_path: Path, shell: str, command: str, code: int, output: str
) -> None:
    log = tmp_path / "logs dir" / "job's.log"
    script = tee_command(command, str(log))
    proc = subprocess.run([shell, "-c", script], capture_output=True, text=True, timeout=20)
    assert proc.returncode == code
    assert proc.stdout.startswith(output)  # dash prints "Killed" after a SIGKILL
    assert log.read_text().startswith(output)


def test_plain_pipe_to_tee_loses_the_status_under_dash(tmp_path: Path) -> None:
    """What the source PR did; kept as the reason for tee_command."""
    proc = subprocess.run(
        ["/bin/sh", "-c", f"(exit 3) 2>&1 | tee {tmp_path / 'l'}"], capture_output=True, timeout=10
    )
    assert proc.returncode == 0


def test_tee_command_does_not_wait_for_detached_children(tmp_path: Path) -> None:
    script = tee_command("(sleep 30 >/dev/null 2>&1 &); exit 5", str(tmp_path / "l.log"))
    start = time.monotonic()
    proc = subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=20)
    assert proc.returncode == 5 and time.monotonic() - start < 5


def test_tee_command_is_one_line() -> None:
    """Entrypoints travel through other shells (KubeRay's submitter): no newlines."""
    assert "\n" not in tee_command("echo a\necho b # c", "/tmp/x.log")


def test_tee_command_refuses_empty_input() -> None:
    with pytest.raises(ValueError, match=r"command is empty"):
        tee_command("  ", "/tmp/x.log")
