"""`SlurmBackend`: Slurm through NeMo-Run's SlurmExecutor, with native afterok dependencies.

Submission is NeMo-Run's: the executor writes the sbatch script and packages the code, its
torchx scheduler runs ``sbatch`` through the tunnel. Around it this backend adds what NeMo-Run
lacks: an SSH connection that never prompts or exits (key only, host key checked when
`known_hosts` is given), one SSH command per job submitted (`_launch`: the race-safe claim of
the job id on the cluster, the job dir unpacked from the command's stdin (no rsync, no key
file on disk), NeMo-Run's sbatch, Slurm's id recorded), secret env values in a 0600 file that
the batch script sources and deletes, batched status (one ``squeue`` + ``sacct`` per poll for all
jobs), ``sbatch --dependency=afterok:`` for upstream jobs on the same cluster, and the owner
flow run in each job's Slurm comment (``--comment=prefect_nemo.flow_run_id=<id>``), which
`owned_jobs` reads back with one ``squeue``.

The remote job dir's layout, and the claim that makes a job id exist there: `registry`.
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import io
import logging
import shlex
import shutil
import tarfile
import time
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.base import (
    EXPERIMENT_TITLE,
    NemoRunBackend,
    experiment_id,
    plain_env,
    poll_logs,
    secret_env,
)
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.slurm.accounting import (
    check_names,
    owned_command,
    owner_comment,
    parse_owned,
    parse_rows,
    row_status,
    sbatch_error,
    slurm_seconds,
    status_command,
)
from prefect_nemo.backends.nemo_run.slurm.git_mounts import GitMount, git_mounts, is_auto_mount
from prefect_nemo.backends.nemo_run.slurm.registry import (
    SCHEDULER,
    SlurmJobRegistry,
    _cleaned,
    _ids_lock,
)
from prefect_nemo.backends.nemo_run.slurm.ssh import SafeSSH
from prefect_nemo.errors import (
    BackendUnavailable,
    DependencyFailed,
    InvalidJobSpec,
    JobAlreadyExists,
)
from prefect_nemo.jobs import (
    META_FLOW_RUN,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    OwnedJob,
)
from prefect_nemo.packaging import build_archive, plan_for
from prefect_nemo.placement.errors import PlacementError
from prefect_nemo.placement.spec import to_slurm

#: The file (in the job's remote dir, 0600) the batch script sources the secret env from.
SECRET_ENV_FILE = ".secret-env"
_SSH_SETTINGS = inspect.signature(SafeSSH).parameters  # the config fields SafeSSH takes
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlurmConfig:
    """What the SlurmCluster block hands the backend (its field names; the key text in memory
    only). `field_prefix` names the block in error messages."""

    host: str
    user: str
    job_dir: str
    account: str
    port: int = 22
    identity: str | None = None
    identity_key: str | None = field(default=None, repr=False)
    known_hosts: str | None = None
    partition: str | None = None
    time: str = "01:00:00"
    nodes: int = 1
    ntasks_per_node: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    qos: str | None = None
    constraint: str | None = None
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    setup_lines: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    connect_timeout_s: float = 30.0
    command_timeout_s: float = 120.0
    field_prefix: str = "SlurmCluster"


class SlurmBackend(SlurmJobRegistry, NemoRunBackend):
    """Jobs on a Slurm cluster reached over SSH, submitted by NeMo-Run's SlurmExecutor."""

    kind: ClassVar[str] = "slurm"
    max_job_id_len: ClassVar[int] = names.MAX_LABEL

    def __init__(self, config: SlurmConfig, *, upstream: Sequence[JobHandle] = ()) -> None:
        super().__init__()
        self.config = config
        self.job_dir = config.job_dir.rstrip("/") or "/"
        self._ssh = SafeSSH.shared(
            **{k: v for k, v in dataclasses.asdict(config).items() if k in _SSH_SETTINGS}
        )
        self._field = config.field_prefix
        self._upstream = tuple(upstream)

    # -- identity

    @property
    def address(self) -> str:
        """The Slurm cluster as SSH sees it: user@host:port (native dependencies need the same)."""
        return f"{self.config.user}@{self.config.host}:{self.config.port}"

    @property
    def cluster(self) -> str:
        """The cluster and the remote job dir (job ids are claimed in that dir)."""
        return f"slurm://{self.address}{self.job_dir}"

    @property
    def credentials_key(self) -> str:
        """The SSH identity (a key file, or the key text the block holds), hashed."""
        return names.secret_hash(self.config.identity or "", self.config.identity_key or "")

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
        return type(self)(self.config, upstream=[*self._upstream, *upstream])

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
                f"{self.config.user}'s login shell (found: {result.stdout.split() or 'none'})"
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
        if {k.replace("_", "-") for k in self.config.additional_parameters} & {"comment"}:
            raise InvalidJobSpec(
                f"{self._field}.additional_parameters['comment']: prefect-nemo writes each job's "
                "Slurm comment (the flow run that owns it, for `prefect-nemo sweep`): remove it"
            )
        if spec.queue is not None:
            check_names(spec.queue, "JobSpec.queue", "partition", many=True)
        if spec.priority is not None:
            check_names(spec.priority, "JobSpec.priority", "QOS")
        time = self.config.time
        mounts = self.git_mounts()
        if mounts and not self.config.container_image:
            raise InvalidJobSpec(
                f"{self._field}.container_mounts: {mounts[0].url} is a container bind mount "
                f"(auto_mount): set {self._field}.container_image, or drop the entry (without a "
                "container NeMo-Run writes no mount into the sbatch script)"
            )
        limit = slurm_seconds(time, f"{self._field}.time")
        if spec.timeout_s is not None and limit is not None and spec.timeout_s > limit:
            raise InvalidJobSpec(
                f"JobSpec.timeout_s={spec.timeout_s:g} exceeds {self._field}.time={time} "
                f"(sbatch --time, {limit}s): raise {self._field}.time or lower timeout_s"
            )
        super().validate(spec)

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """NeMo-Run's launch, in one SSH command: NeMo-Run's dry run writes the job's files
        here, then its ``sbatch`` runs as `_launch` (claim, unpack the files sent on stdin,
        sbatch, record). sbatch refusing the job is an error naming the block field."""
        from invoke.exceptions import UnexpectedExit
        from nemo_run.run.torchx_backend.launcher import launch

        meta = {**spec.metadata, **metadata}
        claimed: list[bool] = []  # set by _launch once the script says it holds the claim
        try:
            executor, app, name, dryrun_info = self.dry_run(spec, job_id, meta)
            for mount in self.git_mounts():
                self.run(mount.clone_command())
            files = self._bundle(spec, executor)
            script = f"{self.remote_dir(job_id)}/{executor.job_name}_sbatch.sh"

            def run_sbatch(command: str) -> Any:
                return self._launch(job_id, meta, files, command, script, claimed)

            with self._ssh.expect(script, run_sbatch), root_logger_kept():
                app_handle, _ = launch(
                    app, name, executor, dryrun=False, runner=self.runner, dryrun_info=dryrun_info
                )
        except BaseException as exc:
            shutil.rmtree(self.local_experiment_dir(job_id), ignore_errors=True)
            if claimed:  # ours: undo it (and scancel whatever sbatch may have taken)
                self.release(job_id)
            if isinstance(exc, UnexpectedExit):
                overrides = {"partition": "JobSpec.queue"} if spec.queue is not None else {}
                if spec.priority is not None:
                    overrides["qos"] = "JobSpec.priority"
                raise sbatch_error(exc, self._field, overrides) from None
            raise
        if not secret_env(spec):
            with _ids_lock:  # no secret file to remove once it ends
                _cleaned.add((self.cluster, job_id))
        self.after_schedule(spec, job_id, app_handle)
        return self.handle(job_id)

    def _bundle(self, spec: JobSpec, executor: Any) -> bytes:
        """The local job dir (sbatch script, job scripts, code) as a tar.gz in memory, with the
        secret env file as a 0600 member: it is never written to disk here, and on the
        cluster tar creates it 0600 in the job's 0700 dir."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
            for path in sorted(Path(executor.experiment_dir).iterdir()):
                tar.add(path, arcname=path.name)
            secrets = secret_env(spec)
            if secrets:
                body = "".join(f"{k}={shlex.quote(v)}\n" for k, v in secrets.items()).encode()
                info = tarfile.TarInfo(SECRET_ENV_FILE)
                info.size, info.mode, info.mtime = len(body), 0o600, int(time.time())
                tar.addfile(info, io.BytesIO(body))
        return buf.getvalue()

    def _launch(
        self,
        job_id: str,
        metadata: dict[str, str],
        files: bytes,
        command: str,
        script: str,
        claimed: list[bool],
    ) -> Any:
        """NeMo-Run's ``sbatch`` as one SSH command: claim the job id (JobAlreadyExists when
        taken), unpack the job's files from stdin, sbatch, record Slurm's id. Returns what
        the tunnel's run would (stdout: the id); sbatch's refusal is invoke's UnexpectedExit.
        NeMo-Run's own script path is replaced by this job's (`SafeSSH.expect`)."""
        from invoke.exceptions import UnexpectedExit
        from invoke.runners import Result

        q = shlex.quote
        d = q(self.remote_dir(job_id))
        sbatch = " ".join([*command.split()[:-1], q(script)])
        record = self.record_command(job_id, '"$sid"', metadata)
        then = (
            f"tar --no-same-owner -xzf - -C {d} || exit 4; echo UNPACKED; "
            f'sid=$({sbatch}) || exit $?; echo "SUBMITTED $sid"; '
            f"{{ {record}; }} || echo UNRECORDED"
        )
        drain = "cat >/dev/null"  # read what was sent, so the sender is not cut off
        remote = self.claim_command(job_id, metadata, then=then, exists=drain)
        code, out, err = self._ssh.run_with_input(remote, files)
        lines = out.splitlines()
        if "CLAIMED" in lines:
            claimed.append(True)
        if "EXISTS" in lines:
            raise JobAlreadyExists(f"Slurm job '{job_id}' already exists on {self.address}")
        sids = [ln.removeprefix("SUBMITTED").strip() for ln in lines if ln.startswith("SUBMITTED")]
        if code == 0 and sids and sids[-1]:
            self.remember(job_id, sids[-1])
            if "UNRECORDED" in lines:  # the job runs: watch it; a re-run finds it by its name
                log.warning(
                    "job %s is submitted (%s) but not recorded: %s", job_id, sids[-1], err[-300:]
                )
            return Result(stdout=sids[-1], stderr=err, exited=0, command=sbatch)
        if "UNPACKED" in lines:
            raise UnexpectedExit(Result(stdout="", stderr=err, exited=code, command=sbatch))
        raise BackendUnavailable(
            f"could not {'unpack the job files in' if claimed else 'claim'} "
            f"{self.remote_dir(job_id)} (exit {code}): {(err or out).strip()[-300:]}"
        )

    def make_executor(self, spec: JobSpec, job_id: str) -> Any:
        """NeMo-Run's SlurmExecutor for spec: placement/resources over the block's defaults,
        plain env in the script, secret env sourced from a 0600 file, code via our archive."""
        run = nemo_run()
        alloc: dict[str, Any] = {
            "nodes": self.config.nodes,
            "gpus_per_node": self.config.gpus_per_node,
            "cpus_per_task": self.config.cpus_per_task,
            "constraint": self.config.constraint,
            "mem": self.config.mem,
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
        extra = dict(self.config.additional_parameters)
        deps = self._dependency_ids() if job_id != "validate" else []
        if deps:
            extra["kill_on_invalid_dep"] = "yes"  # a failed upstream cancels us, not a hang
        executor = run.SlurmExecutor(
            account=self.config.account,
            # where the job queues: the JobSpec's partition and QOS over the block's
            partition=spec.queue or self.config.partition,
            time=self.config.time,
            ntasks_per_node=self.config.ntasks_per_node,
            qos=spec.priority or self.config.qos,
            container_image=self.config.container_image,
            container_mounts=[
                *(m for m in self.config.container_mounts if not is_auto_mount(m)),
                *(m.mount for m in self.git_mounts()),
            ],
            additional_parameters=extra or None,
            setup_lines=self._setup_lines(spec, job_id),
            tunnel=self._ssh.tunnel(self.job_dir),
            packager=run.Packager(),
            dependencies=[f"{SCHEDULER}://nemo_run/{sid}" for sid in deps],
            dependency_type="afterok",
            poll_estimated_start_time=False,
            env_vars=dict(self.config.env),
            **{k: v for k, v in alloc.items() if v is not None},
        )
        from nemo_run.core.execution.slurm import SlurmJobDetails

        executor.job_details = SlurmJobDetails(job_name=job_id)
        if spec.launcher == "torchrun":  # one srun task per node, torchrun starts one per GPU
            executor.torchrun_nproc_per_node = alloc.get("gpus_per_node") or 1
        return executor

    def git_mounts(self) -> list[GitMount]:
        """The block's ``${auto_mount:git+...}`` container mounts, cloned under our job dir."""
        root = f"{self.remote_root()}/git-mounts"
        return git_mounts(self.config.container_mounts, root, f"{self._field}.container_mounts")

    def carry_owner(self, executor: Any, metadata: dict[str, str]) -> None:
        """The owner flow run in the job's Slurm comment (NeMo-Run writes ``#SBATCH --comment``)."""
        executor.comment = owner_comment(metadata.get(META_FLOW_RUN, ""))

    def make_task(self, spec: JobSpec, job_id: str) -> Any:
        """The entrypoint as an inline script, or the spec's NeMo-Run task as it is (run in
        the code dir, where NeMo-Run's runner imports it); env goes through setup_lines
        (quoted, case kept)."""
        if spec.task is not None:
            return spec.task.build()
        return nemo_run().Script(inline=spec.entrypoint)

    def task_env(self, spec: JobSpec) -> dict[str, str]:
        """Nothing on the executor: setup_lines carries the env (NeMo-Run's own export of
        env_vars upper-cases names and leaves values unquoted)."""
        return {}

    def _setup_lines(self, spec: JobSpec, job_id: str) -> str:
        # NeMo-Run writes `export KEY.upper()=value` unquoted; we write the env ourselves.
        lines = [self.config.setup_lines] if self.config.setup_lines else []
        if self.config.additional_parameters.get("no_requeue"):
            # NeMo-Run's `sbatch --requeue` on the command line overrides the script's
            # `#SBATCH --no-requeue`: the job clears its flag as it starts, before its command,
            # so that a failed node or a preemption ends it (NODE_FAIL, PREEMPTED) and its
            # RecoveryPolicy resubmits it, rather than Slurm putting it back in its queue
            lines.append('scontrol update jobid="$SLURM_JOB_ID" requeue=0 || true')
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

    def documents(
        self, spec: JobSpec, job_id: str, executor: Any, dryrun_info: Any
    ) -> list[dict[str, Any]]:
        """The sbatch script NeMo-Run's dry run wrote and the job script its srun runs, at the
        paths `submit` ships them to, and (names only) the secret env file beside them."""
        local, remote = Path(executor.experiment_dir), self.remote_dir(job_id)
        sbatch = f"{executor.job_name}_sbatch.sh"
        out: list[dict[str, Any]] = [
            {
                "kind": "SbatchScript",
                "host": self.address,
                "path": f"{remote}/{sbatch}",
                "script": (local / sbatch).read_text(),
            }
        ]
        for path in sorted((local / job_id / "scripts").glob("*.sh")):
            out.append(
                {
                    "kind": "JobScript",
                    "host": self.address,
                    "path": f"{remote}/{path.relative_to(local)}",
                    "script": path.read_text(),
                }
            )
        secrets = secret_env(spec)
        if secrets:  # the values go over SSH into a 0600 file, never into a document
            out.append(
                {
                    "kind": "SecretEnvFile",
                    "host": self.address,
                    "path": f"{remote}/{SECRET_ENV_FILE}",
                    "mode": "0600",
                    "variables": sorted(secrets),
                }
            )
        return out

    def after_schedule(self, spec: JobSpec, job_id: str, app_handle: str) -> None:
        """The local copy of the job dir served its purpose (the cluster has it): drop it."""
        shutil.rmtree(self.local_experiment_dir(job_id), ignore_errors=True)

    # -- status, stop, logs

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """One squeue + sacct round trip for all the jobs (sacct may lag a just-submitted job;
        squeue never does)."""
        self._lookup(job_ids)
        ids = {j: sid for j in job_ids if (sid := self._slurm_id(j))}
        if not ids:
            return {}
        output = self.run(status_command(ids.values()), warn=True).stdout
        rows = parse_rows(output, set(ids.values()))
        out = {
            job_id: row_status(job_id, sid, rows[sid]) for job_id, sid in ids.items() if sid in rows
        }
        self._clean_secrets([j for j, s in out.items() if s.state.is_terminal()])
        return out

    def owned_jobs(self) -> list[OwnedJob]:
        """Our live jobs of this job dir: one squeue of the login user's queue, keeping the jobs
        whose comment names an owner (`owner_comment`) and whose batch script is in this job
        dir; a job sbatch'ed by hand has no such comment and is never listed."""
        return parse_owned(self.run(owned_command()).stdout, self.remote_root())

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
        sid = self._slurm_id(job_id)
        if not sid:
            self._lookup([job_id])
            sid = self._slurm_id(job_id)
        if sid:
            secret = shlex.quote(f"{self.remote_dir(job_id)}/{SECRET_ENV_FILE}")
            self.run(f"scancel {sid}; rm -f {secret}", warn=True)

    def logs(self, job_id: str) -> str:
        """The job's output (its srun logs; the batch log when srun never started)."""
        return self._log_from(job_id, 0, batch_log=True).decode(errors="replace")

    def _log_from(self, job_id: str, offset: int, *, batch_log: bool = False) -> bytes:
        """The job's srun logs (one per run: a requeued job has one more) from byte `offset`
        on (only the new part crosses the network); with `batch_log`, the batch script's log
        when srun never started. A stream reads the srun logs alone: its offset must count
        bytes of one text, and the batch log it would read until srun starts is another
        (CI: a stream 1 kB into the batch log read nothing of a 108-byte srun log).

        It crosses in base64: the SSH library decodes a command's output in 1,000-byte pieces,
        so a character split between two pieces, or a byte that is no UTF-8, would come back
        as replacement characters of another length, and the next read would start at the
        wrong byte (a line cut, a report lost)."""
        sid = self._slurm_id(job_id)
        if not sid:
            self._lookup([job_id])
            sid = self._slurm_id(job_id)
        if not sid:
            return b""
        d = shlex.quote(f"{self.remote_dir(job_id)}/{job_id}")
        j = shlex.quote(job_id)
        fallback = f"|| cat {d}/sbatch_{j}_{sid}.out 2>/dev/null" if batch_log else ""
        command = (
            f"{{ ls {d}/log-{j}_{sid}_*.out >/dev/null 2>&1 && cat {d}/log-{j}_{sid}_*.out "
            f"{fallback}; }} | tail -c +{offset + 1} | base64; true"
        )
        output: str = self.run(command, warn=True).stdout
        return base64.b64decode(output)  # its line breaks are skipped

    def close(self) -> None:
        """Nothing to stop: this backend starts no threads. The SSH connection is not closed
        here: `SafeSSH.shared` gives every backend of these settings in the process one
        connection on purpose (a block builds a backend per task); it is closed at
        interpreter exit (`ssh.close_all`)."""

    def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """The log from its start, then each second what was appended (read from the last
        byte offset, so a long training log is not re-read), until the job ends."""
        return poll_logs(self, job_id, self._log_from)
