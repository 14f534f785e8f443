"""The demo pipeline: data-prep -> train -> eval, three experiments of real (small, CPU) Ray jobs.

Each experiment is its own flow run and can be started on its own (UI, schedule, CLI); the
dependencies between them are declared by experiment name, so `train` waits for `data-prep`
even when the two were started separately. `demo_pipeline` starts all three at once to show it.

The flows live in the package (`prefect_nemo.demo`, so `prefect-nemo demo` runs from a wheel);
this file is where deployments and notebooks name them (`flows/demo.py:<flow>`).
"""

from prefect_nemo.demo import JOB_CODE, data_prep, demo_pipeline, evaluate, train

__all__ = ["JOB_CODE", "data_prep", "demo_pipeline", "evaluate", "train"]
