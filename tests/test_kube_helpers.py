"""The shared Kubernetes helpers and the KubernetesCluster block, against the loopback API server
driven by the real `kubernetes` client."""

from __future__ import annotations

import base64
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefect_nemo import kube
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.errors import AuthenticationFailed, InvalidJobSpec, PrefectNemoError
from prefect_nemo.names import resource_name
from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackKubeServer]:
    with LoopbackKubeServer(crds=[crd_dir()], tls=True) as srv:
        yield srv


@pytest.fixture
def api(server: LoopbackKubeServer) -> kube.KubeApi:
    return KubernetesCluster(kubeconfig=server.kubeconfig()).api()


def configmap(name: str, **data: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": kube.managed_labels("run-1")},
        "data": data,
    }


def rayjob(name: str, **spec: object) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name},
        "spec": {"entrypoint": "echo hi", "clusterSelector": {"ray.io/cluster": "rc"}, **spec},
    }


def later(seconds: float, action) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "max_len"),
    [("Train_Job.v2", 63), ("a" * 80, 47), ("9lives", 63), ("ok-name", 63), ("-x-", 20)],
)
def test_resource_name_is_valid_and_stable(text: str, max_len: int) -> None:
    name = resource_name(text, max_len)
    assert len(name) <= max_len
    assert name[0].isalpha() and name[-1].isalnum()
    assert all(c.isdigit() or c == "-" or "a" <= c <= "z" for c in name)
    assert resource_name(text, max_len) == name


def test_resource_name_keeps_valid_names_and_separates_collisions() -> None:
    assert resource_name("ok-name") == "ok-name"
    assert resource_name("a_b") != resource_name("a.b")  # both sanitise to a-b: the hash tells


# -- KubeApi --------------------------------------------------------------------------------------


def test_crud_and_errors_map_to_our_hierarchy(api: kube.KubeApi) -> None:
    assert api.get(kube.CONFIGMAP, "missing") is None
    created = api.create(kube.CONFIGMAP, configmap("crud", a="1"))
    assert created["metadata"]["uid"]
    with pytest.raises(kube.AlreadyExists):
        api.create(kube.CONFIGMAP, configmap("crud", a="1"))
    stale = dict(created, data={"a": "2"})
    api.replace(kube.CONFIGMAP, stale)
    with pytest.raises(kube.Conflict):
        api.replace(kube.CONFIGMAP, dict(created, data={"a": "3"}))  # its resourceVersion is old
    items, version = api.list(kube.CONFIGMAP, label_selector="prefect.io/flow-run-id=run-1")
    assert "crud" in {i["metadata"]["name"] for i in items} and version
    assert api.delete(kube.CONFIGMAP, "crud") is True
    assert api.delete(kube.CONFIGMAP, "crud") is False


def test_invalid_manifest_names_the_field(api: kube.KubeApi) -> None:
    with pytest.raises(kube.Invalid, match=r"spec\.entrypointTypo") as info:
        api.create(kube.RAY_JOB, rayjob("typo", entrypointTypo="x"))
    assert isinstance(info.value, InvalidJobSpec)


def test_wrong_token_and_forbidden_are_authentication_errors(
    server: LoopbackKubeServer, api: kube.KubeApi
) -> None:
    config = server.kubeconfig()
    config["users"][0]["user"]["token"] = "wrong-token"
    block = KubernetesCluster(kubeconfig=config)
    with pytest.raises(AuthenticationFailed, match="rejected our credentials") as info:
        block.api().list(kube.POD)
    # the message says which block and field to fix, never the token
    assert "the kubeconfig field of KubernetesCluster" in str(info.value)
    assert "wrong-token" not in str(info.value)
    block._block_document_name, block._is_anonymous = "prod", False  # as when saved or loaded
    with pytest.raises(AuthenticationFailed, match="kubeconfig field of KubernetesCluster 'prod'"):
        block.api().list(kube.POD)
    server.forbid("list", "secrets")
    with pytest.raises(AuthenticationFailed, match="not allowed to list secrets"):
        api.list(kube.SECRET)


def test_unknown_kind_is_a_clear_error() -> None:
    with pytest.raises(InvalidJobSpec, match="not a kind prefect-nemo manages"):
        kube.kind_for({"apiVersion": "apps/v1", "kind": "Deployment"})


# -- apply_or_attach and owner references ---------------------------------------------------------


def test_apply_or_attach_outcomes(api: kube.KubeApi) -> None:
    first = kube.apply_or_attach(api, configmap("applied", a="1"))
    assert first.outcome == "created" and first.created
    again = kube.apply_or_attach(api, configmap("applied", a="1"))
    assert again.outcome == "attached" and not again.created
    assert again.obj["metadata"]["uid"] == first.obj["metadata"]["uid"]
    drifted = kube.apply_or_attach(api, configmap("applied", a="2"))
    assert drifted.outcome == "drifted" and "different spec" in (drifted.drift or "")
    assert drifted.obj["data"] == {"a": "1"}  # a live object is never changed in place
    recreated = kube.apply_or_attach(api, configmap("applied", a="2"), recreate=True)
    assert recreated.outcome == "recreated" and recreated.created
    assert recreated.obj["data"] == {"a": "2"}
    assert recreated.obj["metadata"]["uid"] != first.obj["metadata"]["uid"]


def test_owner_reference_cascades_and_is_idempotent(api: kube.KubeApi) -> None:
    owner = api.create(kube.CONFIGMAP, configmap("owner"))
    api.create(kube.RAY_JOB, rayjob("owned"))
    kube.add_owner_reference(api, kube.RAY_JOB, "owned", owner)
    again = kube.add_owner_reference(api, kube.RAY_JOB, "owned", owner)
    refs = again["metadata"]["ownerReferences"]
    assert len(refs) == 1 and refs[0]["controller"] is False
    api.delete(kube.CONFIGMAP, "owner")
    assert kube.wait_for(api, kube.RAY_JOB, "owned", lambda o: o is None, timeout_s=10) is None


def test_owner_reference_survives_a_concurrent_change_of_the_object(
    server: LoopbackKubeServer,
) -> None:
    """An operator writing the object between our read and our patch makes the patch a
    409 Conflict (its resourceVersion is stale); we read again and retry, as client-go's
    `retry.RetryOnConflict` does, so the ref is added and the other writer's change kept."""

    class RacedApi(kube.KubeApi):
        races = 1  # how many of our reads another writer follows with a change of its own

        def get(self, kind: kube.Kind, name: str, namespace: str | None = None) -> Any:
            obj = super().get(kind, name, namespace)
            if kind is kube.RAY_JOB and self.races > 0:
                self.races -= 1
                label = {"metadata": {"labels": {"raced": str(self.races)}}}
                other.patch(kube.RAY_JOB, name, label)
            return obj

    other = KubernetesCluster(kubeconfig=server.kubeconfig()).api()
    raced = RacedApi(other.api_client)
    owner = raced.create(kube.CONFIGMAP, configmap("racing-owner"))
    raced.create(kube.RAY_JOB, rayjob("raced"))
    got = kube.add_owner_reference(raced, kube.RAY_JOB, "raced", owner)
    assert [r["uid"] for r in got["metadata"]["ownerReferences"]] == [owner["metadata"]["uid"]]
    assert got["metadata"]["labels"]["raced"] == "0"  # the other writer's change is kept

    raced.races = kube.apply.OWNER_PATCH_ATTEMPTS  # an object that changes on every read
    second = raced.create(kube.CONFIGMAP, configmap("racing-owner-2"))
    with pytest.raises(kube.Conflict):
        kube.add_owner_reference(raced, kube.RAY_JOB, "raced", second)


# -- waiting by watch -----------------------------------------------------------------------------


def test_wait_for_follows_a_watch_and_survives_drops(
    server: LoopbackKubeServer, api: kube.KubeApi
) -> None:
    api.create(kube.RAY_JOB, rayjob("waited"))
    running = {"status": {"jobStatus": "RUNNING"}}
    later(0.3, server.drop_watches)  # the stream breaks: resume from the last version
    later(0.6, server.compact)  # history forgotten: the next resume gets 410, so list again
    later(0.9, lambda: api.patch(kube.RAY_JOB, "waited", running, subresource="status"))
    server.requests.clear()
    got = kube.wait_for(
        api, kube.RAY_JOB, "waited",
        lambda o: bool(o) and o.get("status", {}).get("jobStatus") == "RUNNING", timeout_s=10,
    )  # fmt: skip
    assert got is not None and got["status"]["jobStatus"] == "RUNNING"
    gets = server.requests.count(method="GET", path_contains="/rayjobs", watch=False)
    assert gets <= 3  # lists (first + after 410), not a polling loop


def test_wait_for_times_out_naming_the_wait_and_the_last_state(api: kube.KubeApi) -> None:
    with pytest.raises(kube.KubeTimeout, match=r"waiting for zz to appear; last seen: absent"):
        kube.wait_for(api, kube.RAY_JOB, "zz", lambda o: o is not None, timeout_s=1.0,
                      what="zz to appear")  # fmt: skip


def test_wait_for_predicate_can_fail_fast(api: kube.KubeApi) -> None:
    api.create(kube.RAY_JOB, rayjob("doomed"))
    failed = {"status": {"jobDeploymentStatus": "Failed", "message": "boom"}}
    api.patch(kube.RAY_JOB, "doomed", failed, subresource="status")

    def ready(obj: dict | None) -> bool:
        if obj and obj.get("status", {}).get("jobDeploymentStatus") == "Failed":
            raise PrefectNemoError(obj["status"]["message"])
        return False

    started = time.monotonic()
    with pytest.raises(PrefectNemoError, match="boom"):
        kube.wait_for(api, kube.RAY_JOB, "doomed", ready, timeout_s=30)
    assert time.monotonic() - started < 5


def test_informer_caches_and_calls_back(server: LoopbackKubeServer, api: kube.KubeApi) -> None:
    changes: list[tuple[str, str]] = []
    seen = threading.Event()

    def on_change(event: str, obj: dict) -> None:
        changes.append((event, obj["metadata"]["name"]))
        if event == "DELETED":
            seen.set()

    informer = kube.Informer(api, kube.RAY_JOB, label_selector="team=a", on_change=on_change)
    informer.start()
    try:
        assert informer.synced.wait(5)
        api.create(
            kube.RAY_JOB, {**rayjob("inf"), "metadata": {"name": "inf", "labels": {"team": "a"}}}
        )
        api.create(kube.RAY_JOB, rayjob("not-mine"))
        server.drop_watches()
        api.delete(kube.RAY_JOB, "inf")
        assert seen.wait(10)
        assert ("ADDED", "inf") in changes and ("DELETED", "inf") in changes
        assert "not-mine" not in {name for _, name in changes}
        assert informer.get("inf") is None and informer.error is None
    finally:
        informer.stop()
    informer._thread.join(timeout=5)  # the watch in flight is cut, not waited out
    assert not informer._thread.is_alive()


# -- a version that falls out of the server's window: 410, list again ------------------------------


@pytest.fixture
def narrow() -> Iterator[LoopbackKubeServer]:
    """A server whose watch window keeps 3 events per resource (none counts as fresh), so a
    version expires after a few writes, with no compact() called."""
    from prefect_nemo.testing.kube_api import WatchWindow

    with LoopbackKubeServer([crd_dir()], watch_window=WatchWindow(min_events=3, fresh_s=0)) as srv:
        yield srv


def _push_out_of_window(server: LoopbackKubeServer, api: kube.KubeApi, tag: str) -> None:
    """Write 5 RayJobs nobody watches for, then cut the watches: each resumes from a version
    the window no longer holds, and the server answers 410 Gone."""
    for i in range(5):
        api.create(kube.RAY_JOB, rayjob(f"{tag}-{i}"))
    server.drop_watches()


def _lists(server: LoopbackKubeServer, selector: str) -> int:
    return sum(
        1 for e in server.requests.entries
        if not e.is_watch and e.path.endswith("/rayjobs") and selector in str(e.query)
    )  # fmt: skip


def test_wait_for_lists_again_when_its_version_falls_out_of_the_window(
    narrow: LoopbackKubeServer,
) -> None:
    """A 410 forced mid-wait, as a real server gives it: wait_for's field-selected watch sees
    none of the other RayJobs' events, so its version falls out of the server's window; when
    the stream drops, the resume answers 410 and wait_for lists again (a second list), then
    sees the awaited status. Kubernetes API concepts, "Efficient detection of changes": "When
    the requested watch operations fail because the historical version of that resource is not
    available, clients must handle the case by recognizing the status code 410 Gone, clearing
    their local cache, performing a new get or list operation, and starting the watch from the
    resourceVersion that was returned."""
    api = KubernetesCluster(kubeconfig=narrow.kubeconfig()).api()
    api.create(kube.RAY_JOB, rayjob("waited"))

    def go() -> None:
        _push_out_of_window(narrow, api, "noise")
        api.patch(
            kube.RAY_JOB, "waited", {"status": {"jobStatus": "RUNNING"}}, subresource="status"
        )

    later(0.5, go)
    got = kube.wait_for(
        api, kube.RAY_JOB, "waited",
        lambda o: bool(o) and o.get("status", {}).get("jobStatus") == "RUNNING", timeout_s=20,
    )  # fmt: skip
    assert got is not None and got["status"]["jobStatus"] == "RUNNING"
    assert _lists(narrow, "metadata.name=waited") == 2  # the first list, and the one after 410


def test_an_informer_lists_again_when_its_version_falls_out_of_the_window(
    narrow: LoopbackKubeServer,
) -> None:
    """The same for the Informer behind every job backend's waits: its label-selected watch
    sees none of the unlabelled RayJobs' events; after the drop its resume answers 410, it lists
    again (without an error), and it still sees later changes (a DELETED). Kubernetes API
    concepts, "Efficient detection of changes": "clients must handle the case by recognizing the
    status code 410 Gone, clearing their local cache, performing a new get or list operation,
    and starting the watch from the resourceVersion that was returned."""
    api = KubernetesCluster(kubeconfig=narrow.kubeconfig()).api()
    deleted = threading.Event()

    def on_change(event: str, obj: dict) -> None:
        if event == "DELETED" and obj["metadata"]["name"] == "mine":
            deleted.set()

    informer = kube.Informer(api, kube.RAY_JOB, label_selector="team=a", on_change=on_change)
    informer.start()
    try:
        assert informer.synced.wait(5)
        api.create(
            kube.RAY_JOB, {**rayjob("mine"), "metadata": {"name": "mine", "labels": {"team": "a"}}}
        )
        assert _wait(lambda: informer.get("mine") is not None)
        _push_out_of_window(narrow, api, "theirs")
        assert _wait(lambda: _lists(narrow, "team=a") == 2), "the informer did not list again"
        api.delete(kube.RAY_JOB, "mine")
        assert deleted.wait(10) and informer.get("mine") is None
        assert informer.error is None and not informer.dead
    finally:
        informer.stop(wait_s=5)


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


# -- service proxy --------------------------------------------------------------------------------


def test_proxy_returns_statuses_and_never_raises(
    server: LoopbackKubeServer, api: kube.KubeApi
) -> None:
    for name in ("echo", "no-endpoints"):
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {"ports": [{"name": "http", "port": 8000}]},
        }
        api.create(kube.SERVICE, service)
    server.set_service_proxy(
        "default",
        "echo",
        8000,
        lambda method, path, headers, body: (200, {}, f"{method} {path}".encode()),
    )
    assert api.proxy("default", "echo", 8000, "/v1/models?x=1") == (200, b"GET /v1/models?x=1")
    assert api.proxy("default", "no-endpoints", 8000, "/")[0] == 503
    assert api.proxy("default", "no-such-service", 8000, "/")[0] == 404
    url = api.proxy_url("ns", "svc", 8265)
    assert url.endswith("/api/v1/namespaces/ns/services/svc:8265/proxy")


# -- the block never writes credentials to disk ---------------------------------------------------


def test_block_keeps_certificates_and_token_off_disk(server: LoopbackKubeServer) -> None:
    config = server.kubeconfig()
    ca = base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"])
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.iterdir())
    api = KubernetesCluster(kubeconfig=config, namespace="default").api()
    api.list(kube.CONFIGMAP)  # TLS verified against the in-memory CA
    new_files = [p for p in set(tmp.iterdir()) - before if p.is_file()]
    leaked = [
        p for p in new_files if ca in p.read_bytes() or server.token.encode() in p.read_bytes()
    ]
    assert not leaked
    assert api.host.startswith("https://") and api.secrets and server.token in api.secrets[-1]
    block = KubernetesCluster(kubeconfig=config)
    assert server.token not in repr(block) and server.token not in str(block.model_dump())


def test_block_without_kubeconfig_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(InvalidJobSpec, match=r"KubernetesCluster\.kubeconfig"):
        KubernetesCluster().api()
    assert not os.path.exists(tmp_path / "absent")


def test_a_streamed_log_is_remembered_whole_and_the_longest_log_wins() -> None:
    """A KubeRay job's log stays readable after teardown took its Ray head away: the backend
    remembers the longest log it read whole or streamed. A streamed one is kept as its chunks
    and joined when read (joining at every chunk copied the whole log again per chunk: a chatty
    job's stream cost grew with the square of its log)."""
    from prefect_nemo.backends._kube_objects import JobMemory

    memory, key = JobMemory(max_logs=2), ("cluster", "job")
    assert memory.last_log(key) is None
    streamed = memory.stream_log(key)
    for n in range(1000):
        streamed.add(f"line {n}\n")
    whole = "".join(f"line {n}\n" for n in range(1000))
    assert memory.last_log(key) == whole
    assert memory.remember_log(key, "line 0\n") == whole, "a shorter read does not replace it"
    assert memory.remember_log(key, whole + "line 1000\n") == whole + "line 1000\n"

    again = memory.stream_log(key)  # a broken stream is tailed again from the top
    again.add("line 0\n")
    assert memory.last_log(key) == whole + "line 1000\n", "what was gathered before stays"
    again.add(whole[len("line 0\n") :] + "line 1000\nline 1001\n")
    assert memory.last_log(key) == whole + "line 1000\nline 1001\n"

    for other in ("a", "b"):  # bounded: the oldest jobs' logs go, read and streamed alike
        memory.remember_log(("cluster", other), other)
        memory.stream_log(("cluster", other)).add(other)
    assert memory.last_log(key) is None
