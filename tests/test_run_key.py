"""Issue 17 item 2: "A re-run that should attach can. Document and test the three ways to get
'same work, attach': an experiment name, a retry of the crashed run, and an explicit run key
(idempotency key) on a plain flow run ... for users who just run the script again." The first
two are tested in test_run_job.py / test_crash_safety.py; the run key here."""

from __future__ import annotations

import uuid

import pytest
from prefect import flow

from prefect_nemo import JobSpec, run_job, run_key
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.jobs import META_KEY

pytestmark = pytest.mark.slow


def _ours(ray_client, key: str) -> list:
    return [j for j in ray_client.list_jobs() if (j.metadata or {}).get(META_KEY, "").startswith(
        f"run-key:{key}/")]  # fmt: skip


def test_a_plain_run_with_a_run_key_attaches_when_run_again(cluster, ray_client):
    """Two flow runs (two flow run ids, like a script run twice) with one run key: one job."""
    key = f"nightly-{uuid.uuid4().hex[:6]}"

    @flow
    def script():
        run_key(key)
        return run_job(JobSpec(entrypoint="echo once", name="step"), cluster)

    first, second = script(), script()
    assert not first.attached and second.attached
    assert first.handle.job_id == second.handle.job_id and first.handle.job_id.startswith(key)
    assert len(_ours(ray_client, key)) == 1, "the second run submitted nothing"


def test_the_run_key_can_come_from_the_environment(cluster, ray_client, monkeypatch):
    """`PREFECT_NEMO_RUN_KEY=... python script.py` again: the same jobs, with no code change."""
    key = f"env-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("PREFECT_NEMO_RUN_KEY", key)

    @flow
    def script():
        return run_job(JobSpec(entrypoint="echo once", name="step"), cluster)

    assert not script().attached and script().attached
    assert len(_ours(ray_client, key)) == 1


def test_a_bad_run_key_is_refused(prefect_api):
    @flow
    def script():
        run_key("")

    with pytest.raises(InvalidJobSpec, match="run_key ''"):
        script()
