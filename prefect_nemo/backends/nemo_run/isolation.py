"""Guards against NeMo-Run's side effects; the one place that imports nemo_run.

NeMo-Run reads ``NEMORUN_HOME`` once, when it is first imported, and writes job records
there (``.slurm_jobs``, ``.local_jobs.json``, experiment dirs); some of its entry points reset
the root logger (``logging.basicConfig(force=True)``) and its SSH tunnel prompts for a password
and calls ``sys.exit(1)`` when key authentication fails. Everything here keeps those effects
inside prefect-nemo: an isolated home per project, the root logger restored, no prompts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from prefect_nemo.nemo_run_home import nemorun_home

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None


def nemo_run() -> ModuleType:
    """`import nemo_run` with NEMORUN_HOME set to `nemorun_home()` first and the root logger
    kept as it was; later calls return the module at once.

    If the process imported nemo_run before us, its home cannot change any more (NeMo-Run
    computes its file paths at import): we warn and live with it.
    """
    global _module
    with _lock:
        if _module is not None:
            return _module
        home = nemorun_home()
        if "nemo_run" in sys.modules:
            current = sys.modules["nemo_run"].config.get_nemorun_home()
            if Path(current).absolute() != home:
                log.warning(
                    "nemo_run was imported before prefect-nemo could isolate it: its files "
                    "stay in %s (import prefect-nemo's backends first to use %s)",
                    current,
                    home,
                )
        else:
            home.mkdir(parents=True, exist_ok=True)
            home.chmod(0o700)  # job records name hosts, users and key paths
            os.environ["NEMORUN_HOME"] = str(home)
        with root_logger_kept():
            import nemo_run
            import nemo_run.run.torchx_backend.launcher
            import nemo_run.run.torchx_backend.packaging
            import nemo_run.run.torchx_backend.runner
        module: ModuleType = nemo_run
        _module = module
        return module


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """Restore the root logger's handlers, level and disabled flag after the block, whatever
    NeMo-Run did to them (Experiment, RayCluster and RayJob call basicConfig(force=True))."""
    root = logging.getLogger()
    handlers, level, disabled = list(root.handlers), root.level, root.disabled
    try:
        yield
    finally:
        if root.handlers != handlers:
            for handler in root.handlers:
                if handler not in handlers:
                    root.removeHandler(handler)
            for handler in handlers:
                if handler not in root.handlers:
                    root.addHandler(handler)
        root.setLevel(level)
        root.disabled = disabled


def home_files() -> list[Path]:
    """Every file under the NEMORUN_HOME in use (for secret scans in tests and audits).

    Other processes of the project share the home and drop experiment dirs as they go
    (`after_schedule`): os.walk skips a dir that vanishes mid-walk, where Path.rglob raised
    FileNotFoundError (seen in CI with four test workers)."""
    home = nemo_run().config.get_nemorun_home()
    return [Path(top, name) for top, _, names in os.walk(home) for name in names]


def home_texts() -> dict[Path, str]:
    """Each file under the NEMORUN_HOME in use and its text; a file another process removed
    before it was read is left out."""
    texts = {}
    for path in home_files():
        with contextlib.suppress(FileNotFoundError):
            texts[path] = path.read_text(errors="ignore")
    return texts
