"""Bad input is refused with a message that names the field and the fix, and submits nothing.

Errors raised while a JobSpec (or a block) is built need no cluster; errors raised inside
run_job are checked inside a real flow against the session's Ray cluster and Prefect API, and
there we also make sure the cluster's job list did not grow.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from pydantic import SecretStr, ValidationError

from prefect_nemo import InvalidJobSpec, JobSpec, Resources, run_job
from prefect_nemo.blocks import RayJobsCluster
from prefect_nemo.jobs import MAX_ENTRYPOINT_CHARS
from tests.conftest import jobs_of_run

slow = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# JobSpec construction: no cluster, no server


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        pytest.param(
            {"entrypoint": ""},
            r"JobSpec\.entrypoint: must be a non-empty shell command, e\.g\. 'python train\.py'",
            id="empty-entrypoint",
        ),
        pytest.param(
            {"entrypoint": " \t\n "},
            r"JobSpec\.entrypoint: must be a non-empty shell command",
            id="blank-entrypoint",
        ),
        pytest.param(
            {"entrypoint": "echo a\x00b"},
            r"JobSpec\.entrypoint: contains a NUL byte.*remove it",
            id="nul-in-entrypoint",
        ),
        pytest.param(
            {"entrypoint": "x" * (MAX_ENTRYPOINT_CHARS + 1)},
            rf"JobSpec\.entrypoint: is {MAX_ENTRYPOINT_CHARS + 1} characters; the limit is "
            rf"{MAX_ENTRYPOINT_CHARS}.*ship large inputs through working_dir instead",
            id="entrypoint-too-long",
        ),
        pytest.param(
            {"entrypoint": 42},
            r"JobSpec\.entrypoint: Input should be a valid string",
            id="entrypoint-not-a-string",
        ),
        pytest.param(
            {"entrypont": "python train.py"},
            r"JobSpec\.entrypont: unknown field: check the spelling",
            id="typo-in-field-name",
        ),
        pytest.param(
            {"entrypoint": "true", "resources": {"cpus": -1}},
            r"JobSpec\.resources\.cpus: Input should be greater than or equal to 0",
            id="negative-cpus",
        ),
        pytest.param(
            {"entrypoint": "true", "resources": {"gpus": -0.5}},
            r"JobSpec\.resources\.gpus: Input should be greater than or equal to 0",
            id="negative-gpus",
        ),
        pytest.param(
            {"entrypoint": "true", "resources": {"memory_bytes": -1}},
            r"JobSpec\.resources\.memory_bytes: Input should be greater than or equal to 0",
            id="negative-memory",
        ),
        pytest.param(
            {"entrypoint": "true", "resources": {"custom": {"TPU": -1}}},
            r"JobSpec\.resources\.custom: custom resource 'TPU' is -1\.0: use a finite number >= 0",
            id="negative-custom-resource",
        ),
        pytest.param(
            {"entrypoint": "true", "resources": {"custom": {"  ": 1}}},
            r"JobSpec\.resources\.custom: custom resource names must be non-empty",
            id="blank-custom-resource-name",
        ),
        pytest.param(
            {"entrypoint": "true", "resources": {"cpu": 1}},
            r"JobSpec\.resources\.cpu: unknown field: check the spelling",
            id="typo-in-nested-field-name",
        ),
        pytest.param(
            {"entrypoint": "true", "metadata": {"epoch": 3}},
            r"JobSpec\.metadata\.epoch: Input should be a valid string",
            id="non-string-metadata-value",
        ),
        pytest.param(
            {"entrypoint": "true", "metadata": {"prefect_nemo.key": "mine"}},
            r"JobSpec\.metadata: key 'prefect_nemo\.key' is reserved for prefect-nemo: "
            r"pick another key",
            id="reserved-metadata-key",
        ),
        pytest.param(
            {"entrypoint": "true", "labels": {"team": 7}},
            r"JobSpec\.labels\.team: Input should be a valid string",
            id="non-string-label-value",
        ),
        pytest.param(
            {"entrypoint": "true", "env": {"1BAD": "x"}},
            r"JobSpec\.env: '1BAD' is not a valid environment variable name: use letters, "
            r"digits and '_', not starting with a digit",
            id="env-name-starts-with-digit",
        ),
        pytest.param(
            {"entrypoint": "true", "env": {"A-B": "x"}},
            r"JobSpec\.env: 'A-B' is not a valid environment variable name",
            id="env-name-with-dash",
        ),
        pytest.param(
            {"entrypoint": "true", "env": {"EPOCHS": 3}},
            r"JobSpec\.env: value of 'EPOCHS' is a int: use a string",
            id="non-string-env-value",
        ),
        pytest.param(
            {"entrypoint": "true", "runtime_env": {"working_dir": "."}},
            r"JobSpec\.runtime_env: set JobSpec\.working_dir instead of "
            r"runtime_env\['working_dir'\]",
            id="runtime-env-working-dir",
        ),
        pytest.param(
            {"entrypoint": "true", "runtime_env": {"env_vars": {"A": "1"}}},
            r"JobSpec\.runtime_env: set JobSpec\.env instead of runtime_env\['env_vars'\]",
            id="runtime-env-env-vars",
        ),
        pytest.param(
            {"entrypoint": "true", "name": "has space"},
            r"JobSpec\.name: 'has space' is not a valid job name: use 1-63 letters, digits, "
            r"'\.', '_' or '-', starting with a letter or digit",
            id="job-name-with-space",
        ),
        pytest.param(
            {"entrypoint": "true", "name": "a" * 64},
            r"JobSpec\.name: 'a{64}' is not a valid job name: use 1-63 letters",
            id="job-name-too-long",
        ),
        pytest.param(
            {"entrypoint": "true", "name": "-leading-dash"},
            r"JobSpec\.name: '-leading-dash' is not a valid job name.*starting with a letter",
            id="job-name-leading-dash",
        ),
        pytest.param(
            {"entrypoint": "true", "name": ""},
            r"JobSpec\.name: '' is not a valid job name",
            id="job-name-empty",
        ),
        pytest.param(
            {"entrypoint": "true", "timeout_s": 0},
            r"JobSpec\.timeout_s: Input should be greater than 0",
            id="timeout-zero",
        ),
        pytest.param(
            {"entrypoint": "true", "timeout_s": -5},
            r"JobSpec\.timeout_s: Input should be greater than 0",
            id="timeout-negative",
        ),
        pytest.param(
            {"entrypoint": "true", "timeout_s": float("nan")},
            r"JobSpec\.timeout_s: Input should be greater than 0",
            id="timeout-nan",
        ),
        pytest.param(
            {"entrypoint": "true", "queue_timeout_s": -1},
            r"JobSpec\.queue_timeout_s: Input should be greater than 0",
            id="queue-timeout-negative",
        ),
        pytest.param(
            {"entrypoint": "true", "queue_timeout_s": 0},
            r"JobSpec\.queue_timeout_s: Input should be greater than 0",
            id="queue-timeout-zero",
        ),
        pytest.param(
            {"entrypoint": "true", "exclude": "*.ckpt"},
            r"JobSpec\.exclude: Input should be a valid tuple",
            id="exclude-as-one-string",
        ),
    ],
)
def test_bad_job_spec_is_refused_naming_field_and_fix(fields: dict[str, Any], match: str):
    with pytest.raises(InvalidJobSpec, match=match) as info:
        JobSpec(**fields)
    message = str(info.value)
    assert message.startswith("invalid job configuration:")
    assert "errors.pydantic.dev" not in message, "no pydantic URLs in our messages"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_invalid_job_spec_is_a_value_error_and_lists_every_bad_field():
    """Several mistakes at once are all reported, one line each, so one fix round suffices."""
    with pytest.raises(ValueError) as info:  # InvalidJobSpec is also a ValueError
        JobSpec(entrypoint="", name="has space", timeout_s=0, env={"1BAD": "x"})
    assert isinstance(info.value, InvalidJobSpec)
    lines = str(info.value).splitlines()[1:]
    fields = sorted(line.strip().split(":")[0] for line in lines)
    assert fields == ["JobSpec.entrypoint", "JobSpec.env", "JobSpec.name", "JobSpec.timeout_s"]


def test_resources_built_on_their_own_name_their_own_model():
    with pytest.raises(InvalidJobSpec, match=r"Resources\.cpus: Input should be greater than"):
        Resources(cpus=-1)


def test_secret_env_value_is_not_echoed_in_the_error():
    """A bad spec carrying a secret does not leak the secret into the error message."""
    with pytest.raises(InvalidJobSpec) as info:
        JobSpec(entrypoint="", env={"TOKEN": SecretStr("s3cr3t-value")})
    assert "s3cr3t-value" not in str(info.value)


def test_non_string_env_value_message_has_no_pydantic_internals():
    with pytest.raises(InvalidJobSpec) as info:
        JobSpec(entrypoint="true", env={"EPOCHS": 3})
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"\s*JobSpec\.env: value of 'EPOCHS' .*string.*", lines[0]), lines[0]


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"custom": {"TPU": float("nan")}}, "custom"),
        ({"custom": {"TPU": float("inf")}}, "custom"),
        ({"cpus": float("inf")}, "cpus"),
        ({"gpus": float("inf")}, "gpus"),
    ],
    ids=["nan-custom", "inf-custom", "inf-cpus", "inf-gpus"],
)
def test_non_finite_resources_are_refused(resources: dict[str, Any], field: str):
    with pytest.raises(InvalidJobSpec, match=rf"JobSpec\.resources\.{field}"):
        JobSpec(entrypoint="true", resources=resources)


# ---------------------------------------------------------------------------------------------
# Cluster block construction: pydantic's own ValidationError


@pytest.mark.parametrize(
    ("fields", "field", "match"),
    [
        pytest.param(
            {"dashboard_url": "ray://x:10001"},
            "dashboard_url",
            r"'ray://x:10001' is not an http\(s\) URL: use the dashboard address, e\.g\. "
            r"http://127\.0\.0\.1:8265",
            id="ray-client-address",
        ),
        pytest.param(
            {"dashboard_url": "127.0.0.1:6379"},
            "dashboard_url",
            r"is not an http\(s\) URL.*not a ray:// or GCS address",
            id="gcs-address",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "request_timeout_s": 0},
            "request_timeout_s",
            r"greater than 0",
            id="zero-request-timeout",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "token_header": "X-Token"},
            "token_header",
            r"'Authorization' or 'X-Ray-Authorization'",
            id="unknown-token-header",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "max_concurrent_jobs": 0},
            "max_concurrent_jobs",
            r"greater than or equal to 1",
            id="zero-concurrency-cap",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "env": {"HF-HOME": "/m"}},
            "env",
            r"'HF-HOME' is not a valid environment variable name: use letters, digits and '_'",
            id="bad-env-name",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "secret_env": {"KEY": "ab1"}},
            "secret_env",
            r"value of 'KEY' is too short to be masked.*if it is no secret, put it in env",
            id="secret-too-short-to-mask",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "env": {"K": "a"}, "secret_env": {"K": "abcdef"}},
            "secret_env",
            r"K also in env: keep each variable in one of them",
            id="env-and-secret-env",
        ),
        pytest.param(
            {"dashboard_url": "http://h:8265", "image_label_selectors": {"nvcr.io/*": {}}},
            "image_label_selectors",
            r"'nvcr\.io/\*' maps to no label: give it \{label: value\}",
            id="image-without-labels",
        ),
    ],
)
def test_bad_cluster_block_is_refused(fields: dict[str, Any], field: str, match: str):
    with pytest.raises(ValidationError, match=match) as info:
        RayJobsCluster(**fields)
    assert [e["loc"][0] for e in info.value.errors()] == [field]
    assert "abcdef" not in str(info.value) and "ab1" not in str(info.value)


def test_cluster_env_in_two_places_is_refused():
    """Older documents kept the cluster's env vars in runtime_env['env_vars'] (read into env);
    the same variable in both places is refused instead of one silently winning."""
    both = r"env and runtime_env\['env_vars'\] both set HF_HOME: keep them in env only"
    with pytest.raises(ValidationError, match=both):
        RayJobsCluster(
            dashboard_url="http://h:8265",
            env={"HF_HOME": "/a"},
            runtime_env={"env_vars": {"HF_HOME": "/b"}},
        )


# ---------------------------------------------------------------------------------------------
# Through run_job inside a real flow: the error reaches the caller and nothing is submitted


def assert_refused_in_flow(ray_client, call: Callable[[], Any], match: str) -> InvalidJobSpec:
    """Run `call` inside a flow; it must raise InvalidJobSpec and submit nothing."""

    @flow(name="bad-input")
    def bad_input_flow():
        return call()

    state = bad_input_flow(return_state=True)
    with pytest.raises(InvalidJobSpec, match=match) as info:
        state.result()
    submitted = jobs_of_run(ray_client, state.state_details.flow_run_id)
    assert not submitted, f"jobs were submitted: {submitted}"
    return info.value


@slow
@pytest.mark.parametrize(
    ("spec_fields", "block_fields", "field"),
    [
        pytest.param({"label_selector": {"pool": "gpu"}}, {}, r"JobSpec\.label_selector", id="own"),
        pytest.param(
            {"placement": {"node_labels": {"pool": "gpu"}}}, {}, r"JobSpec\.placement", id="placed"
        ),
        pytest.param(
            {"runtime_env": {"image_uri": "nvcr.io/nvidia/nemo-rl:v0.6.0"}},
            {"image_label_selectors": {"nvcr.io/nvidia/nemo-rl:*": {"nemo/workload": "rl"}}},
            r"runtime_env\['image_uri'\] \(RayJobsCluster\.image_label_selectors\)",
            id="from-image",
        ),
    ],
)
def test_a_selector_the_ray_client_cannot_send_stops_the_job(
    ray_head, prefect_api, ray_client, spec_fields, block_fields, field
):
    """Ray's JobSubmissionClient.submit_job takes `entrypoint_label_selector` from 2.54.0 (the
    2.53.0 wheel's sdk.py has no such parameter); deployments of NeMo-Skills' Ray Jobs backend
    document the same floor: "The Jobs-API client must be Ray >= 2.54.0". With an older client
    a job that has a selector (its own, its placement's, or its image's) is stopped before
    anything is sent, naming the field and the version: sent without its selector it could
    land on any node."""
    from tests.old_ray import Ray253Cluster

    block = Ray253Cluster(
        dashboard_url=ray_head.dashboard_url, auth_token=ray_head.token, **block_fields
    )
    spec = JobSpec(entrypoint="true", name=f"old-ray-{uuid.uuid4().hex[:6]}", **spec_fields)
    error = assert_refused_in_flow(
        ray_client,
        lambda: run_job(spec, cluster=block),
        rf"{field}: the job needs the entrypoint label selector .*upgrade ray on this machine "
        r"to >= 2\.54\.0, or drop the selector",
    )
    assert "Ray253Client" in str(error), "the message says which client could not send it"


@slow
def test_missing_working_dir_is_refused_at_submit(cluster, prefect_api, ray_client, tmp_path):
    missing = tmp_path / "no-such-dir"
    spec = JobSpec(entrypoint="python train.py", working_dir=missing, name="missing-wd")
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(spec, cluster=cluster),
        rf"working_dir '{re.escape(str(missing))}' does not exist: pass the directory that "
        "holds your job code",
    )


@slow
def test_working_dir_that_is_a_file_is_refused(cluster, prefect_api, ray_client, tmp_path):
    file = tmp_path / "train.py"
    file.write_text("print('hi')\n")
    spec = JobSpec(entrypoint="python train.py", working_dir=file, name="file-wd")
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(spec, cluster=cluster),
        r"working_dir '.*train\.py' is not a directory: pass the directory",
    )


@slow
def test_empty_working_dir_is_refused(cluster, prefect_api, ray_client, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = JobSpec(entrypoint="python train.py", working_dir=empty, name="empty-wd")
    assert_refused_in_flow(
        ray_client, lambda: run_job(spec, cluster=cluster), r"working_dir '.*empty' contains no"
    )


@slow
def test_unserializable_runtime_env_is_refused(cluster, prefect_api, ray_client):
    spec = JobSpec(entrypoint="true", runtime_env={"pip": {object()}}, name="bad-renv")
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(spec, cluster=cluster),
        r"JobSpec\.runtime_env: must be JSON-serializable for the Ray Jobs API",
    )


@slow
def test_unknown_block_name_is_refused(prefect_api, ray_client):
    name = f"ray-jobs-cluster/does-not-exist-{uuid.uuid4().hex[:6]}"
    error = assert_refused_in_flow(
        ray_client,
        lambda: run_job(JobSpec(entrypoint="true"), cluster=name),
        rf"cluster='{re.escape(name)}': no such block document",
    )
    assert "prefect-nemo blocks apply" in str(error), "the message says how to create it"


@slow
def test_unknown_block_type_is_refused(prefect_api, ray_client):
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(JobSpec(entrypoint="true"), cluster="no-such-block-type/prod"),
        r"cluster='no-such-block-type/prod': no such block document",
    )


@slow
def test_block_that_is_not_a_cluster_is_refused(prefect_api, ray_client):
    from prefect.blocks.system import Secret

    name = f"not-a-cluster-{uuid.uuid4().hex[:6]}"
    Secret(value="whatever").save(name, overwrite=True)
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(JobSpec(entrypoint="true"), cluster=f"secret/{name}"),
        rf"cluster='secret/{name}' is a Secret, not a cluster",
    )


@slow
def test_cluster_name_without_slash_is_refused(prefect_api, ray_client):
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(JobSpec(entrypoint="true"), cluster="prod"),
        r"cluster='prod': name a saved block as '<block-type-slug>/<name>', "
        r"e\.g\. 'ray-jobs-cluster/prod'",
    )


@slow
@pytest.mark.parametrize("bad", [42, {"dashboard_url": "http://h:8265"}], ids=["int", "dict"])
def test_cluster_of_the_wrong_type_is_refused(prefect_api, ray_client, bad: object):
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(JobSpec(entrypoint="true"), cluster=bad),
        rf"cluster: expected a cluster block \(e\.g\. RayJobsCluster\), a saved block name or "
        rf"None, got {type(bad).__name__}",
    )


@slow
@pytest.mark.parametrize("bad", [{"entrypoint": "echo hi"}, "echo hi"], ids=["dict", "str"])
def test_spec_of_the_wrong_type_is_refused(cluster, prefect_api, ray_client, bad: object):
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(bad, cluster=cluster),
        rf"spec: expected a JobSpec or a NeMo-Run task, got {type(bad).__name__}",
    )


@slow
def test_bad_spec_built_inside_a_flow_fails_the_flow(cluster, prefect_api, ray_client):
    assert_refused_in_flow(
        ray_client,
        lambda: run_job(JobSpec(entrypoint="true", timeout_s=0), cluster=cluster),
        r"JobSpec\.timeout_s: Input should be greater than 0",
    )


@slow
def test_good_spec_still_runs_after_bad_ones(cluster, prefect_api, ray_client, tmp_path: Path):
    """The refusals above leave nothing behind that would stop the next good job."""
    (tmp_path / "main.py").write_text("print('fine')\n")
    spec = JobSpec(entrypoint="python main.py", working_dir=tmp_path, name="good-after-bad")

    @flow
    def good_flow():
        return run_job(spec, cluster=cluster)

    assert good_flow().succeeded


# ---------------------------------------------------------------------------------------------
# Kubernetes names and counts (issue 27): refused by blocks, renders, dry runs and real calls
# alike, before any request. test_real_control_plane.py shows the real kube-apiserver refuses
# the same namespaces and negative Deployment replicas.

BAD_NAMESPACES = ["Bad_NS!", "n" * 64]


@pytest.mark.parametrize("namespace", BAD_NAMESPACES)
def test_a_namespace_that_is_no_dns_label_is_refused_everywhere(
    kube_server: Any, namespace: str, capsys: pytest.CaptureFixture[str]
):
    from prefect_nemo.backends.kuberay import KubeRayBackend, RayJobConfig
    from prefect_nemo.blocks import KubeflowTrainerCluster, KubeRayCluster, KubernetesCluster
    from prefect_nemo.cli import main
    from prefect_nemo.tasks.dgd import deploy_dgd
    from tests.test_kuberay import cluster_spec

    fix = r"is not a Kubernetes namespace name: use a lowercase RFC 1123 label"
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    kube_server.requests.clear()
    for block, fields in [
        (KubernetesCluster, {"kubeconfig": kube_server.kubeconfig()}),
        (KubeRayCluster, {"kubernetes": kube, "ray_cluster_spec": cluster_spec()}),
        (KubeflowTrainerCluster, {"kubernetes": kube, "image": "img:1"}),
    ]:
        with pytest.raises(ValidationError, match=fix) as info:
            block(namespace=namespace, **fields)
        assert [e["loc"][0] for e in info.value.errors()] == ["namespace"]
    with pytest.raises(InvalidJobSpec, match=fix):  # a namespace handed to a backend
        KubeRayBackend(kube.api(), RayJobConfig(ray_cluster_spec=cluster_spec()),
                       namespace=namespace)  # fmt: skip
    for dry_run in (True, False):  # the dry run and the real deploy
        with pytest.raises(InvalidJobSpec, match=fix):
            deploy_dgd.fn("flows/manifests/dgd-vllm-agg.yaml", kube, namespace=namespace,
                          image="img:1", dry_run=dry_run)  # fmt: skip
    capsys.readouterr()
    render = ["render", "dgd", "flows/manifests/dgd-vllm-agg.yaml", "--namespace", namespace]
    assert main(render) != 0  # `prefect-nemo render dgd`
    assert re.search(fix, capsys.readouterr().err)
    assert kube_server.requests.entries == [], "a request went out with a bad namespace"


def test_negative_replica_counts_are_refused_before_anything_is_sent(kube_server: Any):
    """A DGD service with replicas=-1 (Kubernetes refuses such a Deployment: see
    test_real_control_plane.py) and an inline RayCluster worker group with replicas=-2. KubeRay
    (v1.6.1, utils/validation.go) refuses "worker group %s has negative minReplicas" and
    "... negative maxReplicas", and GetWorkerGroupDesiredReplicas clamps a replicas below
    minReplicas up to it ("if ... *workerGroupSpec.Replicas < minReplicas { workerReplicas =
    minReplicas }"): -2 workers would quietly run as 0."""
    from prefect_nemo.backends.kuberay import ensure_ray_cluster
    from prefect_nemo.blocks import KubeRayCluster, KubernetesCluster
    from prefect_nemo.tasks.dgd import deploy_dgd
    from tests.test_kuberay import cluster_spec

    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    kube_server.requests.clear()
    negative = {"spec": {"services": {"VllmDecodeWorker": {"replicas": -1}}}}
    for dry_run in (True, False):
        with pytest.raises(InvalidJobSpec, match=r"'VllmDecodeWorker': replicas is -1.*>= 0"):
            deploy_dgd.fn("flows/manifests/dgd-vllm-agg.yaml", kube, overrides=negative,
                          image="img:1", dry_run=dry_run)  # fmt: skip
    cases = [
        ({"replicas": -2, "minReplicas": 0}, r"workerGroupSpecs\[0\]\.replicas: -2 is negative"),
        ({"minReplicas": -1}, r"workerGroupSpecs\[0\]\.minReplicas: -1 is negative"),
        ({"minReplicas": 3, "maxReplicas": 2}, r"minReplicas 3 is greater than maxReplicas 2"),
        ({"replicas": 5, "minReplicas": 1, "maxReplicas": 2},
         r"replicas: 5 is outside \[minReplicas 1, maxReplicas 2\]; KubeRay would run 2"),
        ({"replicas": "2"}, r"replicas: '2' is not a whole number"),
    ]  # fmt: skip
    for counts, match in cases:
        spec = cluster_spec()
        group = spec["workerGroupSpecs"][0]
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key)
        group.update(counts)
        with pytest.raises(ValidationError, match=match):
            KubeRayCluster(kubernetes=kube, ray_cluster_spec=spec)
        with pytest.raises(InvalidJobSpec, match=match):
            ensure_ray_cluster(kube.api(), spec, name="negative")
    assert kube_server.requests.entries == [], "a request went out with a bad count"


@pytest.mark.parametrize("field", ["timeout_s", "queue_timeout_s"])
@pytest.mark.parametrize("value", [-1, 0, float("nan"), float("inf"), "600", True])
def test_wait_for_job_refuses_a_timeout_that_is_no_seconds(field: str, value: Any) -> None:
    """wait_for_job's own timeouts (a handle has no JobSpec to check them) are refused naming
    the parameter before any request: the cluster here answers nothing."""
    from prefect_nemo import JobHandle, RayJobsCluster, wait_for_job

    nowhere = RayJobsCluster(dashboard_url="http://127.0.0.1:9")
    handle = JobHandle(job_id="j", backend="ray-jobs", cluster="http://127.0.0.1:9")
    with pytest.raises(InvalidJobSpec, match=rf"^{field}: expected seconds > 0 \(or None"):
        wait_for_job.fn(handle, nowhere, **{field: value})
