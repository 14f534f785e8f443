"""Apply a prefect.yaml: check it, create the work pools it names, then `prefect deploy` it.

The checks run before anything reaches the server: every entrypoint loads as a flow, and every
parameter a deployment or one of its triggers passes is a parameter of that flow. Entrypoints
are relative to the directory the command runs in (the repository root).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefect_nemo.errors import InvalidJobSpec

DEFAULT_FILE = Path("deployments/prefect.yaml")
DEFAULT_POOL_TYPE = "process"


@dataclass(frozen=True)
class DeploymentEntry:
    """One deployment of a prefect.yaml, as far as the checks need it."""

    name: str
    entrypoint: str
    parameters: dict[str, Any]
    trigger_parameters: tuple[dict[str, Any], ...]
    work_pool: str | None


def read_deployments(path: str | Path = DEFAULT_FILE) -> list[DeploymentEntry]:
    """The deployments of a prefect.yaml (YAML anchors resolved)."""
    path = Path(path)
    try:
        content = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InvalidJobSpec(f"{path}: cannot read the file ({exc.strerror})") from None
    if not isinstance(content, dict) or not isinstance(content.get("deployments"), list):
        raise InvalidJobSpec(f"{path}: expected a prefect.yaml with a 'deployments:' list")
    entries = []
    for i, item in enumerate(content["deployments"]):
        where = f"{path}: deployments[{i}]"
        if not isinstance(item, dict) or not item.get("name") or not item.get("entrypoint"):
            raise InvalidJobSpec(f"{where}: every deployment needs a name and an entrypoint")
        triggers = item.get("triggers") or []
        entries.append(
            DeploymentEntry(
                name=item["name"],
                entrypoint=item["entrypoint"],
                parameters=dict(item.get("parameters") or {}),
                trigger_parameters=tuple(dict(t.get("parameters") or {}) for t in triggers),
                work_pool=(item.get("work_pool") or {}).get("name"),
            )
        )
    return entries


def check_deployments(entries: list[DeploymentEntry], root: str | Path = ".") -> None:
    """Every entrypoint loads as a flow and every parameter given is one of its parameters."""
    from prefect.flows import Flow, load_flow_from_entrypoint

    root = Path(root)
    problems = []
    for entry in entries:
        where = f"deployment {entry.name!r}"
        file, _, function = entry.entrypoint.partition(":")
        if not (root / file).is_file() or not function:
            problems.append(
                f"{where}: entrypoint {entry.entrypoint!r} is not '<file.py>:<flow function>' "
                f"under {root.resolve()} (run from the repository root)"
            )
            continue
        try:
            flow: Flow[..., Any] = load_flow_from_entrypoint(str(root / entry.entrypoint))
        except Exception as exc:  # any import error is the entrypoint's problem
            problems.append(f"{where}: entrypoint {entry.entrypoint!r} does not load: {exc}")
            continue
        accepted = set(inspect.signature(flow.fn).parameters)
        for source, params in [("parameters", entry.parameters)] + [
            (f"triggers[{i}].parameters", p) for i, p in enumerate(entry.trigger_parameters)
        ]:
            unknown = sorted(set(params) - accepted)
            if unknown:
                problems.append(
                    f"{where}: {source} {unknown} are not parameters of {entry.entrypoint} "
                    f"(it takes: {', '.join(sorted(accepted))})"
                )
        # Static values are checked against the flow's types when they make a complete call
        # (trigger values are templates, rendered when the trigger fires).
        if set(entry.parameters) <= accepted and set(entry.parameters) >= _required(flow.fn):
            try:
                flow.validate_parameters(dict(entry.parameters))
            except Exception as exc:
                problems.append(f"{where}: parameters do not validate: {exc}")
    if problems:
        raise InvalidJobSpec("\n".join(problems))


def _required(fn: Any) -> set[str]:
    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def checked_deployments(
    prefect_file: str | Path = DEFAULT_FILE,
    *,
    names: list[str] | None = None,
    root: str | Path = ".",
) -> list[DeploymentEntry]:
    """The deployments to apply (all, or those named), checked; nothing is sent anywhere."""
    entries = read_deployments(prefect_file)
    if names:
        wanted = {n.rsplit("/", 1)[-1] for n in names}
        missing = wanted - {e.name for e in entries}
        if missing:
            raise InvalidJobSpec(
                f"--name: no deployment {sorted(missing)} in {prefect_file}; it has: "
                + ", ".join(e.name for e in entries)
            )
        entries = [e for e in entries if e.name in wanted]
    check_deployments(entries, root)
    return entries


def ensure_work_pools(names: set[str], pool_type: str = DEFAULT_POOL_TYPE) -> list[str]:
    """Create the work pools that do not exist yet (with the worker type's default template)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    created = []
    with get_client(sync_client=True) as client:
        for name in sorted(names):
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                template = ProcessWorker.get_default_base_job_template()
                client.create_work_pool(
                    WorkPoolCreate(name=name, type=pool_type, base_job_template=template)
                )
                created.append(name)
    return created


def deploy(
    prefect_file: str | Path = DEFAULT_FILE,
    *,
    names: list[str] | None = None,
    api_url: str | None = None,
    root: str | Path = ".",
) -> int:
    """Check the file, create missing work pools, run `prefect deploy`; its exit status."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    entries = checked_deployments(prefect_file, names=names, root=root)
    api_url = api_url or str(PREFECT_API_URL.value() or "")
    if not api_url:
        raise InvalidJobSpec("PREFECT_API_URL is not set: point it at the Prefect server")
    with temporary_settings({PREFECT_API_URL: api_url}):
        for pool in ensure_work_pools({e.work_pool for e in entries if e.work_pool}):
            print(f"created work pool {pool!r} (type {DEFAULT_POOL_TYPE})", flush=True)
    command = [
        str(Path(sys.executable).parent / "prefect"),
        "--no-prompt",
        "deploy",
        "--prefect-file",
        str(Path(prefect_file).resolve()),
    ]
    if names:
        for name in names:
            command += ["--name", name]
    else:
        command.append("--all")
    env = dict(os.environ, PREFECT_API_URL=api_url)
    return subprocess.run(command, cwd=root, env=env, stdin=subprocess.DEVNULL).returncode
