"""Cross-experiment dependencies between separately started flow runs, on a real Prefect API."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prefect import flow

from prefect_nemo import (
    DependencyFailed,
    DependencyNotFound,
    InvalidJobSpec,
    start_experiment,
)

pytestmark = pytest.mark.slow


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@flow
def upstream(name: str, fail: bool = False, hold_s: float = 0.0) -> str:
    start_experiment(name)
    time.sleep(hold_s)
    if fail:
        raise RuntimeError("upstream broke")
    return name


@flow
def downstream(name: str, after: list[str]) -> list[str]:
    experiment = start_experiment(name, depends_on=after, poll_s=0.5, not_found_timeout_s=5)
    return [run.name for run in experiment.upstream]


def test_completed_dependency_is_satisfied(prefect_api):
    up = unique("prep")
    upstream(up)
    assert downstream(unique("train"), [up]) == [up]


def test_dependency_by_flow_run_id(prefect_api):
    up = unique("prep")
    state = upstream(up, return_state=True)
    run_id = str(state.state_details.flow_run_id)
    assert downstream(unique("train"), [run_id]) == [up]


def test_failed_dependency_fails_at_once(prefect_api):
    up = unique("prep")
    upstream(up, fail=True, return_state=True)
    started = time.monotonic()
    with pytest.raises(DependencyFailed, match=rf"'{up}'.*FAILED.*Re-run it"):
        downstream(unique("train"), [up])
    assert time.monotonic() - started < 5, "a failed dependency must not be polled for long"


def test_running_dependency_is_waited_for(prefect_api):
    up = unique("prep")
    finished: dict[str, float] = {}

    def run_upstream():
        upstream(up, hold_s=6)
        finished["up"] = time.monotonic()

    thread = threading.Thread(target=run_upstream)
    thread.start()
    time.sleep(1.5)  # upstream is RUNNING when downstream starts
    assert downstream(unique("train"), [up]) == [up]
    finished["down"] = time.monotonic()
    thread.join()
    assert finished["down"] >= finished["up"] - 1.0


def test_missing_dependency_fails_clearly(prefect_api):
    with pytest.raises(DependencyNotFound, match="start that experiment or fix the name"):
        downstream(unique("train"), [unique("never-started")])


def test_start_experiment_needs_a_flow():
    with pytest.raises(InvalidJobSpec, match="inside a flow"):
        start_experiment("outside")
