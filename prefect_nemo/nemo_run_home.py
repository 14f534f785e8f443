"""Where NeMo-Run keeps its files for prefect-nemo, set before NeMo-Run is imported.

NeMo-Run reads ``NEMORUN_HOME`` once, when it is first imported. This module imports nothing
heavy, so `import prefect_nemo` can claim the home (`claim_home`) before a user's own
`import nemo_run`; `backends.nemo_run.isolation` does the importing itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Overrides where NeMo-Run keeps its files for prefect-nemo (default: ./.prefect-nemo/nemo-run).
HOME_ENV = "PREFECT_NEMO_NEMORUN_HOME"


def nemorun_home() -> Path:
    """The NEMORUN_HOME prefect-nemo gives NeMo-Run: $PREFECT_NEMO_NEMORUN_HOME, else the
    project's ``.prefect-nemo/nemo-run`` (beside the CLI's other state), as an absolute path."""
    env = os.environ.get(HOME_ENV)
    return (
        Path(env).expanduser().absolute() if env else Path(".prefect-nemo", "nemo-run").absolute()
    )


def claim_home() -> None:
    """Point a NeMo-Run not imported yet at `nemorun_home()` (NEMORUN_HOME in this process's
    environment), without importing it: `import prefect_nemo` calls this, so a user's own
    `import nemo_run` that follows it keeps its files there too, not in ~/.nemo_run."""
    if "nemo_run" not in sys.modules:
        os.environ["NEMORUN_HOME"] = str(nemorun_home())
