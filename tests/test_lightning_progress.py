"""Issue 31, item 1: "a NeMo-Run / PyTorch Lightning callback that calls it". A real Lightning
Trainer (lightning 2.6, torch on CPU) trains a small model with `report.progress_callback()` in
its callbacks, as a job of NeMo-Run's LocalExecutor; Prefect shows its steps and logged metrics.

Lightning itself checks the callback's type ("callbacks ... must be of type Callback"), so this
also proves the callback derives from Lightning's `Callback` when Lightning is installed."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

import prefect_nemo.report as report_module
from prefect_nemo import JobSpec, JobState, run_job
from tests.conftest import IN_CI
from tests.test_nemo_run_local import NemoRunLocal

pytestmark = [pytest.mark.nemo_run, pytest.mark.slow]

STEPS = 300

# y = x @ w: the loss falls as the model learns w; validation every 100 steps
TRAINING = f"""
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
from report import progress_callback

torch.manual_seed(0)
w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
x = torch.randn(512, 4)
data = TensorDataset(x, x @ w)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        inputs, target = batch
        loss = torch.nn.functional.mse_loss(self.layer(inputs), target)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        inputs, target = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(inputs), target))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


trainer = L.Trainer(
    max_steps={STEPS}, val_check_interval=100, check_val_every_n_epoch=None,
    callbacks=[progress_callback(every_n_steps=25)], accelerator="cpu", devices=1,
    logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Regression(), DataLoader(data, batch_size=8, shuffle=True),
            DataLoader(data, batch_size=64))
print("trained", trainer.global_step, flush=True)
"""


def test_a_lightning_trainer_with_the_callback_shows_its_steps_and_metrics_in_prefect(
    prefect_api, tmp_path
):
    """Issue 31: "report from inside a job ... and a NeMo-Run / PyTorch Lightning callback that
    calls it"; "per job a Prefect progress artifact (its percentage and ETA), a table artifact of
    the latest metrics, a chart of each metric over steps"."""
    try:
        import lightning  # noqa: F401 - only whether it is installed
    except ImportError as exc:  # the extras environment installs the `lightning` extra
        (pytest.fail if IN_CI else pytest.skip)(f"Lightning is not installed: {exc}")
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(report_module.__file__, code / "report.py")
    (code / "job.py").write_text(TRAINING)
    spec = JobSpec(entrypoint=f"{sys.executable} job.py", name="lightning", working_dir=code)

    @flow
    def training_flow():
        return run_job(spec, cluster=NemoRunLocal())

    state = training_flow(return_state=True)
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    log = NemoRunLocal().backend().logs(result.handle.job_id)
    assert f"trained {STEPS}" in log
    # every 25 steps, after each of the 3 validations, and at the end (not twice for one step)
    assert log.count("@@prefect-nemo.report ") >= STEPS // 25

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))  # fmt: skip
    by_kind = {a.type: a for a in artifacts if result.handle.job_id in (a.description or "")}
    assert by_kind["progress"].data == 100.0
    assert f"step {STEPS}/{STEPS} (100.0%)" in by_kind["progress"].description
    rows = {row["metric"]: row for row in json.loads(by_kind["table"].data)}
    assert set(rows) >= {"train_loss", "val_loss"}, rows
    assert rows["val_loss"]["step"] == STEPS
    # the model learned: the last losses are far below the first one reported
    assert rows["train_loss"]["value"] < rows["train_loss"]["max"] / 10
    assert rows["val_loss"]["value"] < 0.05
    chart = by_kind["markdown"].data
    assert "### train_loss" in chart and "### val_loss" in chart
