"""Jobs as local processes through NeMo-Run's LocalExecutor (tests, laptops).

NeMo-Run's local scheduler keeps the processes it started in memory, in this process's runner:
only this process lists (`owned_jobs`) and stops them. Each process carries its owner in its
environment (`OWNER_ENV`)."""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from prefect_nemo.backends.nemo_run.base import OWNER_ENV, NemoRunBackend, job_state
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.jobs import META_FLOW_RUN, JobSpec, OwnedJob
from prefect_nemo.packaging import collect_source, stage_source

#: NeMo-Run's torchx scheduler for the LocalExecutor (its app handles' scheme).
SCHEDULER = "local_persistent"


class NemoRunLocalBackend(NemoRunBackend):
    """Runs each job as a process on this machine via NeMo-Run's LocalExecutor."""

    kind: ClassVar[str] = "nemo-run-local"

    def __init__(self, *, env: dict[str, str] | None = None) -> None:
        super().__init__()
        self._env = dict(env or {})

    @property
    def cluster(self) -> str:
        """This machine."""
        return f"local://{socket.gethostname()}"

    def links(self, job_id: str) -> dict[str, str]:
        """The job's directory (its logs are there)."""
        return {"job_dir": str(self.local_experiment_dir(job_id) / job_id)}

    def validate(self, spec: JobSpec) -> None:
        """The local executor runs one process: no multi-node placement."""
        if spec.placement is not None and spec.placement.nodes > 1:
            raise InvalidJobSpec(
                f"JobSpec.placement.nodes={spec.placement.nodes}: the local executor runs on "
                "one machine; use nodes=1 or a Slurm/Lepton/DGX Cloud cluster"
            )
        super().validate(spec)

    def make_executor(self, spec: JobSpec, job_id: str) -> Any:
        """A LocalExecutor; env from the block, then the job's plain env; under torchrun one
        process per GPU of the placement (at least one)."""
        run = nemo_run()
        procs = 1
        if spec.launcher == "torchrun" and spec.placement is not None:
            procs = max(1, spec.placement.gpus_per_node)
        return run.LocalExecutor(ntasks_per_node=procs, env_vars=dict(self._env))

    def carry_owner(self, executor: Any, metadata: dict[str, str]) -> None:
        """The owner in the process's environment."""
        executor.env_vars = {**executor.env_vars, OWNER_ENV: metadata.get(META_FLOW_RUN, "")}

    def owned_jobs(self) -> list[OwnedJob]:
        """The live jobs of this process's local runner whose process carries `OWNER_ENV`,
        read from the process's environment (torchx's local scheduler has no public view of
        its processes: its apps are read directly)."""
        import psutil

        scheduler = self.runner._scheduler(SCHEDULER)
        found = []
        for app_id, app in list(scheduler._apps.items()):
            with root_logger_kept():
                described = scheduler.describe(app_id)  # polls the processes
            state = job_state(described.state) if described else None
            replicas = [r for rs in app.role_replicas.values() for r in rs]
            if state is None or state.is_terminal() or not replicas:
                continue
            try:
                process = psutil.Process(replicas[0].proc.pid)
                env = process.environ()
                started = datetime.fromtimestamp(process.create_time(), tz=UTC)
            except psutil.Error:  # ended meanwhile, or not ours to read
                continue
            if OWNER_ENV in env:
                found.append(
                    OwnedJob(
                        job_id=app_id.rsplit("-", 1)[0],  # torchx's app id: <job id>-<suffix>
                        state=state,
                        flow_run_id=env[OWNER_ENV] or None,
                        submitted_at=started,
                    )
                )
        return found

    def documents(
        self, spec: JobSpec, job_id: str, executor: Any, dryrun_info: Any
    ) -> list[dict[str, Any]]:
        """The process the local scheduler would start (its torchx Popen request): command,
        working directory, environment, log file, and the script the command runs."""
        out = []
        for replicas in dryrun_info.request.role_params.values():
            for params in replicas:
                script, text = Path(params.args[-1]) if params.args else Path(), ""
                with contextlib.suppress(OSError):  # a task's last argument is its payload
                    text = script.read_text() if script.is_file() else ""
                out.append(
                    {
                        "kind": "LocalProcess",
                        "command": list(params.args),
                        "cwd": params.cwd,
                        "env": dict(params.env),
                        "log": params.combined,
                        "script": text,
                    }
                )
        return out

    def make_task(self, spec: JobSpec, job_id: str) -> Any:
        """The entrypoint as an inline script in working_dir (staged), secrets in its env only;
        a JobSpec.task as it is (its env, `task_env`, on the executor).

        The local scheduler hands the env to the process (Popen) and keeps none of it on disk.
        """
        if spec.task is not None:
            return super().make_task(spec, job_id)
        run = nemo_run()
        command = spec.entrypoint
        if spec.working_dir is not None:
            command = f"cd {_quote(self._staged(spec))} && {command}"
        return run.Script(inline=command, env=spec.plain_env())

    def task_env(self, spec: JobSpec) -> dict[str, str]:
        """The whole env, secrets included (Popen keeps them off disk), and the staged
        working_dir first on PYTHONPATH, where NeMo-Run's runner imports the task's code."""
        env = spec.plain_env()
        if spec.working_dir is not None:
            path = [str(self._staged(spec)), env.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        return env

    def _staged(self, spec: JobSpec) -> Path:
        assert spec.working_dir is not None
        return stage_source(collect_source(spec.working_dir, exclude=spec.exclude))


def _quote(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))
