"""The Kubeflow Trainer backend: jobs as TrainJobs (`trainjob`) on runtimes built from a block's
config (`runtimes`), each node running the trainer command under torchrun (`nodes`). No Prefect
import."""

from prefect_nemo.backends._kube_objects import secret_manifest
from prefect_nemo.backends.kubeflow.cleanup import (
    IDLE_S,
    remove_unused_runtimes,
    touch_runtime,
)
from prefect_nemo.backends.kubeflow.nodes import (
    PATCH_MANAGER,
    PET_ENV,
    PLACEMENT_GROUP_LABEL,
    PLACEMENT_MANAGER,
    TORCHRUN_FLAGS,
    code_patch,
    placement_patch,
    torchrun_entrypoint,
    trainer_command,
    trainer_env,
)
from prefect_nemo.backends.kubeflow.runtimes import (
    RUNTIME_PREFIX_LABEL,
    PvcMount,
    TrainerConfig,
    check_config,
    check_placement,
    node_resources,
    pip_env,
    pvc_manifest,
    runtime_body,
    runtime_manifest,
    runtime_name,
)
from prefect_nemo.backends.kubeflow.trainjob import (
    MAX_TRAINJOB_NAME,
    KubeflowTrainerBackend,
    check_job_id,
    check_spec,
    owned_objects,
    status_from_trainjob,
    trainjob_manifest,
)

__all__ = [
    "IDLE_S",
    "MAX_TRAINJOB_NAME",
    "PATCH_MANAGER",
    "PET_ENV",
    "PLACEMENT_GROUP_LABEL",
    "PLACEMENT_MANAGER",
    "RUNTIME_PREFIX_LABEL",
    "TORCHRUN_FLAGS",
    "KubeflowTrainerBackend",
    "PvcMount",
    "TrainerConfig",
    "check_config",
    "check_job_id",
    "check_placement",
    "check_spec",
    "code_patch",
    "node_resources",
    "owned_objects",
    "pip_env",
    "placement_patch",
    "pvc_manifest",
    "remove_unused_runtimes",
    "runtime_body",
    "runtime_manifest",
    "runtime_name",
    "secret_manifest",
    "status_from_trainjob",
    "torchrun_entrypoint",
    "touch_runtime",
    "trainer_command",
    "trainer_env",
    "trainjob_manifest",
]  # fmt: skip
