"""The REAL KubeRay operator (v1.6.1, built from its Go module) runs our RayJobs to the end on a
real local Ray: our node agent (control_plane/node_agent.py) binds the operator's pods and runs
KubeRay's own head and submitter commands as local processes. Our block's default submission
mode, K8sJobMode, is the one tested: the operator makes a submitter Job, the Job controller its
pod, and that pod runs `ray job submit --address http://<head-svc>.kuberay.svc.cluster.local:8265`.
Ray runs with token auth, the way KubeRay documents it (authOptions with our Secret).

`python tests/test_real_kuberay.py EXPERIMENT SECONDS` runs the flow the kill -9 test kills.
"""

from __future__ import annotations

import contextvars
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prefect import flow
from pydantic import SecretStr

from prefect_nemo import JobSpec, JobState, run_job, start_experiment
from prefect_nemo.blocks import KubeRayCluster, KubernetesCluster
from prefect_nemo.testing.control_plane.run import OPERATOR_NAMESPACE
from tests.test_kuberay import (  # noqa: F401 - run_logs is a fixture
    MYMOD_ENTRYPOINT,
    gone_with_the_rayjob,
    mymod_dir,
    owned_by_rayjob,
    run_logs,
    secret_seen,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]
ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = OPERATOR_NAMESPACE  # the one namespace the operator reconciles


def head_only_spec(token_secret: str) -> dict[str, Any]:
    """One head pod, no workers, and Ray's token from our Secret (KubeRay's authOptions)."""
    return {
        "rayVersion": "2.60.0",
        "authOptions": {"mode": "token", "secretName": token_secret},
        "headGroupSpec": {
            "rayStartParams": {
                "dashboard-host": "0.0.0.0",
                "num-cpus": "1",
                "object-store-memory": "100000000",
            },
            "template": {
                "spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}
            },
        },
    }


def block_for(kubeconfig: dict[str, Any], ray_token: str, token_secret: str,
              ttl_s: int = 0) -> KubeRayCluster:  # fmt: skip
    """Our KubeRay block on the real control plane, with its defaults (K8sJobMode)."""
    kube = KubernetesCluster(kubeconfig=kubeconfig, namespace=NAMESPACE)
    return KubeRayCluster(kubernetes=kube, ray_cluster_spec=head_only_spec(token_secret),
                          ray_token=ray_token, ttl_seconds_after_finished=ttl_s)  # fmt: skip


@flow
def step_flow(block: KubeRayCluster, experiment: str, seconds: int) -> Any:
    """One step of an experiment: a re-run of the same experiment attaches to its job."""
    start_experiment(experiment)
    # two commands: the K8sJobMode submitter pastes the entrypoint into its shell line unquoted
    # (kuberay#3802), so without our quoting the `echo` would run in the submitter pod, not in Ray
    code = f"import time; time.sleep({seconds})"
    spec = JobSpec(entrypoint=f'python -c "{code}"; echo done-{experiment}', name="step")
    return run_job(spec, cluster=block)


@pytest.fixture(scope="module")
def real_kuberay(control_plane: Any) -> Any:
    """The control plane's API, our block's inputs (a ServiceAccount token with the documented
    Role, Ray's token in a Secret for authOptions), removed afterwards."""
    from tests.conftest import IN_CI
    from tests.test_real_control_plane import KUBERAY_RULES, service_account_token

    if reason := control_plane.agent_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(f"no node agent runs the operator's pods: {reason}")
    token = service_account_token(control_plane, NAMESPACE, KUBERAY_RULES)
    core = client.CoreV1Api(control_plane.api_client())
    secret, ray_token = f"ray-token-{uuid.uuid4().hex[:6]}", secrets.token_hex(16)
    core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": secret},
                                              "stringData": {"auth_token": ray_token}})  # fmt: skip
    kubeconfig = control_plane.kubeconfig(NAMESPACE, "real", token=token)
    yield control_plane, kubeconfig, ray_token, secret
    core.delete_namespaced_secret(secret, NAMESPACE)


def rayjobs_of(kube: Any, suffix: str) -> list[dict[str, Any]]:
    """The RayJobs whose job key ends with `suffix`."""
    from prefect_nemo.kube import RAY_JOB
    from prefect_nemo.lifecycle import META_KEY

    items = kube.list(RAY_JOB)[0]
    return [rj for rj in items if rj["spec"].get("metadata", {}).get(META_KEY, "").endswith(suffix)]


def rayjob_of(kube: Any, suffix: str, status: str) -> dict[str, Any] | None:
    """The RayJob whose job key ends with `suffix` once its Ray job has `status`."""
    jobs = rayjobs_of(kube, suffix)
    return next((rj for rj in jobs if (rj.get("status") or {}).get("jobStatus") == status), None)


def test_kill_9_then_rerun_attaches_and_runs_to_succeeded(
    real_kuberay, prefect_api, run_logs, tmp_path  # noqa: F811 - the fixture imported above
):
    """KubeRay docs, RayJob Quickstart: "With RayJob, KubeRay automatically creates a RayCluster
    and submits a job when the cluster is ready"; "Submitter: The submitter is a Kubernetes Job
    that runs ray job submit to submit a Ray job to the RayCluster"; and KubeRay's sample:
    "The default value is "K8sJobMode", meaning RayJob will submit the Ray job via a submitter
    Kubernetes Job." The flow process is killed with -9 while its Ray job runs; the re-run
    attaches (one RayJob for the step, the same Ray submission id, one Ray job on the cluster)
    and the job runs to SUCCEEDED on the local Ray, its log back through the API server's
    service proxy with Ray's token. KubeRay's source (common/job.go) says why the submitter
    itself never submits twice: "In K8sJobMode, we need to avoid submitting the job twice ...
    we use `ray job status` first to check if the jobId has been submitted"."""
    from prefect_nemo.backends.kuberay.raycluster import ray_jobs_backend
    from prefect_nemo.kube import RAY_JOB, KubeApi
    from tests.conftest import subprocess_env, wait_until

    plane, kubeconfig, ray_token, secret = real_kuberay
    kube = KubeApi(plane.api_client(), namespace=NAMESPACE)
    experiment = f"kr-{uuid.uuid4().hex[:6]}"
    env = subprocess_env(prefect_api, PYTHONPATH=str(ROOT), TEST_KUBECONFIG=json.dumps(kubeconfig),
                         TEST_RAY_TOKEN=ray_token, TEST_RAY_SECRET=secret)  # fmt: skip
    with open(tmp_path / "first.log", "w") as out:
        first = subprocess.Popen([sys.executable, __file__, experiment, "8"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        running = wait_until(lambda: rayjob_of(kube, f"{experiment}/step", "RUNNING"), 150)
        why = (tmp_path / "first.log").read_text()[-3000:] + plane.log("node_agent")[-3000:]
        assert running, why
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    job_id, ray_job_id = running["metadata"]["name"], running["status"]["jobId"]

    block = block_for(kubeconfig, ray_token, secret, ttl_s=60)  # keep the cluster to look at it
    try:
        result = step_flow(block, experiment, 8)
        assert result.attached and result.handle.job_id == job_id
        assert result.state is JobState.SUCCEEDED
        assert any(f"done-{experiment}" in line for line in run_logs)  # the log, via the proxy
        assert [rj["metadata"]["name"] for rj in rayjobs_of(kube, f"{experiment}/step")] == [job_id]
        done = kube.get(RAY_JOB, job_id)
        assert done["status"]["jobId"] == ray_job_id and done["status"]["jobStatus"] == "SUCCEEDED"
        ray = ray_jobs_backend(kube, done["status"]["rayClusterName"], NAMESPACE,
                               ray_token=ray_token).client  # fmt: skip
        assert [(j.submission_id, j.status.value) for j in ray.list_jobs()] == [
            (ray_job_id, "SUCCEEDED")]  # fmt: skip
    finally:
        kube.delete(RAY_JOB, job_id)


def test_cancelling_the_flow_run_stops_the_job_and_its_pods_go(real_kuberay, prefect_api):
    """KubeRay docs, RayJob Quickstart: "shutdownAfterJobFinishes (Optional): Determines whether
    to recycle the RayCluster after the Ray job finishes" and "ttlSecondsAfterFinished ... The
    RayCluster is deleted after this time"; Kubernetes docs, Garbage collection: dependents of a
    deleted owner are deleted. A flow run cancelled through the API stops its Ray job (KubeRay
    reports it STOPPED, or the RayJob is gone), the RayCluster goes, the real garbage collector
    deletes its pods, and the agent has killed every process of them (the local Ray with it)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from prefect_nemo.kube import POD, RAY_CLUSTER, RAY_JOB, KubeApi
    from prefect_nemo.lifecycle import META_FLOW_RUN
    from prefect_nemo.testing.control_plane.node_agent import pod_processes
    from tests.conftest import wait_until

    plane, kubeconfig, ray_token, secret = real_kuberay
    kube = KubeApi(plane.api_client(), namespace=NAMESPACE)
    block, name = block_for(kubeconfig, ray_token, secret), f"cancel-{uuid.uuid4().hex[:6]}"

    @flow
    def long_flow() -> None:
        run_job(JobSpec(entrypoint="sleep 120", name=name), block)

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(lambda: long_flow(return_state=True),),
                              daemon=True)  # fmt: skip
    thread.start()
    running = wait_until(lambda: rayjob_of(kube, f"/{name}", "RUNNING"), 150)
    assert running, plane.log("node_agent")[-3000:]
    job_id, cluster = running["metadata"]["name"], running["status"]["rayClusterName"]
    selector = f"ray.io/cluster={cluster}"
    uids = [p["metadata"]["uid"] for p in kube.list(POD, label_selector=selector)[0]]
    assert uids and all(pod_processes({uid}) for uid in uids), "the head runs as local processes"
    try:
        with get_client(sync_client=True) as prefect:
            prefect.set_flow_run_state(running["spec"]["metadata"][META_FLOW_RUN], Cancelling(),
                                       force=True)  # fmt: skip

        def stopped() -> bool:
            rj = kube.get(RAY_JOB, job_id)
            return rj is None or (rj.get("status") or {}).get("jobStatus") == "STOPPED"

        assert wait_until(stopped, 60), kube.get(RAY_JOB, job_id)
        thread.join(60)
        assert not thread.is_alive(), "the flow must end once its job is stopped"
        assert wait_until(lambda: kube.get(RAY_CLUSTER, cluster) is None, 60)
        assert wait_until(lambda: not kube.list(POD, label_selector=selector)[0], 60)
        assert wait_until(lambda: not pod_processes(set(uids)), 30)
    finally:
        kube.delete(RAY_JOB, job_id)


def test_the_real_operator_takes_our_rayjob_attach_and_stop(real_kuberay: Any) -> None:
    """KubeRay docs, "RayJob Quickstart": "RayJob: A RayJob consists of two components: a
    RayCluster custom resource and a submitter ... The KubeRay operator creates a RayCluster
    ... and, when the cluster is ready, submits the Ray job" and "shutdownAfterJobFinishes". The
    real operator accepts the RayJob our backend writes (no ValidationFailed), makes its
    RayCluster (owned by the RayJob) and the head pod running KubeRay's own `ray start --head`
    command and the head Service; submitting the same id again attaches (one RayJob: what a
    re-run after kill -9 does); stop before the Ray job runs deletes the RayJob and the garbage
    collector takes its RayCluster and pods."""
    from prefect_nemo.kube import POD, RAY_CLUSTER, RAY_JOB, SERVICE, KubeApi
    from prefect_nemo.lifecycle import stop_and_confirm, submit_or_attach
    from tests.conftest import wait_until

    plane, kubeconfig, ray_token, secret = real_kuberay
    backend = block_for(kubeconfig, ray_token, secret).backend()
    kube = KubeApi(plane.api_client(), namespace=NAMESPACE)
    key = f"operator-{uuid.uuid4().hex[:6]}"
    spec = JobSpec(entrypoint="python -c 'print(1)'", name="real-operator")
    first = submit_or_attach(backend, spec, scope="real", key=key)
    job_id = first.handle.job_id
    assert not first.attached

    def cluster() -> dict[str, Any] | None:
        items, _ = kube.list(RAY_CLUSTER)
        return next((c for c in items if c["metadata"]["name"].startswith(job_id)), None)

    made = wait_until(cluster, 60)
    assert made, f"no RayCluster for {job_id}: {plane.log('ray-operator')[-2000:]}"
    rayjob = kube.get(RAY_JOB, job_id)
    assert rayjob["status"].get("jobDeploymentStatus") != "ValidationFailed", rayjob["status"]
    assert [o["uid"] for o in made["metadata"]["ownerReferences"]] == [rayjob["metadata"]["uid"]]
    name = made["metadata"]["name"]
    selector = f"ray.io/cluster={name}"
    head = wait_until(lambda: kube.list(POD, label_selector=f"{selector},ray.io/node-type=head")[0],
                      60)  # fmt: skip
    command = " ".join(head[0]["spec"]["containers"][0].get("command", []) +
                       head[0]["spec"]["containers"][0].get("args", []))  # fmt: skip
    assert "ray start --head" in command, command
    assert wait_until(lambda: kube.list(SERVICE, label_selector=selector)[0], 30)

    again = submit_or_attach(backend, spec, scope="real", key=key)
    assert again.attached and again.handle.job_id == job_id
    assert [rj["metadata"]["name"] for rj in kube.list(RAY_JOB)[0]].count(job_id) == 1

    status = stop_and_confirm(backend, job_id, timeout_s=60)
    assert status is None or status.state is JobState.STOPPED
    assert wait_until(lambda: kube.get(RAY_JOB, job_id) is None, 60)
    assert wait_until(lambda: cluster() is None and not kube.list(POD, label_selector=selector)[0],
                      60)  # fmt: skip


def test_local_code_and_a_secret_reach_an_inline_cluster_together(
    real_kuberay, prefect_api, run_logs, tmp_path  # noqa: F811 - the fixture imported above
):
    """Issue 27 on the real operator. KubeRay v1.6.1's source: GetSubmitterTemplate "if
    rayJobSpec.SubmitterPodTemplate != nil { return *rayJobSpec.SubmitterPodTemplate.DeepCopy()
    }", configureSubmitterContainer "K8sJobMode: If the user doesn't specify the command, use
    the default command" (`ray job submit ... --runtime-env-json <runtimeEnvYAML as JSON>`), and
    Ray's CLI uploads a local working_dir of that runtime env. So the operator makes the
    submitter Job from our template, the Job controller its pod, and our node agent runs its init
    container (unpacking the code from the ConfigMap volume into the emptyDir) and then KubeRay's
    submit command, whose upload reaches the RayCluster's own head (a local `ray start --head`),
    whose env holds the Secret (envFrom). The job imports the shipped module and sees the value;
    the ConfigMaps and the Secret exist while the RayJob does and go with it (the real garbage
    collector), and no stored object holds the value."""
    from prefect_nemo.backends.kuberay.manifests import SUBMITTER, UNPACK
    from prefect_nemo.kube import POD, RAY_CLUSTER, RAY_JOB, KubeApi
    from tests.conftest import wait_until

    plane, kubeconfig, ray_token, token_secret = real_kuberay
    kube = KubeApi(plane.api_client(), namespace=NAMESPACE)
    block = block_for(kubeconfig, ray_token, token_secret, ttl_s=60)  # pods to look at
    value = f"s3cret-{uuid.uuid4().hex}"
    name = f"code-{uuid.uuid4().hex[:6]}"
    spec = JobSpec(entrypoint=MYMOD_ENTRYPOINT, name=name, working_dir=mymod_dir(tmp_path),
                   env={"API_KEY": SecretStr(value)})  # fmt: skip

    @flow
    def code_and_secret_flow() -> Any:
        return run_job(spec, cluster=block)

    result = code_and_secret_flow()
    job_id, owned = result.handle.job_id, []
    try:
        assert result.state is JobState.SUCCEEDED, (result.message,
                                                    plane.log("node_agent")[-3000:])  # fmt: skip
        logged = "\n".join(run_logs)
        assert secret_seen(value) in logged, "the shipped module ran and read the value"
        rj, owned = owned_by_rayjob(kube, job_id)
        submitter = plane.get("jobs", NAMESPACE, job_id, group="batch")
        assert submitter is not None, "KubeRay's submitter Job"
        pod_spec = submitter["spec"]["template"]["spec"]
        assert [c["name"] for c in pod_spec["initContainers"]] == [UNPACK]
        (container,) = pod_spec["containers"]
        assert container["name"] == SUBMITTER and "ray job submit" in container["args"][0]
        assert "/prefect-nemo/code" in container["args"][0], "working_dir in --runtime-env-json"
        submitter_pods = kube.list(POD, label_selector=f"batch.kubernetes.io/job-name={job_id}")[0]
        assert submitter_pods and all(
            p["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
            for p in submitter_pods), submitter_pods  # fmt: skip
        cluster = rj["status"]["rayClusterName"]
        cluster_pods = kube.list(POD, label_selector=f"ray.io/cluster={cluster}")[0]
        objects = [rj, [o for o in owned if o["kind"] != "Secret"], submitter, submitter_pods,
                   cluster_pods, kube.get(RAY_CLUSTER, cluster)]  # fmt: skip
        stored = json.dumps(objects)
        assert value not in stored and value not in logged
    finally:
        kube.delete(RAY_JOB, job_id)
    assert gone_with_the_rayjob(kube, owned, 60), "a ConfigMap or the Secret outlived its RayJob"
    assert wait_until(lambda: plane.get("jobs", NAMESPACE, job_id, group="batch") is None, 60)


if __name__ == "__main__":  # the flow process the kill -9 test kills
    env = os.environ
    block = block_for(json.loads(env["TEST_KUBECONFIG"]), env["TEST_RAY_TOKEN"],
                      env["TEST_RAY_SECRET"], ttl_s=60)  # fmt: skip
    step_flow(block, sys.argv[1], int(sys.argv[2]))


def test_10000_lines_reach_the_task_log_and_the_saved_file_read_after_the_cluster_is_gone(
    real_kuberay,
    prefect_api,
    run_logs,  # noqa: F811 - the fixture imported above
    tmp_path,
    monkeypatch,
):
    """Issue 29: "A job that prints 10,000 lines and exits at once: all 10,000 reach the task log
    and the saved file, on ... KubeRay (real operator)" and "After a RayJob's cluster is torn
    down, its saved log is readable from the job table's link". The RayJob's cluster goes 5 s
    after the job ends (shutdownAfterJobFinishes with ttlSecondsAfterFinished)."""
    from prefect_nemo.kube import RAY_CLUSTER, KubeApi
    from prefect_nemo.log_files import LOGS_DIR_ENV
    from prefect_nemo.tasks.reporting import job_rows
    from tests.conftest import wait_until

    plane, kubeconfig, ray_token, secret = real_kuberay
    monkeypatch.setenv(LOGS_DIR_ENV, str(tmp_path / "logs"))
    lines = 10_000
    spec = JobSpec(entrypoint=f"seq -f 'line %05g' 0 {lines - 1}", name="ten-thousand-lines")
    block = block_for(kubeconfig, ray_token, secret, ttl_s=5)

    @flow
    def printing_flow():
        return run_job(spec, cluster=block)

    state = printing_flow(return_state=True)
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    job_id, flow_run_id = result.handle.job_id, str(state.state_details.flow_run_id)
    api = KubeApi(plane.api_client())
    gone = wait_until(
        lambda: not any(
            o["metadata"]["name"].startswith(job_id) for o in api.list(RAY_CLUSTER, NAMESPACE)[0]
        ),
        120,
    )
    assert gone, "the RayJob's cluster was not torn down"

    expected = [f"line {n:05d}" for n in range(lines)]
    (row,) = job_rows(flow_run_id)
    saved = [ln for ln in Path(row["log"]).read_text().splitlines() if ln.startswith("line ")]
    assert saved == expected, f"{len(saved)} of {lines} lines in the file the row links"
    in_task_log = [
        m.removeprefix(f"[{job_id}] ") for m in run_logs if m.startswith(f"[{job_id}] line ")
    ]
    assert in_task_log == expected, f"{len(in_task_log)} of {lines} lines in the task log"
