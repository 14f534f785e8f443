"""The job model every backend shares: what to run (JobSpec), where it runs (JobHandle), how it is
doing (JobStatus / JobState) and how it ended (JobResult), plus the Backend protocol."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from contextvars import ContextVar
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from prefect_nemo import nemo_task
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.nemo_task import NemoTask
from prefect_nemo.placement.spec import PlacementSpec  # plain pydantic: no Ray, no Prefect
from prefect_nemo.usage import JobShape, JobUsage

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Metadata keys we write on every job; users may not set them.
RESERVED_PREFIX = "prefect_nemo."
#: Metadata key naming the experiment a job was submitted in (set only inside experiments).
META_EXPERIMENT = RESERVED_PREFIX + "experiment"
#: Metadata keys written on every job (string values: Ray requires them): its (scope, key), the
#: spec's fingerprint, and the flow run that submitted it (the sweeper's owner).
META_KEY = RESERVED_PREFIX + "key"
META_SPEC = RESERVED_PREFIX + "spec"
META_FLOW_RUN = RESERVED_PREFIX + "flow_run_id"
# A Linux argv string is capped at 128 KiB (MAX_ARG_STRLEN); stay well under it.
MAX_ENTRYPOINT_CHARS = 100_000


class JobState(StrEnum):
    """Where a job is in its life; the last three are terminal (as Ray's JobStatus).

    QUEUED is a job that waits in a scheduler's queue for quota or resources (Kueue, Slurm,
    run:ai, Lepton, a Ray cluster without the resources): it has not run yet, or it was
    preempted and waits to run again. PENDING is any other wait before running (being
    created, pulling images, starting).
    """

    PENDING = "PENDING"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    def is_terminal(self) -> bool:
        """True once the job can no longer change state."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)

    def is_waiting(self) -> bool:
        """True before the job runs (or between runs, once preempted): PENDING or QUEUED."""
        return self in (JobState.PENDING, JobState.QUEUED)


class FailureClass(StrEnum):
    """Why an attempt failed, which decides whether it is tried again (JobSpec.recovery)."""

    PREEMPTED = "preempted"  # the scheduler took its resources back (Slurm PREEMPTED, a
    # reclaimed spot or cloud node); Kueue's eviction puts a job back in its queue instead
    INFRASTRUCTURE = "infrastructure"  # a node lost, a pod evicted, Slurm NODE_FAIL, NCCL or
    # GPU Xid errors: the cluster's fault, not the job's
    APPLICATION = "application"  # the job's own code: an exit code, a traceback, OOM
    SPEC = "spec"  # what was asked cannot run: a bad image, entrypoint or manifest


class Failure(BaseModel):
    """An ended attempt's failure, classified: from what its engine says, else its log."""

    model_config = ConfigDict(frozen=True)

    kind: FailureClass
    reason: str = Field(description="In the engine's words (a state, a condition, a log line).")
    node: str | None = Field(None, description="The node it names (a lost node), if any.")

    def describe(self) -> str:
        """One line for logs, events and errors: 'infrastructure: NodeLost (node-2)'."""
        node = f" (node {self.node})" if self.node else ""
        return f"{self.kind.value}: {self.reason}{node}"


_validating: ContextVar[bool] = ContextVar("prefect_nemo_validating", default=False)


class _Model(BaseModel):
    """Pydantic base that turns validation errors into `InvalidJobSpec` naming each field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        if _validating.get():  # nested model: let the outer model report the whole path
            super().__init__(**data)
            return
        token = _validating.set(True)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidJobSpec(explain(exc, type(self).__name__)) from None
        finally:
            _validating.reset(token)


def explain(exc: ValidationError, model: str) -> str:
    """A readable multi-line message: one line per bad field with pydantic's reason."""
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            reason = "unknown field: check the spelling (see the class docstring for the fields)"
        if where == "(root)":  # a check across fields names its fields itself
            lines.append(reason if reason.startswith(f"{model}.") else f"{model}: {reason}")
        else:
            lines.append(f"{model}.{where}: {reason}")
    return "invalid job configuration:\n  " + "\n  ".join(lines)


#: Log lines that say the cluster failed the job, not its code (RecoveryPolicy.infrastructure_logs)
INFRASTRUCTURE_LOGS: tuple[str, ...] = (
    r"NCCL (error|Error)|ncclSystemError|ncclRemoteError|ncclInternalError|ncclUnhandledCuda",
    r"NCCL watchdog|Watchdog caught collective operation timeout",
    r"\bXid\b.*\b(13|31|43|45|48|61|62|63|64|74|79|92|94|95|119|120)\b",
    r"CUDA error: (an illegal memory access|uncorrectable ECC|unspecified launch failure)",
    # Ray: a node died under the job's tasks or actors (ActorUnavailableError: the RPC to the
    # actor's node broke, before the node is declared dead)
    r"NodeDiedError|ActorUnavailableError|(its|the) node has died|node \S+ (has died|has been "
    r"marked dead)|The node with node id \S+ .*has died",
)


class RecoveryPolicy(_Model):
    """What to do when an attempt fails, by its class (FailureClass): the cluster's failures
    (preempted, infrastructure) are resubmitted without using up the error budget; the job's
    own (application) fail at once unless budgeted or their exit code is named; a spec error
    is never retried. Each new attempt gets the next id (`-r1`, `-r2`, ...) and, in its
    environment, PREFECT_NEMO_ATTEMPT and PREFECT_NEMO_PREVIOUS_JOB_ID, to resume from its
    checkpoint. Budgets count the attempts of the job's name (a re-attach counts the earlier
    ones), so a crash in the middle of a recovery resumes it, it does not restart it."""

    max_restarts_on_preemption: int = Field(
        10,
        ge=0,
        description="Resubmissions after the cluster's failures: preempted or infrastructure "
        "(a node lost, NODE_FAIL, NCCL / Xid errors). 0: none.",
    )
    max_restarts_on_errors: int = Field(
        0,
        ge=0,
        description="Resubmissions after the job's own failures (an application error: a "
        "non-zero exit code). 0: fail at once, with the log tail.",
    )
    recover_on_exit_codes: tuple[int, ...] = Field(
        (),
        description="Exit codes that always resubmit (e.g. a known flaky collective's), "
        "without counting against max_restarts_on_errors; still bounded by 100 attempts.",
    )
    backoff_s: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds before the first resubmission; doubled each time after.",
    )
    max_backoff_s: float = Field(
        60.0, ge=0, allow_inf_nan=False, description="The longest wait between attempts."
    )
    infrastructure_logs: tuple[str, ...] = Field(
        INFRASTRUCTURE_LOGS,
        description="Regular expressions: a failed attempt whose log tail matches one failed "
        "for the cluster (infrastructure), whatever its exit code (NCCL errors, GPU Xid "
        "errors, a Ray node's death by default).",
    )

    @field_validator("infrastructure_logs")
    @classmethod
    def _patterns_compile(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    @field_validator("recover_on_exit_codes")
    @classmethod
    def _exit_codes_ok(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for code in value:
            if not 1 <= code <= 255:
                raise ValueError(
                    f"{code} is no failing exit code: name codes from 1 to 255 (0 is success)"
                )
        return value


class Resources(_Model):
    """Resources the job's entrypoint reserves on the cluster (its driver, not its workers)."""

    cpus: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="CPU cores for the entrypoint."
    )
    gpus: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="GPUs for the entrypoint."
    )
    memory_bytes: int | None = Field(None, ge=0, description="Memory for the entrypoint, bytes.")
    custom: dict[StrictStr, float] = Field(
        default_factory=dict, description="Custom resources by name, e.g. {'TPU': 1}."
    )

    @field_validator("custom")
    @classmethod
    def _custom_non_negative(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if not key.strip():
                raise ValueError("custom resource names must be non-empty")
            if not math.isfinite(amount) or amount < 0:
                raise ValueError(f"custom resource '{key}' is {amount}: use a finite number >= 0")
        return value


class JobSpec(_Model):
    """What to run: a shell entrypoint (or a NeMo-Run task) with its environment, code,
    resources and limits.

    Fields: entrypoint, task, name, env, working_dir, exclude, resources, label_selector,
    placement, runtime_env, labels, metadata, timeout_s, queue, priority, queue_timeout_s,
    stall_after_s, stop_on_stall, launcher.
    """

    entrypoint: StrictStr | None = Field(
        None,
        description="Shell command the job runs, e.g. 'python train.py'; set from `task` when "
        "a NeMo-Run task is given instead (NeMo-Run's runner command).",
    )
    name: StrictStr | None = Field(
        None,
        description="Stable name of this job within its experiment; part of the job id, so a "
        "re-run with the same name attaches instead of submitting again.",
    )
    env: dict[StrictStr, StrictStr | SecretStr] = Field(
        default_factory=dict,
        description="Environment variables; SecretStr values are redacted from everything we "
        "log or report.",
    )
    working_dir: Path | None = Field(
        None,
        description="Local directory whose code is shipped to the job and is its working "
        "directory there. Ray Jobs ships the whole .gitignore-aware tree; Kubernetes and the "
        "env-var transports, whose payloads are small, ship the project's packages and "
        "top-level modules (packaging.build_archive).",
    )
    exclude: tuple[StrictStr, ...] = Field(
        (), description="Extra gitignore-style patterns left out of working_dir."
    )
    task: NemoTask | None = Field(
        None,
        description="A NeMo-Run task (run.Partial, run.Script or run.Config; needs "
        f"{nemo_task.EXTRA}) instead of an entrypoint: serialized by NeMo-Run, its functions "
        "imported in the job (installed there, or shipped in working_dir), its SecretStr "
        "values delivered as secret env vars. Without a name, its configuration is its "
        "identity: a re-run of the same task attaches.",
    )
    resources: Resources = Field(default_factory=Resources, description="Entrypoint resources.")
    label_selector: dict[StrictStr, StrictStr] = Field(
        default_factory=dict,
        description="Node labels the entrypoint must land on (Ray >= 2.54 label selectors).",
    )
    placement: PlacementSpec | None = Field(
        None,
        description="Where the job runs, backend-neutral (nodes, GPUs/CPUs per node, node "
        "labels, head exclusion); each backend translates it. Use it instead of "
        "resources.cpus/gpus and label_selector, not with them.",
    )
    runtime_env: dict[StrictStr, Any] = Field(
        default_factory=dict,
        description="Extra backend runtime environment (Ray runtime_env keys except "
        "working_dir and env_vars, which come from the fields above).",
    )
    labels: dict[StrictStr, StrictStr] = Field(
        default_factory=dict, description="Labels for the job (Kubernetes-style key/value)."
    )
    metadata: dict[StrictStr, StrictStr] = Field(
        default_factory=dict, description="Free-form string metadata stored with the job."
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds the job may run before it is stopped, counted from when it runs: "
        "time queued for quota or resources does not count; None = no limit.",
    )
    queue: StrictStr | None = Field(
        None,
        description="Where the job queues on a shared cluster, overriding the block's: the "
        "Kueue LocalQueue (KubeRay, Kubeflow Trainer), the Slurm partition, the run:ai project, "
        "the Lepton node group.",
    )
    priority: StrictStr | None = Field(
        None,
        description="Its priority in that queue, overriding the block's: the Kueue "
        "WorkloadPriorityClass, the Slurm QOS, the Lepton priority class.",
    )
    queue_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds the job may wait in its scheduler's queue before it is removed "
        "from it (and the task fails naming the queue and the scheduler's reason); each wait "
        "counts anew after a preemption. None = wait as long as it takes.",
    )
    stall_after_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a RUNNING job may go without a log line or a report before it "
        "counts as stalled (a hung collective prints nothing): a `prefect-nemo.job.stalled` "
        "event, once per stall; None = never.",
    )
    stop_on_stall: bool = Field(
        False,
        description="Stop a stalled job (see stall_after_s) and fail the task with JobStalled.",
    )
    recovery: RecoveryPolicy | None = Field(
        None,
        description="How a failed attempt is tried again, by its cause (RecoveryPolicy); None: "
        "the cluster block's `recovery`.",
    )
    launcher: Literal["torchrun"] | None = Field(
        None,
        description="How each node starts the job's processes: 'torchrun' runs placement.nodes "
        "x placement.gpus_per_node processes (NeMo-Run's Torchrun launcher on Slurm, Lepton, DGX "
        "Cloud and local; the Torch plugin's rendezvous on Kubeflow Trainer); None runs the "
        "command once per node (Ray flows: Ray starts its own workers).",
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_ok(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("must be a non-empty shell command, e.g. 'python train.py'")
        if "\x00" in value:
            raise ValueError("contains a NUL byte, which no shell accepts: remove it")
        if len(value) > MAX_ENTRYPOINT_CHARS:
            raise ValueError(
                f"is {len(value)} characters; the limit is {MAX_ENTRYPOINT_CHARS} (Linux caps one "
                "argument at 128 KiB): ship large inputs through working_dir instead"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _task_is_the_entrypoint(cls, data: Any) -> Any:
        """A NeMo-Run task becomes a NemoTask, its runner command the entrypoint and its
        secret values secret env vars; a spec needs one of entrypoint and task."""
        if not isinstance(data, dict) or data.get("task") is None:
            return data
        return nemo_task.spec_fields(data, MAX_ENTRYPOINT_CHARS)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", value):
            raise ValueError(
                f"'{value}' is not a valid job name: use 1-63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_are_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(item, str | SecretStr):
                    raise ValueError(
                        f"value of '{key}' is a {type(item).__name__}: use a string "
                        "(or SecretStr for secrets)"
                    )
        return value

    @field_validator("env")
    @classmethod
    def _env_names_ok(cls, value: dict[str, str | SecretStr]) -> dict[str, str | SecretStr]:
        for key in value:
            if not ENV_NAME.match(key):
                raise ValueError(
                    f"'{key}' is not a valid environment variable name: use letters, digits and "
                    "'_', not starting with a digit"
                )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_not_reserved(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if key.startswith(RESERVED_PREFIX):
                raise ValueError(f"key '{key}' is reserved for prefect-nemo: pick another key")
        return value

    @field_validator("runtime_env")
    @classmethod
    def _runtime_env_no_overlap(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "working_dir" in value:
            raise ValueError("set JobSpec.working_dir instead of runtime_env['working_dir']")
        if "env_vars" in value:
            raise ValueError("set JobSpec.env instead of runtime_env['env_vars']")
        return value

    @model_validator(mode="after")
    def _something_to_run(self) -> JobSpec:
        if self.entrypoint is None:
            raise ValueError(
                "JobSpec.entrypoint is required (a shell command, e.g. 'python train.py'), or "
                "give JobSpec.task (a NeMo-Run run.Partial / run.Script)"
            )
        return self

    @model_validator(mode="after")
    def _one_way_to_place(self) -> JobSpec:
        if self.placement is None:
            return self
        clashes = [
            name
            for name, value in (
                ("resources.cpus", self.resources.cpus),
                ("resources.gpus", self.resources.gpus),
                ("label_selector", self.label_selector or None),
            )
            if value is not None
        ]
        if clashes:
            both = " and ".join(f"JobSpec.{c}" for c in clashes)
            raise ValueError(
                f"JobSpec.placement and {both} each say where the job runs: keep one (put the "
                "CPUs, GPUs and node labels in placement, or drop placement)"
            )
        return self

    def plain_env(self) -> dict[str, str]:
        """The environment with secret values revealed, for handing to the backend only."""
        return {
            k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in self.env.items()
        }

    def secret_values(self) -> list[str]:
        """Every secret value in this spec, so reporters can redact them."""
        return [v.get_secret_value() for v in self.env.values() if isinstance(v, SecretStr)]

    def shape(self, default: JobShape | None = None) -> JobShape:
        """The GPUs it asks for: its placement's nodes x GPUs per node, else `resources.gpus`
        on each of the cluster's `default` nodes (one node without a default), else the
        cluster's `default` (a Slurm, Lepton, DGX Cloud or Kubeflow Trainer block's nodes and
        GPUs per node), else none. Slurm, Lepton and DGX Cloud run `resources.gpus` on the
        block's nodes."""
        if self.placement is not None:
            return JobShape(nodes=self.placement.nodes, gpus_per_node=self.placement.gpus_per_node)
        if self.resources.gpus is not None:
            nodes = default.nodes if default is not None else 1
            return JobShape(nodes=nodes, gpus_per_node=self.resources.gpus)
        return default or JobShape()

    def fingerprint(self) -> str:
        """A short hash of what the job does, to spot drift when attaching to an existing job.

        Secret values are left out (a hash of a short secret could be brute-forced).
        """
        # how the job is watched is not what it does: a changed limit attaches to the same job
        watching = {"timeout_s", "queue_timeout_s", "stall_after_s", "stop_on_stall", "recovery"}
        data = self.model_dump(mode="json", exclude=watching)
        for absent in ("placement", "task", "launcher", "queue", "priority"):  # absent, not
            # null: older specs keep their fingerprints
            if data[absent] is None:
                del data[absent]
        data["env"] = {
            k: "<secret>" if isinstance(v, SecretStr) else v for k, v in self.env.items()
        }
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def refuse_launcher(spec: JobSpec, kind: str) -> None:
    """A Ray job (Ray Jobs, KubeRay, Ray on Lepton / DGX Cloud) takes no launcher: its
    entrypoint is the driver, run once, and Ray starts the workers."""
    if spec.launcher is not None:
        raise InvalidJobSpec(
            f"JobSpec.launcher={spec.launcher!r}: a {kind} job's entrypoint is a Ray driver, run "
            "once; Ray starts its workers (a Ray flow takes launcher=None). Use launcher=None, or "
            "run the torchrun job on a Slurm, Kubeflow Trainer, Lepton, DGX Cloud or local cluster"
        )


class JobHandle(BaseModel):
    """Where a submitted job lives: enough to find, watch and stop it again."""

    model_config = ConfigDict(frozen=True)

    backend: str = Field(description="Backend kind, e.g. 'ray-jobs'.")
    cluster: str = Field(description="Which cluster (its address), for humans and resource ids.")
    job_id: str = Field(description="The job's id on the cluster (deterministic).")
    links: dict[str, str] = Field(default_factory=dict, description="URLs to look at the job.")

    @property
    def resource_id(self) -> str:
        """The Prefect event resource id of this job."""
        return f"prefect-nemo.job.{self.backend}.{self.job_id}"


class QueueInfo(BaseModel):
    """Why a QUEUED job waits, as its scheduler tells it."""

    model_config = ConfigDict(frozen=True)

    queue: str | None = Field(None, description="The queue it waits in (LocalQueue, partition).")
    reason: str = Field("", description="The scheduler's reason, in its own words.")
    position: int | None = Field(None, description="Its place in that queue (1 = next).")
    estimated_start: datetime | None = Field(None, description="When the scheduler expects to "
                                             "start it, where it says.")  # fmt: skip
    preempted: bool = Field(False, description="It ran and was preempted (evicted) back into "
                            "the queue.")  # fmt: skip

    def describe(self) -> str:
        """One line for logs and messages: "in batch (Resources), position 2, starts ~12:30"."""
        text = f"in {self.queue}" if self.queue else "in its queue"
        if self.reason:
            text += f" ({self.reason})"
        if self.position is not None:
            text += f", position {self.position}"
        if self.estimated_start is not None:
            text += f", expected to start at {self.estimated_start:%Y-%m-%d %H:%M:%S %Z}".rstrip()
        return text


class EngineProgress(BaseModel):
    """A job's progress as its engine stores it, where it does (Kubeflow Trainer: the TrainJob's
    `status.trainerStatus`, which the job posts to the Trainer's status server)."""

    model_config = ConfigDict(frozen=True)

    percent: int | None = None
    eta_s: int | None = None
    metrics: dict[str, str] = Field(default_factory=dict)  # the engine stores values as text
    updated: datetime | None = None


class JobStatus(BaseModel):
    """One observation of a job as the cluster reports it."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    state: JobState
    message: str = ""
    queue: QueueInfo | None = Field(None, description="Why it waits, while QUEUED.")
    start_time: datetime | None = None
    end_time: datetime | None = None
    exit_code: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    requeues: int | None = Field(
        None,
        description="Times the engine says it put the job back in its queue after it ran, "
        "where it says (Slurm: squeue's RestartCnt, which a PreemptMode=REQUEUE preemption "
        "raises): a preemption between two polls is counted all the same.",
    )
    shape: JobShape | None = Field(
        None,
        description="Nodes x GPUs the engine says the job holds, where it says (Kubeflow "
        "Trainer: the TrainJob's numNodes and nvidia.com/gpu per node); elsewhere the spec's "
        "count is used.",
    )
    failure: Failure | None = Field(
        None,
        description="Why it FAILED, where its engine says (a node lost, preempted, a bad "
        "image); None: the lifecycle classifies it by its log tail and exit code.",
    )
    progress: EngineProgress | None = Field(
        None,
        description="Progress as the engine stores it, where it does (Kubeflow Trainer's "
        "trainerStatus); the job's report lines come first (lifecycle).",
    )

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to end as the cluster recorded them (None until it says both)."""
        if self.start_time and self.end_time:
            return (self.end_time - self.start_time).total_seconds()
        return None


class Attempt(BaseModel):
    """One earlier attempt of a job: its id, how it ended and why."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    state: JobState
    failure: Failure | None = None
    exit_code: int | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None


class JobResult(BaseModel):
    """How a job ended: returned by run_job / wait_for_job, attached to JobFailed errors."""

    model_config = ConfigDict(frozen=True)

    handle: JobHandle
    state: JobState
    message: str = ""
    start_time: datetime | None = None
    end_time: datetime | None = None
    exit_code: int | None = None
    log_tail: str = ""
    attached: bool = Field(False, description="True when this run re-attached to an existing job.")
    queue_wait_s: float | None = Field(
        None, description="Seconds it waited in its scheduler's queue while we watched it."
    )
    preemptions: int = Field(0, description="Times it was preempted back into the queue.")
    usage: JobUsage | None = Field(
        None,
        description="Its queue wait, run time, nodes x GPUs, GPU-hours and cost (None when the "
        "GPUs it held are unknown: waited for without its spec, or stopped by stop_job).",
    )
    failure: Failure | None = Field(None, description="Why it failed (FAILED only).")
    attempts: tuple[Attempt, ...] = Field(
        (),
        description="The earlier attempts of this job that failed and were resubmitted "
        "(JobSpec.recovery), oldest first; this result is the last attempt's.",
    )

    @property
    def gpu_hours(self) -> float | None:
        """GPU-hours it used (usage.gpu_hours), None when unknown."""
        return self.usage.gpu_hours if self.usage is not None else None

    @property
    def cost(self) -> float | None:
        """What it cost at the block's gpu_hour_price (usage.cost), None without one."""
        return self.usage.cost if self.usage is not None else None

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to end as the cluster recorded them."""
        if self.start_time and self.end_time:
            return (self.end_time - self.start_time).total_seconds()
        return None

    @property
    def succeeded(self) -> bool:
        """True when the job ended in SUCCEEDED."""
        return self.state is JobState.SUCCEEDED


class OwnedJob(BaseModel):
    """A job prefect-nemo submitted, as its cluster lists it: the flow run that submitted it
    (from the job's own metadata or labels) and how it is doing."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    state: JobState
    flow_run_id: str | None = Field(None, description="The flow run that submitted it.")
    submitted_at: datetime | None = None


class DryRun(BaseModel):
    """What a job would send to its cluster, rendered without submitting anything (secret
    values masked): returned by `run_job(..., dry_run=True)` and `prefect-nemo render`."""

    model_config = ConfigDict(frozen=True)

    job_id: str = Field(description="The id the job would get (its first attempt).")
    backend: str = Field(description="Backend kind, e.g. 'kuberay'.")
    cluster: str = Field(description="Which cluster it would go to.")
    documents: list[dict[str, Any]] = Field(
        description="Manifests, request bodies or scripts, in the order they would be sent."
    )

    @property
    def yaml(self) -> str:
        """The documents as one multi-document YAML text."""
        import yaml

        return yaml.safe_dump_all(self.documents, sort_keys=False)


@runtime_checkable
class Backend(Protocol):
    """What every engine implements; written on the engine's own client, with no Prefect import.

    Every call carries a request timeout and raises BackendUnavailable when the cluster cannot
    be reached and AuthenticationFailed when it rejects our credentials.
    """

    kind: ClassVar[str]
    max_job_id_len: ClassVar[int]  # the longest job id (object name) the engine accepts

    @property
    def cluster(self) -> str:
        """A stable identity of the cluster (e.g. its address); one watcher serves each."""
        ...

    @property
    def credentials_key(self) -> str:
        """A hash of the credentials this backend's calls carry (never the values themselves),
        stable while the backend lives: one watcher serves each cluster and credentials."""
        ...

    @property
    def secrets(self) -> list[str]:
        """Secret values of this backend's credentials, for redaction."""
        ...

    def validate(self, spec: JobSpec) -> None:
        """Raise InvalidJobSpec if the spec breaks this backend's limits; submits nothing."""

    def check_access(self) -> None:
        """Raise AuthenticationFailed / BackendUnavailable unless we may submit jobs."""

    def handle(self, job_id: str) -> JobHandle:
        """The handle (with links) of a job id on this cluster."""
        ...

    def find(self, job_id: str) -> JobStatus | None:
        """The job's status, or None if no job has that id."""

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Submit a new job under job_id; raise JobAlreadyExists if the id is taken."""
        ...

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """Statuses of many jobs in one poll of the cluster (one round trip, or one per job
        where the cluster makes that cheaper); ids the cluster does not know are absent."""
        ...

    def request_stop(self, job_id: str) -> None:
        """Ask the cluster to stop the job (no waiting; see lifecycle.stop_and_confirm)."""

    def logs(self, job_id: str) -> str:
        """The job's whole log so far."""
        ...

    def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """Stream the job's log as it is written, until the job ends."""
        ...

    def owned_jobs(self) -> list[OwnedJob]:
        """Every job on this cluster that prefect-nemo submitted and that has not ended, read
        from the jobs themselves (metadata, labels, comments: one listing, no request per job),
        so a sweeper on any machine finds them; a job we did not submit is never listed."""
        ...

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """What `submit` would send for this job, as documents (Kubernetes manifests, request
        bodies, batch scripts), built without a request and without creating anything; secret
        values may appear in them (the caller redacts what it shows)."""
        ...

    def close(self) -> None:
        """Stop every background thread this backend started (watches); idempotent. Calls
        made after it that need those threads raise BackendClosed."""


@runtime_checkable
class PushesChanges(Protocol):
    """A backend that learns of status changes as they happen (a Kubernetes watch) rather than
    by polling: the watcher then wakes on each change instead of at its next tick, asks only
    for the jobs that changed, and `statuses()` is served from the backend's cache."""

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` on every change of any job on the cluster; returns the unsubscribe."""
        ...

    def changed_since(self, version: int) -> tuple[int, set[str] | None]:
        """(the current version, the ids of the jobs that changed after `version`); None for
        the ids when any job may have (an error, a restart, a forgotten change): ask all."""
        ...


@runtime_checkable
class RunScopedCluster(Protocol):
    """A backend that creates its cluster for the run that first uses it (Ray on Lepton): the
    run deletes that cluster when it ends, however it ends (success included)."""

    def teardown_for(self, flow_run_id: str) -> Callable[[], str] | None:
        """What to call when the run ends (it never raises and says what it did), or None when
        the cluster is kept."""
        ...


@runtime_checkable
class NativeDependencies(Protocol):
    """A backend whose scheduler itself holds a job until upstream jobs succeed (Slurm's
    `sbatch --dependency=afterok:`), so the downstream job is queued at once instead of
    waiting in Prefect. Upstream jobs it cannot name are waited for in Prefect instead."""

    def depends_natively_on(self, handle: JobHandle) -> bool:
        """True when the scheduler can wait for this upstream job (same cluster)."""
        ...

    def after(self, upstream: Sequence[JobHandle]) -> Backend:
        """This backend, whose next submissions wait natively for `upstream` (raises
        DependencyFailed if one already failed; one that already succeeded is no constraint)."""
        ...

    def experiment_jobs(self, experiment: str) -> list[JobHandle]:
        """The jobs experiment `experiment` submitted to this cluster."""
        ...
