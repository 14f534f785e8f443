"""The sweeper as a deployable flow: stop the jobs of flow runs that died without a word.

`deployments/prefect.yaml` runs it every minute, three sweeps 20 s apart (turn the schedule on),
and whenever a flow run crashes (`prefect.flow-run.Crashed`). From a shell: `prefect-nemo sweep
[BLOCK ...]`. What it decides, and why, is in `prefect_nemo.tasks.sweeper`.
"""

from prefect_nemo.tasks.sweeper import sweep_flow

__all__ = ["sweep_flow"]
