"""`NemoRunBackend`: the Backend protocol on NeMo-Run's lower-level launch path.

No Experiment and no interactive UI: for each job the backend builds a NeMo-Run executor and
a `run.Script`, calls ``executor.assign`` and ``torchx_backend.packaging.package``, then
``torchx_backend.launcher.launch`` twice through one torchx runner (a dry run that writes the
job's files locally, the `before_schedule` hook, then the real launch), which returns the app
handle (``slurm_tunnel://nemo_run/<id>``, ``local_persistent://nemo_run/<id>``, ...).
Status, stop and logs go through the same runner (``status``/``cancel``/``log_lines``)
unless a subclass answers them more directly.

A subclass (one per NeMo-Run executor: `slurm.SlurmBackend`, `local.NemoRunLocalBackend`; the
Lepton and DGX Cloud backends extend `service.ServiceBackend`, which submits through the
executor's own ``launch()`` instead of torchx) implements:

- ``kind``, ``cluster`` and ``secrets``: the Backend identity.
- ``make_executor(spec, job_id)``: the NeMo-Run executor for this spec, with every secret kept
  out of it (NeMo-Run writes executors to disk); raise InvalidJobSpec for what it cannot run.
- ``claim(job_id, metadata)``: take the job id or raise JobAlreadyExists (submit-or-attach);
  ``release(job_id)`` undoes a claim whose launch failed; ``record(job_id, app_handle,
  metadata)`` stores the handle; ``app_handle(job_id)`` finds it again (None: no such job)
  and ``job_metadata(job_id)`` the metadata (drift checks). The default keeps a registry
  under NEMORUN_HOME (one machine; ``_app_status(entry)`` says whether a recorded app still
  exists); a backend whose service can look jobs up by name should do that instead, so a
  re-run from another machine attaches too.
- ``owned_jobs()``: the live jobs we submitted, each with its owner flow run, read from the
  service (never from the registry: a sweeper runs on another machine); ``carry_owner`` puts
  the owner on the executor, where the service keeps it with the job (Slurm: the comment).
- optionally ``make_task`` (the default runs the entrypoint as an inline bash script, plain env
  only), ``before_launch`` (the executor has its local job dir: put files there),
  ``before_schedule`` (after the dry run wrote the job's files, before submission; Slurm
  overrides ``submit`` instead, to send them with its sbatch), ``after_schedule``, ``statuses``,
  ``request_stop``, ``logs``, ``tail_logs`` (the defaults use the torchx runner, one runner
  per cluster in the process, and poll the log every second: `poll_logs`), ``close``, and
  ``documents`` (a dry run's documents from NeMo-Run's own dry run: `render` runs the first
  half of `submit`, `dry_run`, in a scratch dir).

A block hands its backend a frozen config dataclass built by `config_from` (its fields by name).

Everything NeMo-Run does is wrapped in `isolation.root_logger_kept()`; nemo_run is imported only
through `isolation.nemo_run()`, which isolates NEMORUN_HOME first.

Nothing here imports Prefect.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import SecretStr

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec, JobAlreadyExists
from prefect_nemo.jobs import Backend, JobHandle, JobSpec, JobState, JobStatus, OwnedJob

#: NeMo-Run experiment title of every job we launch: its files live under
#: ``<NEMORUN_HOME>/experiments/prefect-nemo/prefect-nemo_<job id>/``.
EXPERIMENT_TITLE = "prefect-nemo"
#: A claim with no app handle after this long was left by a submitter that died mid-launch.
STALE_CLAIM_S = 120.0
#: The environment variable that carries a job's owner (the flow run that submitted it, or
#: empty) where the service lists a job's env but not its labels (run:ai) or runs a process
#: (local); the job can read it too.
OWNER_ENV = "PREFECT_NEMO_FLOW_RUN_ID"

# torchx AppState names -> ours. UNKNOWN is absent on purpose: it is no observation.
_APP_STATES = {
    "UNSUBMITTED": JobState.PENDING,
    "SUBMITTED": JobState.PENDING,
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "SUCCEEDED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "CANCELLED": JobState.STOPPED,
}


C = TypeVar("C")
log = logging.getLogger(__name__)
_runners: dict[tuple[str, str], Any] = {}
_runners_lock = threading.Lock()
# One dry run at a time: a scheduler is shared per cluster, and NeMo-Run's Slurm dry run
# swaps the scheduler's tunnel for the job's and then reads it back, so two at once could
# write one job's paths into the other's script. The dry run only writes local files.
_dry_run_lock = threading.Lock()


def job_state(app_state: Any) -> JobState | None:
    """Our JobState for a torchx AppState (None for UNKNOWN: no answer yet)."""
    return _APP_STATES.get(getattr(app_state, "name", str(app_state)))


def experiment_id(job_id: str) -> str:
    """The NeMo-Run experiment id of a job: title, '_', job id (NeMo-Run splits on the last
    '_'; job ids have none)."""
    return f"{EXPERIMENT_TITLE}_{job_id}"


class NemoRunBackend(ABC):
    """Submit, watch, stop and read logs of jobs through one NeMo-Run executor kind."""

    kind: ClassVar[str]
    max_job_id_len: ClassVar[int] = names.MAX_LABEL

    # -- identity (subclasses)

    @property
    @abstractmethod
    def cluster(self) -> str:
        """A stable identity of the cluster or service this backend submits to."""

    @property
    def credentials_key(self) -> str:
        """The secrets, hashed (a backend whose secrets change while it lives, a refreshed
        token, says what stays instead)."""
        return names.secret_hash(*self.secrets)

    @property
    def secrets(self) -> list[str]:
        """Secret values of this backend's credentials, for redaction."""
        return []

    def links(self, job_id: str) -> dict[str, str]:
        """URLs or paths to look at the job (none by default)."""
        return {}

    def handle(self, job_id: str) -> JobHandle:
        """The handle of a job id on this cluster."""
        return JobHandle(
            backend=self.kind, cluster=self.cluster, job_id=job_id, links=self.links(job_id)
        )

    # -- hooks

    @abstractmethod
    def make_executor(self, spec: JobSpec, job_id: str) -> Any:
        """The NeMo-Run executor that runs `spec`, with no secret in it."""

    def make_task(self, spec: JobSpec, job_id: str) -> Any:
        """The NeMo-Run task: the spec's own (JobSpec.task: a run.Partial or run.Script, as
        NeMo-Run runs it; its env goes on the executor, `task_env`), else the entrypoint as an
        inline bash script with the plain env.

        Secret env values are not put here (NeMo-Run may write the task to disk): a backend
        delivers them its own way (see `secret_env`)."""
        if spec.task is not None:
            return spec.task.build()
        run = nemo_run()
        return run.Script(inline=spec.entrypoint, env=plain_env(spec))

    def task_env(self, spec: JobSpec) -> dict[str, str]:
        """The env a JobSpec.task's executor gets (NeMo-Run packages it with the task): the
        plain env; secrets go their backend's own way."""
        return plain_env(spec)

    def carry_owner(self, executor: Any, metadata: dict[str, str]) -> None:  # noqa: B027
        """Put the job's owner (the flow run in `metadata`) on the executor, where the service
        keeps it with the job for `owned_jobs` (Slurm: its comment; local: its process env)."""

    def before_launch(self, spec: JobSpec, job_id: str, executor: Any) -> None:  # noqa: B027
        """Called once the executor is assigned its job dir, before NeMo-Run packages the task."""

    def before_schedule(self, spec: JobSpec, job_id: str, executor: Any, dryrun_info: Any) -> None:  # noqa: B027
        """Called after the dry run wrote the job's local files and before the job is submitted."""

    def after_schedule(self, spec: JobSpec, job_id: str, app_handle: str) -> None:  # noqa: B027
        """Called once the job is submitted (its app handle is known)."""

    # -- the job registry: claim / record / look up

    def registry_dir(self) -> Path:
        """Where the default registry keeps one small JSON file per job (under NEMORUN_HOME)."""
        home = Path(nemo_run().config.get_nemorun_home())
        return home / "prefect-nemo" / names.dns_label(self.kind) / names.stable_hash(self.cluster)

    def _entry(self, job_id: str) -> Path:
        return self.registry_dir() / f"{job_id}.json"

    def _read_entry(self, job_id: str) -> dict[str, Any] | None:
        try:
            entry: dict[str, Any] = json.loads(self._entry(job_id).read_text() or "{}")
            return entry
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # being written: a claim without a handle yet

    def claim(self, job_id: str, metadata: dict[str, str]) -> None:
        """Take job_id in the local registry (O_EXCL create) or raise JobAlreadyExists."""
        path = self._entry(job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                entry = self._read_entry(job_id) or {}
                stale = not entry.get("app_handle") and _age_s(path) > STALE_CLAIM_S
                if stale or (entry.get("app_handle") and self._app_status(entry) is None):
                    path.unlink(missing_ok=True)  # its submitter died, or the app is gone
                    continue
                raise JobAlreadyExists(f"{self.kind} job '{job_id}' already exists") from None
            with os.fdopen(fd, "w") as out:
                json.dump({"metadata": metadata}, out)
            return
        raise JobAlreadyExists(f"{self.kind} job '{job_id}' is being claimed by someone else")

    def release(self, job_id: str) -> None:
        """Undo a claim whose launch failed, so the next attempt may submit."""
        self._entry(job_id).unlink(missing_ok=True)

    def record(self, job_id: str, app_handle: str, metadata: dict[str, str]) -> None:
        """Store the app handle of a submitted job (or of one found on the service: this
        machine may have no registry yet)."""
        path = self._entry(job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"app_handle": app_handle, "metadata": metadata}))
        tmp.chmod(0o600)
        tmp.replace(path)

    def app_handle(self, job_id: str) -> str | None:
        """The app handle recorded for job_id, or None."""
        entry = self._read_entry(job_id) or {}
        return entry.get("app_handle")

    def job_metadata(self, job_id: str) -> dict[str, str]:
        """The metadata stored with the job at submit (for drift checks)."""
        entry = self._read_entry(job_id) or {}
        return dict(entry.get("metadata") or {})

    # -- the torchx runner

    @property
    def runner(self) -> Any:
        """The torchx runner (NeMo-Run's) of this cluster, shared in the process: a scheduler
        keeps what it launched in memory (the local one holds the processes), and a block
        builds a new backend object for every task."""
        key = (self.kind, self.cluster)
        with _runners_lock:
            runner = _runners.get(key)
            if runner is None:
                nemo_run()
                from nemo_run.run.torchx_backend.runner import get_runner

                with root_logger_kept():
                    runner = _runners[key] = get_runner()
            return runner

    def _app_status(self, entry: dict[str, Any]) -> Any:
        with root_logger_kept():
            return self.runner.status(entry["app_handle"])

    # -- Backend protocol

    def validate(self, spec: JobSpec) -> None:
        """Reject what the executor cannot run: builds the executor without submitting."""
        if spec.runtime_env:
            raise InvalidJobSpec(
                f"JobSpec.runtime_env is Ray-only; the {self.kind} backend cannot use it: set "
                "env, working_dir and placement instead"
            )
        if spec.label_selector:
            raise InvalidJobSpec(
                f"JobSpec.label_selector is Ray-only; on {self.kind} say where the job runs with "
                "JobSpec.placement (node_labels)"
            )
        if OWNER_ENV in spec.env:
            raise InvalidJobSpec(
                f"JobSpec.env['{OWNER_ENV}'] is set by prefect-nemo (the flow run that submitted "
                "the job): pick another name"
            )
        self.make_executor(spec, "validate")

    def check_access(self) -> None:  # noqa: B027
        """Nothing to reach by default (local): subclasses connect and authenticate here."""

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Launch the spec as job_id through NeMo-Run; JobAlreadyExists if the id is taken."""
        nemo_run()
        from nemo_run.run.torchx_backend.launcher import launch

        meta = {**spec.metadata, **metadata}
        self.claim(job_id, meta)
        try:
            executor, app, name, dryrun_info = self.dry_run(spec, job_id, meta)
            self.before_schedule(spec, job_id, executor, dryrun_info)
            with root_logger_kept():
                app_handle, _ = launch(
                    app, name, executor, dryrun=False, runner=self.runner, dryrun_info=dryrun_info
                )
        except BaseException:
            self.release(job_id)
            raise
        try:
            self.record(job_id, app_handle, meta)
            self.after_schedule(spec, job_id, app_handle)
        except Exception as exc:  # the job runs: watch it; a re-run finds it by its name
            log.warning("job %s is submitted (%s) but not recorded: %s", job_id, app_handle, exc)
        return self.handle(job_id)

    def dry_run(
        self, spec: JobSpec, job_id: str, metadata: dict[str, str], local_dir: Path | None = None
    ) -> tuple[Any, Any, str, Any]:
        """NeMo-Run's own dry run of the job, the first half of `submit` and all of `render`:
        (executor, app, scheduler name, dryrun info); the job's files are written locally
        (in `local_dir` when given) and nothing is sent."""
        nemo_run()
        from nemo_run.run.torchx_backend.launcher import launch
        from nemo_run.run.torchx_backend.packaging import package
        from nemo_run.run.torchx_backend.schedulers.api import get_executor_str

        executor = self.assigned_executor(spec, job_id, local_dir)
        self.carry_owner(executor, metadata)
        if spec.task is not None:
            executor.env_vars = {**executor.env_vars, **self.task_env(spec)}
        task = self.make_task(spec, job_id)
        self.before_launch(spec, job_id, executor)
        with _dry_run_lock, root_logger_kept():
            app = package(job_id, task, executor=executor, serialize_metadata_for_scripts=False)
            name = get_executor_str(executor)
            _, dryrun_info = launch(app, name, executor, dryrun=True, runner=self.runner)
        return executor, app, name, dryrun_info

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """What `submit` would send, from NeMo-Run's own dry run (`dry_run`), its files written
        to a scratch dir (a live job's dir is left alone) and shown at their real paths."""
        with tempfile.TemporaryDirectory(prefix="prefect-nemo-render-") as scratch:
            meta = {**spec.metadata, **metadata}
            executor, _, _, dryrun_info = self.dry_run(spec, job_id, meta, Path(scratch))
            documents = self.documents(spec, job_id, executor, dryrun_info)
        moved: list[dict[str, Any]] = relocated(
            documents, scratch, str(self.local_experiment_dir(job_id))
        )
        return moved

    def documents(
        self, spec: JobSpec, job_id: str, executor: Any, dryrun_info: Any
    ) -> list[dict[str, Any]]:
        """The dry run as documents (`render`): the scheduler's request by default."""
        return [{"kind": "NemoRunRequest", "request": str(dryrun_info)}]

    def assigned_executor(self, spec: JobSpec, job_id: str, local_dir: Path | None = None) -> Any:
        """`make_executor`, assigned its experiment and a fresh local job dir (`local_dir` for
        a dry run: the remote paths still follow the real local layout, which they mirror)."""
        executor = self.make_executor(spec, job_id)
        if spec.launcher is not None:  # NeMo-Run's own launcher; nodes x procs from make_executor
            executor.launcher = spec.launcher
        exp_dir = self.local_experiment_dir(job_id)
        executor.assign(experiment_id(job_id), str(exp_dir), job_id, job_id)
        if local_dir is None:
            shutil.rmtree(exp_dir, ignore_errors=True)  # a released attempt's leftovers
        else:
            executor.experiment_dir = str(local_dir)
            executor.job_dir = str(local_dir / job_id)
        executor.create_job_dir()
        return executor

    def local_experiment_dir(self, job_id: str) -> Path:
        """Where NeMo-Run writes the job's files on this machine."""
        home = Path(nemo_run().config.get_nemorun_home())
        return home / "experiments" / EXPERIMENT_TITLE / experiment_id(job_id)

    def job_status(self, job_id: str) -> JobStatus | None:
        """One job's status through the torchx runner; None when no job has that id. Service
        backends override this hook (one GET per job); Slurm overrides `statuses` (batched)."""
        app_handle = self.app_handle(job_id)
        if not app_handle:
            return None
        with root_logger_kept():
            status = self.runner.status(app_handle)
        state = job_state(status.state) if status is not None else None
        if state is None:
            return None
        return JobStatus(job_id=job_id, state=state, message=_msg(status.msg))

    def find(self, job_id: str) -> JobStatus | None:
        """The job's status with the metadata stored at submit, or None."""
        status = self.statuses([job_id]).get(job_id)  # Slurm batches statuses: one way in
        if status is None:
            return None
        return status.model_copy(update={"metadata": self.job_metadata(job_id)})

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """The statuses of the jobs that exist, one `job_status` call per job."""
        found = {job_id: self.job_status(job_id) for job_id in job_ids}
        return {job_id: status for job_id, status in found.items() if status is not None}

    @abstractmethod
    def owned_jobs(self) -> list[OwnedJob]:
        """The live jobs we submitted, with their owner flow run, as the service lists them."""

    def request_stop(self, job_id: str) -> None:
        """Ask the scheduler to cancel the job (no waiting)."""
        app_handle = self.app_handle(job_id)
        if app_handle:
            with root_logger_kept():
                self.runner.cancel(app_handle)

    def logs(self, job_id: str) -> str:
        """The job's whole log so far, read through the runner."""
        app_handle = self.app_handle(job_id)
        if not app_handle:
            return ""
        with root_logger_kept():
            lines = self.runner.log_lines(app_handle, job_id, k=0, should_tail=False)
            return "".join(line if line.endswith("\n") else line + "\n" for line in lines)

    def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """The log from its start, then what is appended, read every second until the job ends."""
        return poll_logs(self, job_id)

    def close(self) -> None:  # noqa: B027
        """Nothing to stop by default: NeMo-Run backends start no threads of their own. The
        torchx runner is not closed: it is shared on purpose by every backend of the cluster
        in the process (the local scheduler holds the processes it launched)."""


async def poll_logs(
    backend: Backend, job_id: str, read_from: Callable[[str, int], bytes] | None = None
) -> AsyncGenerator[str, None]:
    """A job's log every second, yielding what is new, until the job ends (or is gone).

    `read_from(job_id, offset)` returns the log's bytes from byte `offset` on (a backend that
    can read only the new part passes it); by default the whole log is re-read through
    `backend.logs` and cut, and its unfinished last line is left for the next read, which sees
    it whole (a backend may put its own words back in order up to there: Ray's "Running
    entrypoint" line). The offset counts bytes read, never the text they decode to: a
    character split between two reads is decoded whole, and a byte that is no UTF-8 (one
    replacement character, three bytes in UTF-8) moves it by one, as it should. A read that
    fails (BackendUnavailable, RuntimeError) is tried again next second."""
    read = read_from or functools.partial(_log_after, backend)
    whole_lines = read_from is None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = 0
    while True:
        status = await asyncio.to_thread(backend.statuses, [job_id])
        done = job_id not in status or status[job_id].state.is_terminal()
        data = b""
        with contextlib.suppress(BackendUnavailable, RuntimeError):
            data = await asyncio.to_thread(read, job_id, offset)
        if whole_lines and not done:
            data = data[: data.rfind(b"\n") + 1]
        offset += len(data)
        chunk = decoder.decode(data, final=done)
        if chunk:
            yield chunk
        if done:
            return
        await asyncio.sleep(1.0)


def _log_after(backend: Backend, job_id: str, offset: int) -> bytes:
    return backend.logs(job_id).encode()[offset:]


def relocated(value: Any, old: str, new: str) -> Any:
    """A copy of a document with every string's `old` path prefix replaced by `new`."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: relocated(v, old, new) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [relocated(v, old, new) for v in value]
    return value


def config_from(config_type: type[C], values: Mapping[str, Any]) -> C:
    """A backend's config dataclass from a block's field values of the same names (secrets
    revealed, lists and dicts copied); what the block lacks keeps the config's default."""
    wanted = {f.name for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    return config_type(**{k: _plain(v) for k, v in values.items() if k in wanted})


def _plain(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else copy.deepcopy(value)


def plain_env(spec: JobSpec) -> dict[str, str]:
    """The spec's env without its secret values."""
    return {k: v for k, v in spec.env.items() if isinstance(v, str)}


def secret_env(spec: JobSpec) -> dict[str, str]:
    """Only the spec's secret env values, revealed (for delivery to the job, never to disk)."""
    plain = spec.plain_env()
    return {k: plain[k] for k, v in spec.env.items() if not isinstance(v, str)}


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _msg(text: str | None) -> str:
    return "" if not text or text == "<NONE>" else text
