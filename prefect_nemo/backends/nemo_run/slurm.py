"""Slurm through NeMo-Run's SlurmExecutor and SSH tunnel, with native afterok dependencies.

Submission is NeMo-Run's: the executor writes the sbatch script and packages the code, its
torchx scheduler runs ``sbatch`` through the tunnel. Around it this backend adds what NeMo-Run
lacks: an SSH connection that never prompts or exits (key only, host key checked when
`known_hosts` is given), the job dir shipped over SFTP (no rsync, no key file on disk), a
race-safe claim of the job id on the cluster, secret env values in a 0600 file that the
batch script sources and deletes, batched status (one ``squeue`` + ``sacct`` per poll for all
jobs), and ``sbatch --dependency=afterok:`` for upstream jobs on the same cluster.

Remote layout under `job_dir` (the block's remote job dir)::

    prefect-nemo/prefect-nemo_<job id>/        claimed with mkdir (atomic): the job exists
        meta.json, slurm_job_id                 what we submitted, Slurm's id for it
        <job id>_sbatch.sh, <job id>/code, <job id>/log-<job id>_<slurm id>_0.out
        .secret-env                             0600; deleted by the job once sourced
                                                (so a job Slurm requeues after it started,
                                                e.g. on a node failure, runs without it)
    prefect-nemo/experiments/<experiment>/<job id>   index for cross-experiment afterok
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
import shutil
import tarfile
import threading
from collections.abc import AsyncGenerator, Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.base import (
    EXPERIMENT_TITLE,
    STALE_CLAIM_S,
    NemoRunBackend,
    experiment_id,
    plain_env,
    secret_env,
)
from prefect_nemo.backends.nemo_run.isolation import nemo_run
from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    DependencyFailed,
    InvalidJobSpec,
    JobAlreadyExists,
)
from prefect_nemo.jobs import META_EXPERIMENT, JobHandle, JobSpec, JobState, JobStatus
from prefect_nemo.packaging import build_archive, plan_for
from prefect_nemo.placement.errors import PlacementError
from prefect_nemo.placement.spec import to_slurm

SECRET_ENV_FILE = ".secret-env"
SCHEDULER = "slurm_tunnel"

# sacct/squeue state (first word) -> ours
_SLURM_STATES = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "CANCELLED": JobState.STOPPED,
    "PREEMPTED": JobState.STOPPED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "REVOKED": JobState.FAILED,
}
_NEVER_SATISFIED = "DependencyNeverSatisfied"
# every sacct state: with -S alone sacct lists only jobs that became eligible (not one
# cancelled while held or waiting on a dependency)
_ALL_STATES = "BF,CA,CD,DL,F,NF,OOM,PD,PR,R,RQ,RS,RV,S,TO"
_ATTEMPT = re.compile(r"(.+)-r(\d+)")

# job id -> Slurm job id, per cluster, for every backend object in this process
_slurm_ids: dict[str, dict[str, str]] = {}
_cleaned: set[tuple[str, str]] = set()  # (cluster, job id) whose secret file we removed
_ids_lock = threading.Lock()


class SlurmBackend(NemoRunBackend):
    """Jobs on a Slurm cluster reached over SSH, submitted by NeMo-Run's SlurmExecutor."""

    kind: ClassVar[str] = "slurm"
    max_job_id_len: ClassVar[int] = names.MAX_LABEL

    def __init__(
        self,
        *,
        host: str,
        user: str,
        job_dir: str,
        account: str,
        port: int = 22,
        identity: str | None = None,
        identity_key: str | None = None,
        known_hosts: str | None = None,
        partition: str | None = None,
        time: str = "01:00:00",
        nodes: int = 1,
        ntasks_per_node: int = 1,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        qos: str | None = None,
        constraint: str | None = None,
        container_image: str | None = None,
        container_mounts: Sequence[str] = (),
        additional_parameters: dict[str, Any] | None = None,
        setup_lines: str | None = None,
        env: dict[str, str] | None = None,
        connect_timeout_s: float = 30.0,
        command_timeout_s: float = 120.0,
        field_prefix: str = "SlurmCluster",
        upstream: Sequence[JobHandle] = (),
    ) -> None:
        super().__init__()
        self.host, self.user, self.port = host, user, int(port)
        self.job_dir = job_dir.rstrip("/") or "/"
        self.account, self.partition, self.time = account, partition, time
        self.nodes, self.ntasks_per_node = nodes, ntasks_per_node
        self.gpus_per_node, self.cpus_per_task, self.mem = gpus_per_node, cpus_per_task, mem
        self.qos, self.constraint = qos, constraint
        self.container_image, self.container_mounts = container_image, list(container_mounts)
        self.additional_parameters = dict(additional_parameters or {})
        self.setup_lines = setup_lines
        self._env = dict(env or {})
        self._ssh = SafeSSH.shared(
            host=host,
            port=self.port,
            user=user,
            identity=identity,
            identity_key=identity_key,
            known_hosts=known_hosts,
            connect_timeout_s=connect_timeout_s,
            command_timeout_s=command_timeout_s,
            field_prefix=field_prefix,
        )
        self._field = field_prefix
        self._upstream = tuple(upstream)
        self._kwargs = dict(locals())  # to rebuild with dependencies (after)
        for unused in ("self", "__class__", "upstream"):
            self._kwargs.pop(unused, None)

    # -- identity

    @property
    def address(self) -> str:
        """The Slurm cluster as SSH sees it: user@host:port (native dependencies need the same)."""
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def cluster(self) -> str:
        """The cluster and the remote job dir (job ids are claimed in that dir)."""
        return f"slurm://{self.address}{self.job_dir}"

    @property
    def secrets(self) -> list[str]:
        """The SSH key text, when the block holds it."""
        return self._ssh.secrets

    def links(self, job_id: str) -> dict[str, str]:
        """Where the job's files and logs are on the cluster."""
        return {"job_dir": f"ssh://{self.address}{self.remote_dir(job_id)}/{job_id}"}

    def remote_root(self) -> str:
        """Our directory under the remote job dir."""
        return f"{self.job_dir}/{EXPERIMENT_TITLE}"

    def remote_dir(self, job_id: str) -> str:
        """The job's directory on the cluster (NeMo-Run's tunnel job dir)."""
        return f"{self.remote_root()}/{experiment_id(job_id)}"

    # -- dependencies

    def depends_natively_on(self, handle: JobHandle) -> bool:
        """True for a job on this same Slurm cluster and job dir: afterok can name it (its
        Slurm id is found in this job dir)."""
        return handle.backend == self.kind and handle.cluster == self.cluster

    def after(self, upstream: Sequence[JobHandle]) -> SlurmBackend:
        """This backend, whose next submissions wait natively (afterok) for `upstream`."""
        return type(self)(**self._kwargs, upstream=[*self._upstream, *upstream])

    def experiment_jobs(self, experiment: str) -> list[JobHandle]:
        """Handles of the jobs experiment `experiment` submitted to this cluster (remote index)."""
        index = self._experiment_index(experiment)
        out = self.run(f"ls -1 {shlex.quote(index)} 2>/dev/null || true").stdout.split()
        latest: dict[str, tuple[int, str]] = {}  # a retry (-r<n>) supersedes earlier attempts
        for job_id in out:
            match = _ATTEMPT.fullmatch(job_id)
            base, attempt = (match[1], int(match[2])) if match else (job_id, 0)
            if attempt >= latest.get(base, (-1, ""))[0]:
                latest[base] = (attempt, job_id)
        return [self.handle(job_id) for _, job_id in sorted(latest.values(), key=lambda x: x[1])]

    def _experiment_index(self, experiment: str) -> str:
        label = names.dns_label(experiment, 40)
        return f"{self.remote_root()}/experiments/{label}-{names.stable_hash(experiment)}"

    def _dependency_ids(self) -> list[str]:
        """Slurm ids to wait for; DependencyFailed now if an upstream job already failed."""
        if not self._upstream:
            return []
        for handle in self._upstream:
            if not self.depends_natively_on(handle):
                raise InvalidJobSpec(
                    f"upstream job '{handle.job_id}' is on {handle.cluster}, not on this Slurm "
                    f"cluster and job dir ({self.cluster}): wait for it in Prefect instead"
                )
        ids = [h.job_id for h in self._upstream]
        statuses = self.statuses(ids)
        waiting = []
        for job_id in ids:
            status = statuses.get(job_id)
            if status is None:
                raise DependencyFailed(
                    f"upstream job '{job_id}' is not on {self.address} (no such job in "
                    f"{self.remote_root()}): submit it first"
                )
            if status.state in (JobState.FAILED, JobState.STOPPED):
                raise DependencyFailed(
                    f"upstream job '{job_id}' ended {status.state.value}"
                    + (f" ({status.message})" if status.message else "")
                    + ": nothing was submitted. Re-run the upstream job first."
                )
            if status.state is not JobState.SUCCEEDED:
                waiting.append(self._slurm_id(job_id))
        return [sid for sid in waiting if sid]

    # -- SSH

    def run(self, command: str, *, warn: bool = False) -> Any:
        """Run a shell command on the login node (our connection; never prompts)."""
        return self._ssh.run(command, warn=warn)

    def check_access(self) -> None:
        """Connect and authenticate now, and check that sbatch is on the login node's PATH."""
        result = self.run("command -v sbatch sacct squeue scancel", warn=True)
        if len(result.stdout.split()) < 4:
            raise BackendUnavailable(
                f"{self.address}: sbatch, sacct, squeue and scancel must be on the PATH of "
                f"{self.user}'s login shell (found: {result.stdout.split() or 'none'})"
            )

    # -- executor

    def validate(self, spec: JobSpec) -> None:
        """What sbatch would refuse, before anything is sent."""
        res = spec.resources
        if res.custom:
            raise InvalidJobSpec(
                "JobSpec.resources.custom: Slurm has no custom resources: request GRES with "
                f"{self._field}.additional_parameters={{'gres': 'name:count'}}"
            )
        if res.gpus is not None and res.gpus != int(res.gpus):
            raise InvalidJobSpec(
                f"JobSpec.resources.gpus={res.gpus}: Slurm allocates whole GPUs: use an integer"
            )
        limit = _slurm_seconds(self.time, f"{self._field}.time")
        if spec.timeout_s is not None and limit is not None and spec.timeout_s > limit:
            raise InvalidJobSpec(
                f"JobSpec.timeout_s={spec.timeout_s:g} exceeds {self._field}.time={self.time} "
                f"(sbatch --time, {limit}s): raise {self._field}.time or lower timeout_s"
            )
        super().validate(spec)

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """NeMo-Run's launch; sbatch refusing the job is an error naming the block field."""
        from invoke.exceptions import UnexpectedExit

        try:
            return super().submit(spec, job_id, metadata)
        except UnexpectedExit as exc:
            raise _sbatch_error(exc, self._field) from None

    def make_executor(self, spec: JobSpec, job_id: str) -> Any:
        """NeMo-Run's SlurmExecutor for spec: placement/resources over the block's defaults,
        plain env in the script, secret env sourced from a 0600 file, code via our archive."""
        run = nemo_run()
        alloc: dict[str, Any] = {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "constraint": self.constraint,
            "mem": self.mem,
        }
        if spec.placement is not None:
            try:
                alloc.update(to_slurm(spec.placement))
            except PlacementError as exc:
                raise InvalidJobSpec(f"JobSpec.placement: {exc}") from None
        res = spec.resources
        if res.gpus is not None:
            alloc["gpus_per_node"] = int(res.gpus)
        if res.cpus is not None:
            alloc["cpus_per_task"] = max(1, round(res.cpus))
        if res.memory_bytes is not None:
            alloc["mem"] = f"{max(1, -(-res.memory_bytes // (1024 * 1024)))}M"
        if not alloc.get("gpus_per_node"):
            alloc["gpus_per_node"] = None  # 0 means CPU-only: ask for no GPUs at all
        extra = dict(self.additional_parameters)
        deps = self._dependency_ids() if job_id != "validate" else []
        if deps:
            extra["kill_on_invalid_dep"] = "yes"  # a failed upstream cancels us, not a hang
        executor = run.SlurmExecutor(
            account=self.account,
            partition=self.partition,
            time=self.time,
            ntasks_per_node=self.ntasks_per_node,
            qos=self.qos,
            container_image=self.container_image,
            container_mounts=list(self.container_mounts),
            additional_parameters=extra or None,
            setup_lines=self._setup_lines(spec, job_id),
            tunnel=self._ssh.tunnel(self.job_dir),
            packager=run.Packager(),
            dependencies=[f"{SCHEDULER}://nemo_run/{sid}" for sid in deps],
            dependency_type="afterok",
            poll_estimated_start_time=False,
            env_vars=dict(self._env),
            **{k: v for k, v in alloc.items() if v is not None},
        )
        from nemo_run.core.execution.slurm import SlurmJobDetails

        executor.job_details = SlurmJobDetails(job_name=job_id)
        return executor

    def make_task(self, spec: JobSpec, job_id: str) -> Any:
        """The entrypoint as an inline script; env goes through setup_lines (quoted, case kept)."""
        return nemo_run().Script(inline=spec.entrypoint)

    def _setup_lines(self, spec: JobSpec, job_id: str) -> str:
        # NeMo-Run writes `export KEY.upper()=value` unquoted; we write the env ourselves.
        lines = [self.setup_lines] if self.setup_lines else []
        lines += [f"export {k}={shlex.quote(v)}" for k, v in plain_env(spec).items()]
        if secret_env(spec):
            path = shlex.quote(f"{self.remote_dir(job_id)}/{SECRET_ENV_FILE}")
            # the script runs with `set -vx`: silence it so no secret is echoed to the log
            lines += [
                "{ set +vx; } 2>/dev/null",
                f"if [ -f {path} ]; then set -a; . {path}; set +a; rm -f {path}; fi",
                "set -x",
            ]
        return "\n".join(lines)

    # -- the job registry on the cluster

    def claim(self, job_id: str, metadata: dict[str, str]) -> None:
        """mkdir the job's remote dir (atomic) or raise JobAlreadyExists; a claim left by a
        submitter that died before sbatch is taken over after STALE_CLAIM_S."""
        d = shlex.quote(self.remote_dir(job_id))
        meta = shlex.quote(json.dumps(metadata, sort_keys=True))
        write = f"printf %s {meta} > {d}/meta.json && echo CLAIMED"
        # no id file, old, not queued: stale unless sacct knows a job submitted under this
        # claim (the submitter died before writing its id): then the job exists; keep its id
        script = (
            f"mkdir -p {shlex.quote(self.remote_root())} || exit 3; "
            f"if mkdir -m 700 {d} 2>/dev/null; then {write}; exit 0; fi; "
            f"if [ ! -s {d}/slurm_job_id ] "
            f"&& [ $(( $(date +%s) - $(stat -c %Y {d}) )) -gt {int(STALE_CLAIM_S)} ] "
            f'&& [ -z "$(squeue -h --name={shlex.quote(job_id)} -o %i)" ]; then '
            f"s=$({self._sacct_id(job_id)}); "
            f'if [ -z "$s" ]; then rm -rf {d} && mkdir -m 700 {d} && {write}; exit 0; fi; '
            f'printf %s "$s" > {d}/slurm_job_id; fi; echo EXISTS'
        )
        out = self.run(script).stdout.strip()
        if out.endswith("EXISTS"):
            raise JobAlreadyExists(f"Slurm job '{job_id}' already exists on {self.address}")
        if not out.endswith("CLAIMED"):
            raise BackendUnavailable(f"could not claim {self.remote_dir(job_id)}: {out[-200:]}")

    def release(self, job_id: str) -> None:
        """Remove the claim of a launch that failed or was interrupted. sbatch may have taken
        the job already (a cancel or an SSH timeout mid-launch): scancel it by name first (the
        Slurm job name is our job id), so no job is left queued on a removed dir."""
        q = shlex.quote
        try:
            self.run(
                f'scancel -u "$(id -un)" --name={q(job_id)} 2>/dev/null; '
                f"rm -rf {q(self.remote_dir(job_id))}",
                warn=True,
            )
        except Exception:  # the original error matters more; a stale claim expires
            pass

    def before_launch(self, spec: JobSpec, job_id: str, executor: Any) -> None:
        """The native code transport: our archive of working_dir unpacked into the job's
        `code` dir (srun's --chdir), which ships with the job dir. NeMo-Run's own packaging
        step is marked done: it shells out through invoke, which reads this process's stdin."""
        from nemo_run.core.execution.slurm import get_packaging_job_key
        from nemo_run.core.tunnel.client import PackagingJob

        code = Path(executor.job_dir) / "code"
        code.mkdir(parents=True, exist_ok=True)
        if spec.working_dir is not None:
            archive = build_archive(spec.working_dir, exclude=spec.exclude)
            plan_for("slurm", archive, name=job_id)  # the native plan: checks a size cap if set
            with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
                tar.extractall(code, filter="data")
        key = get_packaging_job_key(executor.experiment_id, job_id)
        executor.tunnel.packaging_jobs[key] = PackagingJob(symlink=False)

    def before_schedule(self, spec: JobSpec, job_id: str, executor: Any, dryrun_info: Any) -> None:
        """Ship the local job dir (script, code) over SFTP, and the secret env file (0600)."""
        local = Path(executor.experiment_dir)
        remote = self.remote_dir(job_id)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path in sorted(local.iterdir()):
                tar.add(path, arcname=path.name)
        buf.seek(0)
        upload = f"{remote}/.upload.tgz"
        self._ssh.put(buf, upload)
        secrets = secret_env(spec)
        if secrets:
            body = "".join(f"{k}={shlex.quote(v)}\n" for k, v in secrets.items())
            self._ssh.put_private(body.encode(), f"{remote}/{SECRET_ENV_FILE}")
        q = shlex.quote
        self.run(f"tar -xzf {q(upload)} -C {q(remote)} && rm -f {q(upload)}")

    def after_schedule(self, spec: JobSpec, job_id: str, app_handle: str) -> None:
        """The local copy of the job dir served its purpose (the cluster has it): drop it."""
        shutil.rmtree(self.local_experiment_dir(job_id), ignore_errors=True)

    def record(self, job_id: str, app_handle: str, metadata: dict[str, str]) -> None:
        """Write Slurm's id beside the claim, and index the job under its experiment."""
        sid = app_handle.rsplit("/", 1)[-1]
        with _ids_lock:
            _slurm_ids.setdefault(self.cluster, {})[job_id] = sid
        q = shlex.quote
        commands = [f"printf %s {q(sid)} > {q(self.remote_dir(job_id))}/slurm_job_id"]
        experiment = metadata.get(META_EXPERIMENT)
        if experiment:
            index = self._experiment_index(experiment)
            commands.append(f"mkdir -p {q(index)} && printf %s {q(sid)} > {q(index)}/{q(job_id)}")
        self.run(" && ".join(commands))

    def _slurm_id(self, job_id: str) -> str | None:
        with _ids_lock:
            return _slurm_ids.get(self.cluster, {}).get(job_id)

    def _sacct_id(self, job_id: str) -> str:
        """Shell printing the newest Slurm id of a job named job_id that sacct knows since the
        job's claim (meta.json's time); nothing without a claim. Bounded by the claim so that a
        job cancelled when an earlier claim was released is not taken for this one."""
        q = shlex.quote
        meta = q(f"{self.remote_dir(job_id)}/meta.json")
        return (
            f"{{ [ -f {meta} ] && sacct -n -X -P --name={q(job_id)} -o JobID "
            f"-S $(date -d @$(stat -c %Y {meta}) +%Y-%m-%dT%H:%M:%S) -E now -s {_ALL_STATES} "
            "2>/dev/null | tail -1; }"
        )

    def _lookup(self, job_ids: Collection[str]) -> None:
        """Fill the id cache for jobs submitted elsewhere (another process or a crashed run)."""
        unknown = [j for j in job_ids if self._slurm_id(j) is None]
        if not unknown:
            return
        q = shlex.quote
        # the id file, else Slurm by name (a submitter that died between sbatch and writing
        # it): squeue while queued or running, sacct once it has left the queue
        reads = "; ".join(
            f"s=$(cat {q(self.remote_dir(j))}/slurm_job_id 2>/dev/null); "
            f'[ -n "$s" ] || s=$(squeue -h --name={q(j)} -o %i | head -1); '
            f'[ -n "$s" ] || s=$({self._sacct_id(j)}); echo {q(j)} "$s"'
            for j in unknown
        )
        found: dict[str, str] = {}
        for line in self.run(reads).stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                found[parts[0]] = parts[1]
        with _ids_lock:
            _slurm_ids.setdefault(self.cluster, {}).update(found)

    def app_handle(self, job_id: str) -> str | None:
        """slurm_tunnel://nemo_run/<slurm id>, or None if no such job."""
        self._lookup([job_id])
        sid = self._slurm_id(job_id)
        return f"{SCHEDULER}://nemo_run/{sid}" if sid else None

    def job_metadata(self, job_id: str) -> dict[str, str]:
        """The metadata written with the claim."""
        out = self.run(f"cat {shlex.quote(self.remote_dir(job_id))}/meta.json", warn=True)
        try:
            return dict(json.loads(out.stdout or "{}"))
        except ValueError:
            return {}

    # -- status, stop, logs

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """One squeue + sacct round trip for all the jobs (sacct may lag a just-submitted job;
        squeue never does)."""
        self._lookup(job_ids)
        ids = {j: sid for j in job_ids if (sid := self._slurm_id(j))}
        if not ids:
            return {}
        joined = ",".join(sorted(set(ids.values())))
        command = (
            f"export SLURM_TIME_FORMAT=%s; squeue -h -t all -j {joined} -o '%i|%T|%r|%S' "
            f"2>/dev/null; echo @@; sacct -n -X -P -j {joined} "
            "-o JobID,State,ExitCode,Start,End,Reason 2>/dev/null"
        )
        queue, _, acct = self.run(command, warn=True).stdout.partition("@@")
        rows: dict[str, dict[str, str]] = {}
        for line in queue.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 4:
                sid, state, reason, start = parts
                if _SLURM_STATES.get(state, JobState.PENDING).is_terminal():
                    # ended, but sacct (exit code, end time) has not caught up: still finishing
                    state = "COMPLETING" if start.isdigit() else "PENDING"
                reason = "" if reason in ("None", "(null)") else reason
                if _SLURM_STATES.get(state) is not JobState.RUNNING:
                    start = ""  # a pending job's %S is Slurm's estimate, not a start
                rows[sid] = {"State": state, "Reason": reason, "Start": start}
        for line in acct.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 6 and parts[0] in ids.values():
                sid, state, exit_code, start, end, reason = parts
                live = rows.get(sid)
                ended = _SLURM_STATES.get(state.split()[0], JobState.PENDING).is_terminal()
                if live is None or ended:  # squeue is current; sacct has the end
                    rows[sid] = {
                        "State": state,
                        "ExitCode": exit_code,
                        "Start": start,
                        "End": end,
                        "Reason": reason
                        if reason not in ("None", "")
                        else (live or {}).get("Reason", ""),
                    }
        out = {}
        for job_id, sid in ids.items():
            row = rows.get(sid)
            if row is not None:
                out[job_id] = _status(job_id, sid, row)
        self._clean_secrets([j for j, s in out.items() if s.state.is_terminal()])
        return out

    def _clean_secrets(self, ended: list[str]) -> None:
        """Delete the secret env file of jobs that ended without running (cancelled while
        pending, or never satisfied): the job deletes it itself once it starts."""
        with _ids_lock:
            todo = [j for j in ended if (self.cluster, j) not in _cleaned]
            _cleaned.update((self.cluster, j) for j in todo)
        if todo:
            files = " ".join(shlex.quote(f"{self.remote_dir(j)}/{SECRET_ENV_FILE}") for j in todo)
            self.run(f"rm -f {files}", warn=True)

    def request_stop(self, job_id: str) -> None:
        """scancel the job (pending or running); its secret file goes with it."""
        sid = self._slurm_id(job_id) or (self._lookup([job_id]) or self._slurm_id(job_id))
        if sid:
            secret = shlex.quote(f"{self.remote_dir(job_id)}/{SECRET_ENV_FILE}")
            self.run(f"scancel {sid}; rm -f {secret}", warn=True)

    def logs(self, job_id: str) -> str:
        """The job's output (its srun log; the batch log when srun never started)."""
        return self._log_from(job_id, 0)

    def _log_from(self, job_id: str, offset: int) -> str:
        """The job's output from byte `offset` on (only the new part crosses the network)."""
        sid = self._slurm_id(job_id) or (self._lookup([job_id]) or self._slurm_id(job_id))
        if not sid:
            return ""
        d = shlex.quote(f"{self.remote_dir(job_id)}/{job_id}")
        j = shlex.quote(job_id)
        command = (
            f"{{ ls {d}/log-{j}_{sid}_*.out >/dev/null 2>&1 && cat {d}/log-{j}_{sid}_*.out "
            f"|| cat {d}/sbatch_{j}_{sid}.out 2>/dev/null; }} | tail -c +{offset + 1}; true"
        )
        return self.run(command, warn=True).stdout

    async def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """The log from its start, then each second what was appended (read from the last
        byte offset, so a long training log is not re-read), until the job ends."""
        offset = 0
        while True:
            status = await asyncio.to_thread(self.statuses, [job_id])
            done = job_id not in status or status[job_id].state.is_terminal()
            chunk = await asyncio.to_thread(self._log_from, job_id, offset)
            if chunk:
                yield chunk
                offset += len(chunk.encode())
            if done:
                return
            await asyncio.sleep(1.0)


_SBATCH_FIELDS = {
    "account": "account",
    "partition": "partition",
    "time limit": "time",
    "qos": "qos",
    "constraint": "constraint",
    "feature": "constraint",
    "gres": "gpus_per_node or additional_parameters",
    "node count": "nodes (or JobSpec.placement.nodes)",
    "node configuration": "nodes, gpus_per_node, cpus_per_task or mem (or the JobSpec's "
    "placement / resources: more than the partition's nodes have)",
    "generic resource": "gpus_per_node or additional_parameters['gres']",
    "memory": "mem (or JobSpec.resources.memory_bytes)",
}


def _sbatch_error(exc: Any, field: str) -> Exception:
    """sbatch's refusal as InvalidJobSpec naming the block field it is about (else
    BackendUnavailable with sbatch's message)."""
    text = (exc.result.stderr or exc.result.stdout or "").strip()
    reason = text.splitlines()[-1] if text else f"exit {exc.result.exited}"
    lowered = reason.lower()
    for needle, name in _SBATCH_FIELDS.items():
        if needle in lowered:
            return InvalidJobSpec(
                f"sbatch refused the job: {reason}. Check {field}.{name} (nothing was submitted)"
            )
    return BackendUnavailable(f"sbatch failed: {reason}")


def _slurm_seconds(text: str, field: str) -> int | None:
    """Seconds in a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS);
    None for no limit."""
    text = text.strip()
    if text.upper() in ("INFINITE", "UNLIMITED", "-1"):
        return None
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        if days:
            if len(parts) > 3:
                raise ValueError(text)
            hours, minutes, seconds = (*parts, 0, 0)[:3]
            hours += int(days) * 24
        elif len(parts) == 3:
            hours, minutes, seconds = parts
        elif len(parts) in (1, 2):
            hours, minutes, seconds = 0, parts[0], (parts[1] if len(parts) == 2 else 0)
        else:
            raise ValueError(text)
    except ValueError:
        raise InvalidJobSpec(
            f"{field}={text!r} is not a Slurm time: use minutes, HH:MM:SS or D-HH:MM:SS"
        ) from None
    return (hours * 60 + minutes) * 60 + seconds


def _epoch(text: str) -> datetime | None:
    return datetime.fromtimestamp(int(text), tz=UTC) if text.isdigit() and text != "0" else None


def _status(job_id: str, sid: str, row: dict[str, str]) -> JobStatus:
    word = row["State"].split()[0] if row["State"] else "PENDING"
    state = _SLURM_STATES.get(word, JobState.PENDING)
    reason = row.get("Reason", "")
    message = f"{row['State']} (Slurm job {sid}" + (f", {reason})" if reason else ")")
    started = _epoch(row.get("Start", ""))
    if reason == _NEVER_SATISFIED and not state.is_terminal():
        message = (
            f"Slurm job {sid} cannot run: a job it depends on (afterok) did not succeed ({reason})"
        )
    elif reason.startswith("Dependency") and state is JobState.STOPPED:
        started = None  # sacct gives a job cancelled while pending the cancel time as Start
        message = (
            f"Slurm job {sid} never ran: it was cancelled while waiting for the jobs it depends "
            "on (afterok); Slurm cancels it when one of them fails or is cancelled "
            f"({row['State']}, {reason})"
        )
    exit_code = None
    code = row.get("ExitCode", "")
    if code and code.split(":")[0].isdigit() and state in (JobState.SUCCEEDED, JobState.FAILED):
        exit_code = int(code.split(":")[0])
    return JobStatus(
        job_id=job_id,
        state=state,
        message=message,
        start_time=started,
        end_time=_epoch(row.get("End", "")) if state.is_terminal() else None,
        exit_code=exit_code,
        metadata={"slurm_job_id": sid},
    )


# -- SSH that never prompts


_ssh_pool: dict[str, SafeSSH] = {}
_ssh_lock = threading.Lock()


class SafeSSH:
    """One SSH connection per backend, key only: a missing, unreadable or rejected key is
    AuthenticationFailed naming the block field, never a password prompt or sys.exit.

    The key text (when the block holds the key itself) stays in memory: paramiko loads it
    from a string, and SFTP replaces rsync, so no key file is ever written.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        user: str,
        identity: str | None,
        identity_key: str | None,
        known_hosts: str | None,
        connect_timeout_s: float,
        command_timeout_s: float,
        field_prefix: str,
    ) -> None:
        self.host, self.port, self.user = host, port, user
        self._identity, self._key_text, self._known_hosts = identity, identity_key, known_hosts
        self._connect_timeout_s, self._command_timeout_s = connect_timeout_s, command_timeout_s
        self._field = field_prefix
        self._lock = threading.Lock()
        self._sftp_lock = threading.Lock()
        self._session: Any = None
        self._tunnels: list[Any] = []

    @classmethod
    def shared(cls, **kwargs: Any) -> SafeSSH:
        """The process-wide connection for these settings (a block builds a backend per task;
        they share one SSH connection). Keyed by a hash of the key, never the key itself."""
        key = names.stable_hash(
            *(f"{k}={kwargs[k]}" for k in sorted(kwargs) if k != "identity_key"),
            kwargs.get("identity_key") or "",
            length=32,
        )
        with _ssh_lock:
            ssh = _ssh_pool.get(key)
            if ssh is None:
                ssh = _ssh_pool[key] = cls(**kwargs)
            return ssh

    @property
    def secrets(self) -> list[str]:
        """The key text and each of its lines (a log may show one line of it)."""
        if not self._key_text:
            return []
        lines = [ln.strip() for ln in self._key_text.splitlines() if len(ln.strip()) > 16]
        return [self._key_text, self._key_text.strip(), *lines]

    def _pkey(self) -> Any:
        import paramiko

        where = f"{self._field}.identity_key" if self._key_text else f"{self._field}.identity"
        text = self._key_text
        if text is None:
            if not self._identity:
                raise AuthenticationFailed(
                    f"{self._field}: no SSH key: set identity (a private key file on this "
                    "machine) or identity_key (the key itself, kept as a secret)"
                )
            try:
                text = Path(self._identity).expanduser().read_text()
            except OSError as exc:
                raise AuthenticationFailed(
                    f"{where}={self._identity!r} cannot be read ({exc.strerror or exc}): point it "
                    f"at the private key authorized for {self.user}@{self.host}"
                ) from None
        for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
            try:
                return cls.from_private_key(io.StringIO(text))
            except paramiko.PasswordRequiredException:
                raise AuthenticationFailed(
                    f"{where}: the key is encrypted with a passphrase and prefect-nemo never "
                    "prompts: use a key without a passphrase for this cluster"
                ) from None
            except (paramiko.SSHException, ValueError):
                continue
        raise AuthenticationFailed(
            f"{where}: not a private key paramiko can read (OpenSSH ed25519, ECDSA or RSA "
            "expected): check you gave the private key, not the .pub file"
        )

    def _open(self) -> Any:
        import paramiko
        from fabric import Config, Connection

        conn = Connection(
            self.host,
            user=self.user,
            port=self.port,
            connect_timeout=self._connect_timeout_s,
            connect_kwargs={
                "pkey": self._pkey(),
                "look_for_keys": False,
                "allow_agent": False,
                "auth_timeout": self._connect_timeout_s,
                "banner_timeout": self._connect_timeout_s,
            },
            config=Config(overrides={"run": {"in_stream": False}}),
        )
        if self._known_hosts is not None:
            keys = conn.client.get_host_keys()
            for line in self._known_hosts.splitlines():
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
                if entry is not None and entry.key is not None:
                    for name in entry.hostnames:
                        keys.add(name, entry.key.get_name(), entry.key)
            conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        else:  # as ssh does: a host listed in ~/.ssh/known_hosts must match (fabric skips it)
            with contextlib.suppress(OSError):
                conn.client.load_system_host_keys()
        target = f"{self.user}@{self.host}:{self.port}"
        try:
            conn.open()
        except paramiko.BadHostKeyException:
            raise AuthenticationFailed(
                f"{target} presented a host key that differs from "
                f"{self._field + '.known_hosts' if self._known_hosts else '~/.ssh/known_hosts'}: "
                "the host changed or someone is in between; check it and update known_hosts"
            ) from None
        except paramiko.AuthenticationException:
            raise AuthenticationFailed(
                f"{target} rejected the SSH key in {self._field}."
                f"{'identity_key' if self._key_text else 'identity'}: add its public key to "
                f"~{self.user}/.ssh/authorized_keys on the login node"
            ) from None
        except paramiko.SSHException as exc:
            if "known_hosts" in str(exc) or "not found in" in str(exc):
                raise AuthenticationFailed(
                    f"{target} is not in {self._field}.known_hosts: add its line (ssh-keyscan "
                    f"-p {self.port} {self.host} prints it)"
                ) from None
            raise BackendUnavailable(f"SSH to {target} failed: {exc}") from None
        except (TimeoutError, OSError, EOFError) as exc:
            raise BackendUnavailable(
                f"cannot reach {target} over SSH ({type(exc).__name__}: {exc}): check "
                f"{self._field}.host and port and that the login node is up"
            ) from None
        transport = conn.client.get_transport()
        if transport is not None:
            transport.set_keepalive(30)  # long waits: keep NATs and firewalls from dropping us
        return conn

    def session(self) -> Any:
        """The open fabric Connection (reopened if it dropped)."""
        with self._lock:
            if self._session is None or not self._session.is_connected:
                if self._session is not None:
                    with contextlib.suppress(Exception):  # free its socket and threads
                        self._session.close()
                self._session = self._open()
                for tunnel in self._tunnels:
                    tunnel.session = self._session
            return self._session

    def tunnel(self, job_dir: str) -> Any:
        """A NeMo-Run SSHTunnel on our connection, whose own authentication (prompt, then
        sys.exit) is replaced on this instance by ours."""
        run = nemo_run()
        tunnel = run.SSHTunnel(host=self.host, user=self.user, port=self.port, job_dir=job_dir)

        def authenticate() -> None:
            tunnel.session = self.session()

        tunnel._authenticate = authenticate  # instance attribute: SSHTunnel stays SSHTunnel
        with self._lock:
            self._tunnels = [*self._tunnels[-15:], tunnel]
        return tunnel

    def run(self, command: str, *, warn: bool = False) -> Any:
        """Run a command on the login node; BackendUnavailable on transport trouble."""
        from invoke.exceptions import CommandTimedOut, UnexpectedExit

        session = self.session()
        try:
            return session.run(command, hide=True, warn=warn, timeout=self._command_timeout_s)
        except UnexpectedExit as exc:
            result = exc.result
            raise BackendUnavailable(
                f"command on {self.user}@{self.host} failed (exit {result.exited}): "
                f"{(result.stderr or result.stdout).strip()[-300:]}"
            ) from None
        except CommandTimedOut:
            raise BackendUnavailable(
                f"command on {self.user}@{self.host} took over {self._command_timeout_s:g}s"
            ) from None
        except (OSError, EOFError) as exc:
            with self._lock:
                if self._session is session:  # another thread may have reopened already
                    self._session = None
            with contextlib.suppress(Exception):  # free its socket and transport thread
                session.close()
            raise BackendUnavailable(f"SSH to {self.user}@{self.host} broke: {exc}") from None

    def put(self, data: io.BytesIO, remote: str) -> None:
        """Upload bytes to a remote path over SFTP."""
        session = self.session()
        try:
            with self._sftp_lock:  # one SFTP channel per connection, shared by threads
                session.put(data, remote)
        except (OSError, EOFError) as exc:
            raise BackendUnavailable(f"SFTP upload to {self.host}:{remote} failed: {exc}") from None

    def put_private(self, data: bytes, remote: str) -> None:
        """Upload bytes to a new remote file that is 0600 before anything is written to it."""
        session = self.session()
        try:
            with self._sftp_lock:
                sftp = session.sftp()
                with sftp.open(remote, "wx") as handle:
                    sftp.chmod(remote, 0o600)
                    handle.write(data)
        except (OSError, EOFError) as exc:
            raise BackendUnavailable(f"SFTP upload to {self.host}:{remote} failed: {exc}") from None
