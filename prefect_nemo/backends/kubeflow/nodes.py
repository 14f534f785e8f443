"""What runs on each node pod of a TrainJob: the trainer command (the code unpacked, extra
packages installed, the entrypoint under torchrun with the rendezvous the Torch plugin hands
every node in ``PET_*`` env vars), its env (secret values by reference), and the
``runtimePatches`` entries that mount the code and apply ``JobSpec.placement``. Pure; no Prefect.
"""

from __future__ import annotations

import copy
import re
import shlex
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from prefect_nemo.backends._kube_objects import secret_name
from prefect_nemo.backends.kubeflow.runtimes import NODE, TrainerConfig
from prefect_nemo.jobs import JobSpec
from prefect_nemo.placement.spec import PlacementSpec, to_kubernetes

if TYPE_CHECKING:
    from prefect_nemo.packaging import TransportPlan

PATCH_MANAGER = "prefect-nemo.io/code"  # our runtimePatches entry for the code
PLACEMENT_MANAGER = "prefect-nemo.io/placement"  # ... and for JobSpec.placement
PLACEMENT_GROUP_LABEL = "prefect-nemo/placement-group"  # what to_kubernetes' anti-affinity selects

# The Torch plugin sets these and its webhook refuses a TrainJob that sets them itself.
PET_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
           "PET_MASTER_PORT")  # fmt: skip
TORCHRUN_FLAGS = (
    '--nnodes="$PET_NNODES" --nproc-per-node="$PET_NPROC_PER_NODE" '
    '--node-rank="$PET_NODE_RANK" --master-addr="$PET_MASTER_ADDR" '
    '--master-port="$PET_MASTER_PORT"'
)

_PYTHON = re.compile(r"^(python3?(\.[0-9]+)?)\s+")


def trainer_env(spec: JobSpec, job_id: str) -> list[dict[str, Any]]:
    """Plain values inline; secret ones by reference to the job's Secret."""
    env: list[dict[str, Any]] = []
    for key, value in spec.env.items():
        if isinstance(value, SecretStr):
            ref = {"name": secret_name(job_id), "key": key}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
        else:
            env.append({"name": key, "value": value})
    return env


def trainer_command(spec: JobSpec, config: TrainerConfig, setup: str | None = None) -> list[str]:
    """`sh -c` script: unpack the code, cd into it, install extras, run: under torchrun only
    with JobSpec.launcher='torchrun' (as NeMo-Run packages a task with no launcher: the command
    as is, once per node).

    torchrun gets its rendezvous from the PET_* env the Torch plugin sets on every node; an
    entrypoint that is not a Python program (no leading `python`) runs as is.
    """
    lines = ["set -e", 'export NODE_RANK="${NODE_RANK:-${PET_NODE_RANK:-0}}"']
    if setup:
        lines.append(setup)
        lines.append(f"cd {shlex.quote(config.code_dir)}")
    if config.extra_packages:
        pkgs = " ".join(shlex.quote(p) for p in config.extra_packages)
        lines.append(f"python -m pip install --quiet --disable-pip-version-check {pkgs}")
    # the entrypoint runs under the shell's usual rules (its last command's status is the job's)
    run = spec.entrypoint or ""
    if spec.launcher == "torchrun":
        run = torchrun_entrypoint(run, config, script=_is_script(spec))
    lines += ["set +e", run]
    return ["sh", "-c", "\n".join(lines)]


def torchrun_entrypoint(entrypoint: str, config: TrainerConfig, *, script: bool = False) -> str:
    """`python x.py a` → `torchrun <rendezvous flags> x.py a` (also `python -m mod a`); any
    other command (`python -c ...`, a shell script), or torchrun off, is left as is. A
    run.Script task's non-Python command runs under torchrun as NeMo-Run's torchrun component
    runs one: `torchrun ... --no-python <command>` (`script`)."""
    match = _PYTHON.match(entrypoint)
    if config.torchrun and script and match is None:
        return f"torchrun {TORCHRUN_FLAGS} --no-python {entrypoint}"
    if not config.torchrun or match is None:
        return entrypoint
    rest = entrypoint[match.end() :]
    try:
        first = shlex.split(rest)[0] if rest.strip() else ""
    except ValueError:
        return entrypoint
    if first != "-m" and not first.endswith(".py"):
        return entrypoint
    return f"torchrun {TORCHRUN_FLAGS} {rest}"


def _is_script(spec: JobSpec) -> bool:
    return spec.task is not None and spec.task.kind == "script"


def code_patch(plan: TransportPlan) -> dict[str, Any]:
    """The runtimePatches entry mounting the code ConfigMaps into the node container."""
    pod = {
        "volumes": copy.deepcopy(list(plan.volumes)),
        "containers": [{"name": NODE, "volumeMounts": copy.deepcopy(list(plan.volume_mounts))}],
    }
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }


def placement_patch(placement: PlacementSpec, job_id: str) -> dict[str, Any] | None:
    """The runtimePatches entry putting JobSpec.placement's scheduling on the node pods
    (nodeSelector, node affinity; for nodes > 1 the pod anti-affinity, with the group label it
    selects on), or None when it constrains nothing. Resources come from the runtime, which
    check_placement made agree. A patched `affinity` replaces the runtime's (Trainer applies
    patches field by field), so the anti-affinity is repeated here, not left to the runtime."""
    pod = to_kubernetes(placement, group=job_id)
    spec: dict[str, Any] = {}
    if pod["nodeSelector"]:
        spec["nodeSelector"] = pod["nodeSelector"]
    if pod["affinity"]:
        spec["affinity"] = pod["affinity"]
    if not spec:
        return None
    template: dict[str, Any] = {"spec": spec}
    if "podAntiAffinity" in pod["affinity"]:
        template["metadata"] = {"labels": {PLACEMENT_GROUP_LABEL: job_id}}
    return {
        "manager": PLACEMENT_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [{"name": NODE, "template": {"spec": {"template": template}}}]
                }
            }
        },
    }
