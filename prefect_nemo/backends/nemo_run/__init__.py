"""NeMo-Run executors behind the Backend protocol, one module each: `local`, `slurm` (a
package: executor, ssh, accounting), `lepton` and `dgx_cloud` (on `service.ServiceBackend`;
`runai` is the run:ai REST client), and Ray on those clouds (`ray_clusters`); all on
`base.NemoRunBackend`. Dry runs are NeMo-Run's own (torchx's for local and Slurm) or its
submission code with its requests answered locally (`dry_run`, the services). Importing this
package does not import nemo_run: `isolation.nemo_run()` does, on first use, with NEMORUN_HOME
isolated."""

from prefect_nemo.backends.nemo_run.base import NemoRunBackend
from prefect_nemo.nemo_run_home import HOME_ENV, nemorun_home

__all__ = ["HOME_ENV", "NemoRunBackend", "nemorun_home"]
