"""Experiments: named flow runs, and dependencies between them across separately started runs.

Inside one flow, depend on work with ordinary futures and `wait_for`. Across flow runs (one
started from the UI, one from a schedule...), call `start_experiment(name, depends_on=[...])`
at the top of the flow: it names this run, makes job ids stable per experiment (a new run of the
same experiment re-attaches to its jobs), and waits for each upstream experiment: COMPLETED is
satisfied, FAILED/CRASHED/CANCELLED fails this flow at once, anything else is waited for.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.context import FlowRunContext

from prefect_nemo.errors import DependencyFailed, DependencyNotFound, InvalidJobSpec
from prefect_nemo.tasks._run import declare_experiment, declare_run_key
from prefect_nemo.tasks.reporting import emit

FAILED_STATES = {StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}
EXPERIMENT_TAG = "prefect-nemo.experiment"


class Experiment:
    """This flow run as an experiment, with the upstream runs it waited for.

    A plain class, not a dataclass: passed to a task (`run_job(..., after=[experiment])`),
    Prefect then hands it over as is instead of trying to resolve the upstream runs' states
    inside it (their results are not persisted).
    """

    __slots__ = ("flow_run_id", "name", "upstream")

    def __init__(self, name: str, flow_run_id: str, upstream: tuple[FlowRun, ...] = ()) -> None:
        self.name = name
        self.flow_run_id = flow_run_id
        self.upstream = tuple(upstream)

    def __repr__(self) -> str:
        names = ", ".join(run.name for run in self.upstream)
        return (
            f"Experiment(name={self.name!r}, flow_run_id={self.flow_run_id!r}, upstream=[{names}])"
        )

    @property
    def resource_id(self) -> str:
        """The Prefect event resource id of this experiment."""
        return f"prefect-nemo.experiment.{self.name}"

    def emit(self, what: str, payload: dict[str, Any] | None = None) -> None:
        """Emit `prefect-nemo.experiment.<what>` about this experiment (outputs in payload)."""
        emit(
            f"prefect-nemo.experiment.{what}",
            {
                "prefect.resource.id": self.resource_id,
                "prefect.resource.name": self.name,
                "prefect-nemo.flow-run-id": self.flow_run_id,
            },
            payload,
        )


def start_experiment(
    name: str,
    depends_on: Iterable[str | UUID] = (),
    *,
    timeout_s: float | None = None,
    not_found_timeout_s: float = 60.0,
    poll_s: float = 2.0,
) -> Experiment:
    """Declare this flow run as experiment `name` and wait for the experiments it depends on."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        raise InvalidJobSpec("start_experiment: call it inside a flow (it names that flow run)")
    _check_name(name)
    flow_run = ctx.flow_run
    flow_run_id = str(flow_run.id)
    declare_experiment(flow_run_id, name)
    if flow_run.name != name or EXPERIMENT_TAG not in (flow_run.tags or []):
        with get_client(sync_client=True) as client:
            client.update_flow_run(
                flow_run.id, name=name, tags=sorted({*(flow_run.tags or []), EXPERIMENT_TAG})
            )
    experiment = Experiment(name=name, flow_run_id=flow_run_id)
    refs = list(depends_on)
    if refs:
        get_run_logger().info(f"experiment {name} waits for: {', '.join(map(str, refs))}")
        upstream = wait_for_experiments(
            refs,
            timeout_s=timeout_s,
            not_found_timeout_s=not_found_timeout_s,
            poll_s=poll_s,
            exclude=flow_run.id,
        )
        experiment = Experiment(name=name, flow_run_id=flow_run_id, upstream=tuple(upstream))
    experiment.emit("started", {"depends_on": [str(r) for r in refs]})
    return experiment


def run_key(key: str) -> None:
    """Make this flow run's jobs the jobs of `key`: running the script (or the flow) again with
    the same key attaches to them instead of submitting them again, as a retry of the run or a
    new run of an experiment does. For the plain runs that are neither (no rename, no
    dependencies). `PREFECT_NEMO_RUN_KEY` sets one for every flow run of a process."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        raise InvalidJobSpec("run_key: call it inside a flow (it keys that flow run's jobs)")
    _check_name(key, "run_key")
    declare_run_key(str(ctx.flow_run.id), key)


def _check_name(name: str, what: str = "experiment name") -> None:
    if not isinstance(name, str) or not name or len(name) > 100 or not name[0].isalnum():
        raise InvalidJobSpec(
            f"{what} {name!r}: use 1-100 characters starting with a letter or digit"
        )


def wait_for_experiments(
    refs: Iterable[str | UUID],
    *,
    timeout_s: float | None = None,
    not_found_timeout_s: float = 60.0,
    poll_s: float = 2.0,
    exclude: UUID | None = None,
) -> list[FlowRun]:
    """Wait until every referenced experiment (name or flow-run id) has COMPLETED.

    A name means the newest flow run with that name. Raises DependencyFailed as soon as one is
    FAILED, CRASHED or CANCELLED; DependencyNotFound if one does not appear in time.
    """
    refs = list(refs)
    started = time.monotonic()
    done: dict[str, FlowRun] = {}
    with get_client(sync_client=True) as client:
        while True:
            waiting: list[str] = []
            for ref in refs:
                if str(ref) in done:
                    continue
                run = _resolve(client, ref, exclude)
                if run is None:
                    if time.monotonic() - started > not_found_timeout_s:
                        raise DependencyNotFound(
                            f"no flow run named or with id {str(ref)!r} appeared within "
                            f"{not_found_timeout_s:g}s: start that experiment or fix the name"
                        )
                    waiting.append(f"{ref} (not started yet)")
                    continue
                state = run.state
                if state is not None and state.type == StateType.COMPLETED:
                    done[str(ref)] = run
                elif state is not None and state.type in FAILED_STATES:
                    raise DependencyFailed(
                        f"upstream experiment {run.name!r} (flow run {run.id}) is "
                        f"{state.type.value}: {state.message or 'no message'}. Re-run it, then "
                        "re-run this flow."
                    )
                else:
                    waiting.append(f"{run.name} ({state.type.value if state else 'no state'})")
            if not waiting:
                return [done[str(r)] for r in refs]
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise DependencyFailed(
                    f"upstream experiments still not complete after {timeout_s:g}s: "
                    + ", ".join(waiting)
                )
            time.sleep(poll_s)


def _resolve(client: Any, ref: str | UUID, exclude: UUID | None) -> FlowRun | None:
    """The flow run a reference means: by id, else the newest run with that name."""
    run_id = ref if isinstance(ref, UUID) else _as_uuid(ref)
    if run_id is not None:
        by_id = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        runs = client.read_flow_runs(flow_run_filter=by_id)
        return runs[0] if runs else None
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[str(ref)])),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC,
        limit=5,
    )
    runs = [r for r in runs if r.id != exclude]
    return runs[0] if runs else None


def _as_uuid(text: str) -> UUID | None:
    try:
        return UUID(text)
    except ValueError:
        return None
