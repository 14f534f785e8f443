"""`ServiceBackend`: the NeMo-Run backends on a service that names each job by our job id
(Lepton, DGX Cloud): submit-or-attach across machines, the checks both make before anything is
sent (secret env values, env sizes, the code's transport), and the code's env-var chunks.

Nothing here imports Prefect.
"""

from __future__ import annotations

import re
import tempfile
from abc import abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from prefect_nemo.backends.nemo_run.base import NemoRunBackend, relocated
from prefect_nemo.backends.nemo_run.dry_run import Answer, Sent, recording
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.errors import InvalidJobSpec, JobAlreadyExists
from prefect_nemo.jobs import META_FLOW_RUN, Failure, FailureClass, JobHandle, JobSpec
from prefect_nemo.kube import managed_labels
from prefect_nemo.packaging import TransportPlan, build_archive, plan_for
from prefect_nemo.packaging.transport import Backend as Transport

#: Kubernetes' words for why a pod ended, which run:ai and Lepton pass on for their jobs' pods,
#: by the class they mean (the first class found wins, in this order): DisruptionTarget
#: condition reasons (PreemptionByScheduler, TerminationByKubelet: node pressure or shutdown,
#: DeletionByTaintManager: a NoExecute taint such as an unreachable node, DeletionByPodGC: its
#: node is gone, EvictionByEvictionAPI: a drain), a pod's status reason (Evicted: node-pressure
#: eviction), node and scheduler event reasons, container waiting reasons (an image or a
#: container config that cannot be used) and the OOMKilled terminated reason.
KUBE_REASONS: dict[FailureClass, tuple[str, ...]] = {
    FailureClass.PREEMPTED: ("PreemptionByScheduler", "Preempted"),
    FailureClass.INFRASTRUCTURE: (
        "TerminationByKubelet", "DeletionByTaintManager", "DeletionByPodGC",
        "EvictionByEvictionAPI", "TaintManagerEviction", "Evicted", "NodeLost", "NodeNotReady",
        "NodeShutdown",
    ),
    FailureClass.SPEC: (
        "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
        "CreateContainerConfigError", "CreateContainerError",
    ),
    FailureClass.APPLICATION: ("OOMKilled",),
}  # fmt: skip
_KUBE_REASON = {
    kind: re.compile(r"\b(?:" + "|".join(words) + r")\b") for kind, words in KUBE_REASONS.items()
}


def kube_failure(texts: Iterable[str], node: str | None = None) -> Failure | None:
    """The failure a service's words say (`KUBE_REASONS`, whole words), the text that says it
    as the reason; None when they name none (the lifecycle then reads the job's log tail)."""
    said = [text.strip() for text in texts if text and text.strip()]
    for kind, pattern in _KUBE_REASON.items():
        for text in said:
            if pattern.search(text):
                return Failure(kind=kind, reason=text[:500], node=node)
    return None


class ServiceBackend(NemoRunBackend):
    """A NeMo-Run backend on a service that names each job by our job id (Lepton, DGX Cloud):
    the executor's own ``launch()`` submits (not torchx), and a job is found again by its
    name from any machine, so submit-or-attach holds across machines.

    A subclass implements ``find_app`` (the service's job of that name), ``launch_app`` (create
    it, labelled with its owner (`owner_labels`): `assigned_executor` and `add_code_env` prepare
    the executor), ``owned_jobs`` (one listing of the service's jobs with our labels),
    ``env_refusal`` and, for dry runs, ``dry_run_answer`` and ``sent_documents``; it may extend
    ``check_code``, and sets ``transport`` (`packaging.plan_for`), ``noun`` and
    ``secret_env_fix``.
    """

    #: How the job's code travels to this service (env-var chunks within its limits).
    transport: ClassVar[Transport]
    #: What the service calls a job, in messages ("Lepton job").
    noun: ClassVar[str]
    #: How the block passes secret env values instead (the job would keep them in plain text).
    secret_env_fix: ClassVar[str]

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config  # the block's settings (a frozen dataclass; see `config_from`)

    def validate(self, spec: JobSpec) -> None:
        """What the service or its pods would refuse, found before anything is sent."""
        super().validate(spec)  # Ray-only fields; builds the executor
        refuse_secret_env(spec, stored_in=f"the {self.noun}", fix=self.secret_env_fix)
        for key, value in spec.plain_env().items():
            why = self.env_refusal(key, value)
            if why:
                raise InvalidJobSpec(
                    f"JobSpec.env['{key}'] is {len(value)} characters; {why}: ship large "
                    "inputs through working_dir"
                )
        if spec.launcher is not None and (spec.task is None or spec.task.kind != "partial"):
            raise InvalidJobSpec(
                f"JobSpec.launcher={spec.launcher!r}: on {self.kind} a launcher wraps a "
                "run.Partial task (JobSpec.task); run a command under torchrun by writing it in "
                "the entrypoint ('torchrun --nnodes ... train.py')"
            )
        self.check_code(spec, code_plan(spec, self.transport))  # TransportTooLarge first

    def pod_command(self, spec: JobSpec, executor: Any) -> str:
        """What the pods run: the entrypoint, or for a run.Partial task what NeMo-Run's own
        packaging makes of it for this executor (the command NeMo-Run's Lepton and DGX Cloud
        schedulers hand to ``executor.launch``), under NeMo-Run's Torchrun launcher (nodes x
        procs per node from the executor) when JobSpec.launcher says so."""
        if spec.task is None or spec.task.kind != "partial":
            return spec.entrypoint or ""
        nemo_run()
        from nemo_run.run.torchx_backend.packaging import package

        if spec.launcher is not None:
            executor.launcher = spec.launcher
        with root_logger_kept():
            app = package(spec.task.run_name, spec.task.build(), executor=executor)
        role = app.roles[0]
        return " ".join([role.entrypoint, *role.args])  # as NeMo-Run's schedulers join it

    @abstractmethod
    def env_refusal(self, key: str, value: str) -> str | None:
        """Why the service would refuse this plain env value (None: it takes it)."""

    def check_code(self, spec: JobSpec, plan: TransportPlan | None) -> None:
        """Refuse a spec whose pod command, with the code's plan, the service would refuse."""

    @abstractmethod
    def find_app(self, job_id: str) -> str | None:
        """The app handle of the service's job named job_id (any machine's), or None."""

    @abstractmethod
    def launch_app(
        self, spec: JobSpec, job_id: str, metadata: dict[str, str], local_dir: Path | None = None
    ) -> str | None:
        """Create the job on the service, labelled with its owner (`owner_labels(metadata)`):
        its app handle, or None when the service answers that the name is taken (another
        machine won the race). `local_dir`: where the job's local files go (a dry run's
        scratch dir; default: its own dir)."""

    @abstractmethod
    def dry_run_answer(self) -> Answer:
        """How a dry run answers the requests of `launch_app` (placeholders for ids)."""

    @abstractmethod
    def sent_documents(
        self, job_id: str, local_dir: Path, sent: list[Sent]
    ) -> list[dict[str, Any]]:
        """The dry run's documents from what `launch_app` sent (`sent`, in order) and wrote
        (`local_dir`)."""

    def dry_run_client_args(self) -> dict[str, Any]:
        """leptonai APIClient arguments for a dry run (none: not a Lepton backend)."""
        return {}

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """What `submit` would send: `launch_app` itself, NeMo-Run's submission code included,
        with every request answered locally (`dry_run.recording`) and nothing sent; files
        written to a scratch dir and shown at their real paths."""
        with (
            tempfile.TemporaryDirectory(prefix="prefect-nemo-render-") as scratch,
            recording(self.dry_run_answer(), _creates, self.dry_run_client_args()) as recorder,
        ):
            self.launch_app(spec, job_id, {**spec.metadata, **metadata}, Path(scratch))
            documents = self.sent_documents(job_id, Path(scratch), recorder.sent)
        moved: list[dict[str, Any]] = relocated(
            documents, scratch, str(self.local_experiment_dir(job_id))
        )
        return moved

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Launch job_id unless the service has it already: JobAlreadyExists then."""
        meta = {**spec.metadata, **metadata}
        self.claim(job_id, meta)  # this machine's submitters, one at a time
        try:
            found = self.find_app(job_id)  # any machine's
            launched = None if found else self.launch_app(spec, job_id, meta)
            if not found and not launched:
                found = self.find_app(job_id)
        except BaseException:
            self.release(job_id)
            raise
        app_handle = launched or found
        if app_handle:
            self.record(job_id, app_handle, meta)
        if not launched:
            raise JobAlreadyExists(f"{self.noun} '{job_id}' already exists")
        return self.handle(job_id)

    def add_code_env(self, spec: JobSpec, executor: Any) -> TransportPlan | None:
        """Add the spec's plain env and the code's env-var chunks to the executor's env; the
        code's plan (None: no working_dir), whose setup command unpacks it in the pod."""
        plan = code_plan(spec, self.transport)
        executor.env_vars = {**executor.env_vars, **spec.plain_env(), **(plan.env if plan else {})}
        return plan


def owner_labels(metadata: dict[str, str]) -> dict[str, str]:
    """The labels a job we submit carries on the service (those of our Kubernetes jobs): ours,
    and the flow run that submitted it when there is one (the sweeper's owner)."""
    return managed_labels(metadata.get(META_FLOW_RUN) or None)


def _creates(method: str, path: str) -> bool:
    """The requests a dry run keeps: those that create something (no token, no lookups)."""
    return method == "POST" and not path.endswith("/token")


def nodes_and_gpus(
    spec: JobSpec, nodes: int, gpus_per_node: int, *, service: str, pick_nodes: str
) -> tuple[int, int]:
    """(nodes, GPUs per node) for a spec: its placement, else resources.gpus on the block's
    nodes, else the block's own; node labels and fractions of a GPU are refused."""
    if spec.placement is not None:
        p = spec.placement
        if p.node_labels or p.exclude_head:
            raise InvalidJobSpec(
                f"JobSpec.placement: node_labels and exclude_head have no {service} meaning: "
                f"{pick_nodes}"
            )
        return p.nodes, p.gpus_per_node
    gpus = spec.resources.gpus
    if gpus is None:
        return nodes, gpus_per_node
    if gpus != int(gpus):
        raise InvalidJobSpec(
            f"JobSpec.resources.gpus={gpus}: {service} takes whole GPUs: set a whole number "
            "(0 runs on CPU only)"
        )
    return nodes, int(gpus)


#: A GPU resource shape's GPUs per node: ``gpu.8xh100-80gb`` has 8.
_SHAPE_GPUS = re.compile(r"^gpu\.(\d+)x")


def check_torchrun_gpus(spec: JobSpec, gpus: int, shape: str, shape_field: str) -> None:
    """Under torchrun NeMo-Run starts `gpus` processes per node (its nproc_per_node: "Default
    to the number of GPUs specified per node"), on nodes of resource shape `shape`: a shape with
    another GPU count is refused, naming the field that set `gpus`."""
    match = _SHAPE_GPUS.match(shape)
    if spec.launcher != "torchrun" or gpus == 0 or match is None or int(match[1]) == gpus:
        return
    if spec.placement is not None:
        field = "JobSpec.placement.gpus_per_node"
    elif spec.resources.gpus is not None:
        field = "JobSpec.resources.gpus"
    else:
        field = f"{shape_field.split('.')[0]}.gpus_per_node"
    raise InvalidJobSpec(
        f"{field}={gpus}: torchrun would start {gpus} processes per node, but {shape_field}="
        f"'{shape}' nodes have {match[1]} GPUs: make them equal"
    )


def refuse_secret_env(spec: JobSpec, *, stored_in: str, fix: str) -> None:
    """InvalidJobSpec naming the secret env values, which `stored_in` would keep in plain text."""
    secret = sorted(k for k, v in spec.env.items() if not isinstance(v, str))
    if secret:
        raise InvalidJobSpec(
            f"JobSpec.env {secret}: secret values would be stored in {stored_in} in plain "
            f"text; {fix}"
        )


def code_plan(spec: JobSpec, transport: Transport) -> TransportPlan | None:
    """How spec.working_dir travels in env-var chunks over `transport` (None: no code)."""
    if spec.working_dir is None:
        return None
    archive = build_archive(spec.working_dir, exclude=spec.exclude)
    return plan_for(transport, archive, name=spec.name or "job")
