"""examples/demo_pipeline.ipynb, executed headless (nbclient + ipykernel) against the session's real
Prefect API and real Ray, with its outputs checked."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import nbformat
import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOK = ROOT / "examples" / "demo_pipeline.ipynb"
EXECUTED = ROOT / "test-artifacts" / "notebook"


def test_notebook_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    assert nb.metadata.kernelspec.name == "python3"


def _kernel_manager(tmp_path: Path) -> Any:
    """A python3 kernel on this interpreter, whatever other kernelspecs the machine has."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (this environment)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)


def _outputs(nb: Any, tag: str) -> tuple[str, str]:
    """(stdout, markdown) a tagged cell showed."""
    cell = next(c for c in nb.cells if tag in c.metadata.get("tags", []))
    stdout = "".join(
        o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
    )
    markdown = "".join(
        o.data.get("text/markdown", "") for o in cell.outputs if o.output_type == "display_data"
    )
    return stdout, markdown


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_runs_the_demo_pipeline(prefect_api: str, ray_head: Any, tmp_path: Path) -> None:
    import prefect
    from nbclient import NotebookClient
    from prefect.client.orchestration import get_client

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(
        os.environ,
        PREFECT_API_URL=prefect_api,
        PYTHONUNBUFFERED="1",
        RAY_API_SERVER_ADDRESS=ray_head.dashboard_url,
        RAY_AUTH_TOKEN=ray_head.token or "",
    )
    env.pop("PREFECT_PROFILE", None)
    client = NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    try:
        client.execute(env=env)
    finally:
        EXECUTED.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, EXECUTED / NOTEBOOK.name)  # to look at what it showed

    # The kernel ran this environment's Prefect, against the session's API and Ray.
    stdout, _ = _outputs(nb, "connect")
    assert f"Prefect {prefect.__version__}, API {prefect_api}" in stdout
    stdout, _ = _outputs(nb, "cluster")
    assert stdout.strip() == f"Ray dashboard: {ray_head.dashboard_url}"

    stdout, _ = _outputs(nb, "run")
    found = re.search(r"pipeline (notebook-[\d-]+): COMPLETED \(flow run ([0-9a-f-]{36})\)", stdout)
    assert found, stdout
    name, flow_run_id = found.group(1), UUID(found.group(2))
    assert f"/runs/flow-run/{flow_run_id}" in stdout
    with get_client(sync_client=True) as prefect_client:
        assert prefect_client.read_flow_run(flow_run_id).state.is_completed()

    # The job table: all nine jobs SUCCEEDED, each linked to the Ray dashboard.
    stdout, markdown = _outputs(nb, "jobs")
    assert stdout.strip() == "9 jobs: 9 SUCCEEDED"
    rows = [line for line in markdown.splitlines() if line.startswith(f"| {name}-")]
    assert len(rows) == 9, markdown
    for row in rows:
        assert "| SUCCEEDED |" in row and f"]({ray_head.dashboard_url}/#/jobs/{name}-" in row

    # The experiments' outputs, and their completed events as the server stored them.
    stdout, markdown = _outputs(nb, "outputs")
    assert float(stdout.strip().removeprefix("accuracy=")) > 0.8
    for output in ("data_uri", "checkpoint_uri", "train_loss", "accuracy", "eval_loss"):
        assert f"| {output} |" in markdown
    stdout, _ = _outputs(nb, "events")
    events = [line for line in stdout.splitlines() if line.startswith("prefect-nemo.experiment.")]
    assert [line.split()[:2] for line in events] == [
        ["prefect-nemo.experiment.completed", f"{name}-{step}"]
        for step in ("data-prep", "train", "eval")
    ]
    assert "'accuracy':" in events[-1]

    stdout, _ = _outputs(nb, "cleanup")
    assert stdout.strip() == "left Ray running", "the session's cluster was reused, not stopped"
