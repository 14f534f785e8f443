"""The Slurm backend's job registry on the cluster: each job id claimed as a directory under
the block's job dir (an atomic mkdir, so two submitters of one id cannot both submit), its
metadata and Slurm job id written beside it, the experiment index that cross-experiment afterok
reads, and this process's cache of job id -> Slurm id. Everything here runs over the backend's
SSH connection (`run`); `SlurmBackend` mixes it in.

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

import json
import re
import shlex
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.base import STALE_CLAIM_S
from prefect_nemo.backends.nemo_run.slurm.accounting import id_lookup_command, sacct_id_command
from prefect_nemo.errors import BackendUnavailable, JobAlreadyExists
from prefect_nemo.jobs import META_EXPERIMENT, JobHandle

#: NeMo-Run's torchx scheduler name for Slurm over SSH (the app handles' scheme).
SCHEDULER = "slurm_tunnel"
_ATTEMPT = re.compile(r"(.+)-r(\d+)")

# job id -> Slurm job id, per cluster, for every backend object in this process
_slurm_ids: dict[str, dict[str, str]] = {}
# (cluster, job id) whose secret file we removed, or that was submitted without one
_cleaned: set[tuple[str, str]] = set()
_ids_lock = threading.Lock()


class SlurmJobRegistry:
    """Claim, record and find jobs in the remote job dir (mixed into `SlurmBackend`)."""

    if TYPE_CHECKING:  # what the backend provides

        @property
        def cluster(self) -> str: ...
        @property
        def address(self) -> str: ...

        def run(self, command: str, *, warn: bool = False) -> Any: ...
        def remote_root(self) -> str: ...
        def remote_dir(self, job_id: str) -> str: ...
        def handle(self, job_id: str) -> JobHandle: ...

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

    def claim(self, job_id: str, metadata: dict[str, str]) -> None:
        """mkdir the job's remote dir (atomic) or raise JobAlreadyExists; a claim left by a
        submitter that died before sbatch is taken over after STALE_CLAIM_S. (`submit` claims
        in the command that submits: `claim_command`.)"""
        out = self.run(self.claim_command(job_id, metadata)).stdout.strip()
        if out.endswith("EXISTS"):
            raise JobAlreadyExists(f"Slurm job '{job_id}' already exists on {self.address}")
        if not out.endswith("CLAIMED"):
            raise BackendUnavailable(f"could not claim {self.remote_dir(job_id)}: {out[-200:]}")

    def claim_command(
        self, job_id: str, metadata: dict[str, str], then: str = "true", exists: str = "true"
    ) -> str:
        """The shell script that claims job_id: prints CLAIMED and runs `then` (its status is
        the script's), or runs `exists` and prints EXISTS."""
        d = shlex.quote(self.remote_dir(job_id))
        meta = shlex.quote(json.dumps(metadata, sort_keys=True))
        # no id file, old, not queued: stale unless sacct knows a job submitted under this
        # claim (the submitter died before writing its id): then the job exists; keep its id
        return (
            f"claimed() {{ printf %s {meta} > {d}/meta.json && echo CLAIMED && {{ {then}; }}; }}; "
            f"mkdir -p {shlex.quote(self.remote_root())} || exit 3; "
            f"if mkdir -m 700 {d} 2>/dev/null; then claimed; exit $?; fi; "
            f"if [ ! -s {d}/slurm_job_id ] "
            f"&& [ $(( $(date +%s) - $(stat -c %Y {d}) )) -gt {int(STALE_CLAIM_S)} ] "
            f'&& [ -z "$(squeue -h --name={shlex.quote(job_id)} -o %i)" ]; then '
            f"s=$({sacct_id_command(job_id, self.remote_dir(job_id))}); "
            f'if [ -z "$s" ]; then rm -rf {d} && mkdir -m 700 {d} && claimed; exit $?; fi; '
            f'printf %s "$s" > {d}/slurm_job_id; fi; {exists}; echo EXISTS'
        )

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

    def record(self, job_id: str, app_handle: str, metadata: dict[str, str]) -> None:
        """Write Slurm's id beside the claim, and index the job under its experiment."""
        sid = app_handle.rsplit("/", 1)[-1]
        self.remember(job_id, sid)
        self.run(self.record_command(job_id, shlex.quote(sid), metadata))

    def record_command(self, job_id: str, sid: str, metadata: dict[str, str]) -> str:
        """The shell command that writes Slurm's id `sid` (a quoted word or "$var") beside the
        claim and into the experiment index."""
        q = shlex.quote
        commands = [f"printf %s {sid} > {q(self.remote_dir(job_id))}/slurm_job_id"]
        experiment = metadata.get(META_EXPERIMENT)
        if experiment:
            index = self._experiment_index(experiment)
            commands.append(f"mkdir -p {q(index)} && printf %s {sid} > {q(index)}/{q(job_id)}")
        return " && ".join(commands)

    def remember(self, job_id: str, sid: str) -> None:
        """Cache Slurm's id of a job this process submitted."""
        with _ids_lock:
            _slurm_ids.setdefault(self.cluster, {})[job_id] = sid

    def _slurm_id(self, job_id: str) -> str | None:
        with _ids_lock:
            return _slurm_ids.get(self.cluster, {}).get(job_id)

    def _lookup(self, job_ids: Collection[str]) -> None:
        """Fill the id cache for jobs submitted elsewhere (another process or a crashed run)."""
        unknown = [j for j in job_ids if self._slurm_id(j) is None]
        if not unknown:
            return
        reads = "; ".join(id_lookup_command(j, self.remote_dir(j)) for j in unknown)
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
