"""The demo pipeline, packaged so that `prefect-nemo demo` runs from an installed wheel.

`flows/demo.py` (the deployments' entrypoints) takes its flows from here. The jobs' scripts in
`jobs/` are package data, not modules: they run on the cluster with `jobs/` as working_dir and
need numpy there (`pip install 'prefect-nemo[demo]'`).
"""

from prefect_nemo.demo.pipeline import JOB_CODE, data_prep, demo_pipeline, evaluate, train

__all__ = ["JOB_CODE", "data_prep", "demo_pipeline", "evaluate", "train"]
