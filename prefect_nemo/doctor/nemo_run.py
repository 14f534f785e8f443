"""The checks of `prefect-nemo doctor` for the NeMo-Run backends, on the clients they use:
Slurm through the backend's SSH connection (the commands, the controller, accounting, the
account, the partition, the job dir), run:ai through its REST client (a token, the project),
Lepton through leptonai (the workspace, the node group). No Prefect; nemo-run is needed only
to have built the backend."""

from __future__ import annotations

import shlex
from typing import Any

from prefect_nemo.doctor.checks import Check, Status, ok
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, PrefectNemoError

SLURM_COMMANDS = ("sbatch", "sacct", "squeue", "scancel")

# -- Slurm ----------------------------------------------------------------------------------------


def slurm_checks(backend: Any) -> list[Check]:
    """SSH first (every other row runs a command over it), then what jobs need of Slurm."""
    config, field = backend.config, backend.config.field_prefix
    try:
        who = backend.run("id -un").stdout.strip()
    except AuthenticationFailed as exc:
        return [
            Check(
                "ssh",
                Status.FAIL,
                str(exc),
                f"set {field}.identity or {field}.identity_key to a key the login node "
                f"takes for '{config.user}', and {field}.known_hosts to its host key "
                f"(ssh-keyscan -p {config.port} {config.host})",
            )
        ]
    except BackendUnavailable as exc:
        return [
            Check(
                "ssh",
                Status.FAIL,
                str(exc),
                f"check {field}.host and {field}.port, and that sshd answers from this machine",
            )
        ]
    rows = [ok("ssh", f"{backend.address}: logged in as {who}")]
    rows.append(_commands(backend, field, who))
    if rows[-1].status is Status.FAIL:
        return rows
    rows.append(
        _ran(
            backend,
            "slurm controller",
            'squeue -h -u "$(id -un)" -o %i',
            "slurmctld answers (squeue)",
            "slurmctld must answer from the login node (`scontrol ping` says which controller "
            "is down)",
        )
    )
    rows.append(_accounting(backend))
    rows.append(_account(backend, field, who))
    if config.partition:
        rows.append(_partition(backend, field, config.partition))
    quoted = shlex.quote(backend.job_dir)
    rows.append(
        _ran(
            backend,
            "job dir",
            f"mkdir -p {quoted} && test -w {quoted}",
            f"{backend.job_dir} is writable",
            f"{field}.job_dir: a directory {who} may write, shared with the compute nodes",
        )
    )
    return rows


def _commands(backend: Any, field: str, who: str) -> Check:
    found = backend.run(f"command -v {' '.join(SLURM_COMMANDS)}", warn=True).stdout.split()
    missing = [c for c in SLURM_COMMANDS if not any(p.endswith(f"/{c}") for p in found)]
    if missing:
        return Check(
            "slurm commands",
            Status.FAIL,
            f"not on the PATH of {who}'s non-interactive login shell: {', '.join(missing)}",
            f"install Slurm's client commands on {backend.config.host}, or extend PATH where a "
            "non-interactive shell reads it (the top of ~/.bashrc)",
        )
    version = backend.run("sbatch --version", warn=True).stdout.strip() or "sbatch"
    return ok("slurm commands", f"{version}: {', '.join(SLURM_COMMANDS)} on the PATH")


def _ran(backend: Any, name: str, command: str, passed: str, fix: str) -> Check:
    """A row from one command's exit status (its error output as the detail)."""
    result = backend.run(command, warn=True)
    if result.exited != 0:
        said = (result.stderr or result.stdout).strip()[-300:] or f"exit {result.exited}"
        return Check(name, Status.FAIL, said, fix)
    return ok(name, passed)


def _accounting(backend: Any) -> Check:
    """sacct answers: a job's end state and exit code are read from it once the job has
    left the queue, so Slurm without accounting cannot tell success from failure."""
    storage = backend.run(
        "scontrol show config | sed -n 's/^AccountingStorageType *= *//p'", warn=True
    ).stdout.strip()
    check = _ran(
        backend,
        "slurm accounting",
        "sacct -n -X -P -S now-1hours -o JobID",
        f"sacct answers ({storage or 'accounting storage unknown'})",
        "turn Slurm accounting on (AccountingStorageType=accounting_storage/slurmdbd with a "
        "running slurmdbd): prefect-nemo reads a finished job's state and exit code from sacct",
    )
    if check.status is Status.OK and storage.endswith("/none"):
        return Check(check.name, Status.FAIL, f"accounting storage is {storage}", check.fix)
    return check


def _account(backend: Any, field: str, who: str) -> Check:
    """The block's account is one the user may charge (an association in sacctmgr)."""
    account = backend.config.account
    result = backend.run(
        f"sacctmgr -n -P show assoc where user={shlex.quote(who)} "
        f"account={shlex.quote(account)} format=Account",
        warn=True,
    )
    if result.exited != 0:
        return Check(
            "slurm account",
            Status.WARN,
            f"could not read associations: {result.stderr.strip()[-200:]}",
            f"check by hand: sacctmgr show assoc user={who}",
        )
    if account not in result.stdout.split():
        return Check(
            "slurm account",
            Status.FAIL,
            f"{who} has no association with account '{account}'",
            f"{field}.account: one of `sacctmgr -n show assoc user={who} format=Account`, or "
            "ask the cluster's admins to add you to it",
        )
    return ok("slurm account", f"{who} may charge '{account}'")


def _partition(backend: Any, field: str, partition: str) -> Check:
    listed = backend.run("sinfo -h -o %P", warn=True).stdout.split()
    names = [p.rstrip("*") for p in listed]  # sinfo marks the default partition with '*'
    if partition not in names:
        return Check(
            "slurm partition",
            Status.FAIL,
            f"no partition '{partition}'",
            f"{field}.partition: one of {', '.join(names) or '(none listed)'}",
        )
    return ok("slurm partition", f"'{partition}' exists")


# -- run:ai (DGX Cloud) ---------------------------------------------------------------------------


def runai_checks(backend: Any) -> list[Check]:
    """A token from the application's credentials, then the project."""
    config, runai = backend.config, backend.client
    try:
        runai.token(refresh=True)
    except AuthenticationFailed as exc:
        return [
            Check(
                "run:ai credentials",
                Status.FAIL,
                str(exc),
                "set DGXCloudCluster.client_id and client_secret to a run:ai "
                "application's (the Applications page of the run:ai UI)",
            )
        ]
    except BackendUnavailable as exc:
        return [
            Check(
                "run:ai credentials",
                Status.FAIL,
                str(exc),
                "check DGXCloudCluster.base_url (https://<tenant>.run.ai/api/v1) and that "
                "this machine reaches it",
            )
        ]
    rows = [
        ok(
            "run:ai credentials",
            f"a token from {config.base_url}/token for client_id '{config.client_id}'",
        )
    ]
    try:
        project, cluster = runai.project()
    except PrefectNemoError as exc:
        return [
            *rows,
            Check(
                "run:ai project",
                Status.FAIL,
                str(exc),
                "fix DGXCloudCluster.project_name, or give the application access to the project",
            ),
        ]
    return [
        *rows,
        ok("run:ai project", f"'{config.project_name}' (id {project}, cluster {cluster})"),
    ]


# -- Lepton ---------------------------------------------------------------------------------------


def lepton_checks(backend: Any) -> list[Check]:
    """The workspace answers with the token (one listing of the node groups), and the block's
    node group is among them."""
    config = backend.config
    workspace = f"workspace '{config.workspace_id}'"
    try:
        backend.check_access()
    except AuthenticationFailed as exc:
        return [
            Check(
                "lepton workspace",
                Status.FAIL,
                str(exc),
                "set LeptonWorkspace.token to a token of this workspace (the dashboard's "
                "settings, API tokens)",
            )
        ]
    except BackendUnavailable as exc:
        return [
            Check(
                "lepton workspace",
                Status.FAIL,
                str(exc),
                "check LeptonWorkspace.workspace_url and workspace_id, and that this "
                "machine reaches the workspace API",
            )
        ]
    except PrefectNemoError as exc:  # the node group is not there: the workspace answered
        return [
            ok("lepton workspace", f"{workspace} answers with the token"),
            Check(
                "lepton node group",
                Status.FAIL,
                str(exc),
                "fix LeptonWorkspace.node_group (a dedicated node group's name)",
            ),
        ]
    return [
        ok("lepton workspace", f"{workspace} answers with the token"),
        ok("lepton node group", f"'{config.node_group}' exists"),
    ]
