"""NeMo-Run tasks (``run.Partial`` / ``run.Script``) as job definitions.

`JobSpec(task=...)` turns a NeMo-Run task into a `NemoTask`: its configuration serialized with
NeMo-Run's own serializer (``ZlibJSONSerializer``, what NeMo-Run's packaging passes to its runner),
checked before anything is submitted (every function importable in the job, the whole
configuration serializable), with each ``SecretStr`` value moved out of the configuration into a
secret env var the configuration reads back in the job. Shell backends run `NemoTask.command`
(NeMo-Run's runner entrypoint, ``python -m nemo_run.core.runners.fdl_runner``); the NeMo-Run
backends hand `NemoTask.build()` to the executor as NeMo-Run would.

nemo_run is imported only through `backends.nemo_run.isolation` (NEMORUN_HOME kept isolated);
nothing here imports Prefect.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import os
import shlex
import sys
import sysconfig
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from prefect_nemo import names

#: What to install for NeMo-Run tasks.
EXTRA = "prefect-nemo[nemo-run]"
#: NeMo-Run's runner entrypoint: it deserializes a task's configuration, builds it and calls it.
RUNNER_MODULE = "nemo_run.core.runners.fdl_runner"
#: Env vars that carry the task's secret values into the job (the configuration reads them).
SECRET_ENV_PREFIX = "PREFECT_NEMO_TASK_SECRET_"


class NemoTask(BaseModel):
    """A NeMo-Run task as data: its kind, what it calls and its serialized configuration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["partial", "script"] = Field(description="run.Partial or run.Script.")
    target: str = Field(description="'module.function' of a Partial; the script's name.")
    config: str = Field(
        description="The configuration, serialized by NeMo-Run's ZlibJSONSerializer (secret "
        "values replaced by reads of secret env vars)."
    )

    @property
    def digest(self) -> str:
        """A short hash of the configuration: the task's identity."""
        return names.stable_hash(self.kind, self.config, length=12)

    @property
    def key(self) -> str:
        """The default job key of this task: its target's last name and its digest."""
        short = names.dns_label(self.target.rsplit(".", 1)[-1], 40)
        return f"{short}-{self.digest}"

    @property
    def run_name(self) -> str:
        """The run name NeMo-Run's runner is given (``-n``)."""
        return names.dns_label(self.target.rsplit(".", 1)[-1], 40)

    def build(self) -> Any:
        """The NeMo-Run object again (a run.Partial, or a run.Script), for a NeMo-Run executor."""
        nemo_run = require_nemo_run()
        import fiddle as fdl
        from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

        config = ZlibJSONSerializer().deserialize(self.config)
        if self.kind == "partial":
            return fdl.cast(nemo_run.Partial, config)
        return fdl.build(config)

    def command(self) -> str:
        """The shell command that runs the task in a job, as NeMo-Run's packaging builds it:
        a Partial through NeMo-Run's runner, a Script as its own command line."""
        if self.kind == "partial":
            return shlex.join(["python", "-m", RUNNER_MODULE, "-n", self.run_name, self.config])
        script = self.build()
        if script.inline:
            return shlex.join([script.entrypoint, "-c", script.inline])
        head = [script.entrypoint] + (["-m"] if script.m else [])
        return shlex.join([*head, script.path, *script.args])


def spec_fields(data: dict[str, Any], max_command: int) -> dict[str, Any]:
    """A JobSpec's fields with its `task` (a NeMo-Run object or a NemoTask) as a NemoTask, its
    command as the entrypoint and its env (a Script's, the secret values) added to the env;
    ValueError naming the field when they clash or the command is too long."""
    task = data["task"]
    task_env: dict[str, str | SecretStr] = {}
    if not isinstance(task, NemoTask | dict):
        try:
            task, task_env = from_object(task, data.get("working_dir"))
        except ValueError as exc:
            raise ValueError(f"JobSpec.task: {exc}") from None
    task = NemoTask.model_validate(task)
    command = task.command()
    if data.get("entrypoint") not in (None, command):
        raise ValueError("JobSpec.entrypoint and JobSpec.task each say what the job runs: keep one")
    if len(command) > max_command:
        raise ValueError(
            f"JobSpec.task {task.target}: its serialized configuration makes a {len(command)} "
            f"character command; the limit is {max_command}: pass large values as files (paths "
            "in working_dir) instead"
        )
    env = dict(data.get("env") or {})
    if clash := sorted(set(task_env) & set(env)):
        raise ValueError(f"JobSpec.env: {clash} are set by the task too: set them once")
    return {**data, "task": task, "entrypoint": command, "env": {**env, **task_env}}


def require_nemo_run() -> Any:
    """The nemo_run module, or an ImportError naming the extra to install. Imported here first,
    it is imported isolated (`isolation.nemo_run`); one the caller imported is used as it is
    (building a task writes no file)."""
    if (module := sys.modules.get("nemo_run")) is not None:
        return module
    try:
        found = importlib.util.find_spec("nemo_run") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(
            f"a NeMo-Run task (run.Partial / run.Script) needs nemo-run: pip install '{EXTRA}'"
        )
    from prefect_nemo.backends.nemo_run.isolation import nemo_run

    return nemo_run()


def is_task_object(value: Any) -> bool:
    """True for an object made with NeMo-Run or fiddle (run.Partial, run.Script, run.Config,
    fdl.Partial), without importing either."""
    module = type(value).__module__ or ""
    return module.split(".")[0] in ("nemo_run", "fiddle")


def from_object(
    value: Any, working_dir: Path | None
) -> tuple[NemoTask, dict[str, str | SecretStr]]:
    """The NemoTask of a run.Partial / run.Script / run.Config (checked: importable in the job,
    serializable) and the env it needs: the secret values its configuration now reads, a
    Script's own env (ValueError naming the task and the reason otherwise)."""
    nemo_run = require_nemo_run()
    import fiddle as fdl
    from fiddle._src.experimental import dataclasses as fdl_dc
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    secrets: dict[str, SecretStr] = {}
    env: dict[str, str | SecretStr] = {}
    if isinstance(value, nemo_run.Script):
        script = copy.deepcopy(value)
        env, script.env = dict(script.env), {}  # the job's env, delivered as every job's is
        kind, target = "script", script.get_name() or "script"
        config = fdl_dc.convert_dataclasses_to_configs(script, allow_post_init=True)
    elif isinstance(value, fdl.Buildable):
        kind, target = "partial", _target(value.__fn_or_cls__)
        config = copy.deepcopy(value)
        if not isinstance(config, fdl.Partial):  # run.Config(fn, ...): built and called alike
            config = fdl.cast(nemo_run.Partial, config)
        config = _secrets_to_env(config, secrets, fdl)
    else:
        raise ValueError(
            f"expected a NeMo-Run task (run.Partial, run.Script or run.Config), got "
            f"{type(value).__name__}"
        )
    where = f"task {target}"
    for fn in _callables(config, fdl) if kind == "partial" else []:
        reason = unimportable(fn, working_dir)
        if reason:
            what = where if _target(fn) == target else f"{where}: {_target(fn)}"
            raise ValueError(f"{what} cannot be imported in the job: {reason}")
    try:
        payload = ZlibJSONSerializer().serialize(config)
        ZlibJSONSerializer().deserialize(payload)
    except Exception as exc:  # fiddle raises several kinds; each says what and where
        reason = str(exc).splitlines()[0][:300]
        raise ValueError(
            f"{where} is not serializable by NeMo-Run's serializer: {reason}. Pass plain values "
            "(numbers, strings, lists, dicts, run.Config of importable classes) and load large "
            "data inside the function"
        ) from None
    return NemoTask(kind=kind, target=target, config=payload), {**env, **secrets}


def home_dir(value: Any) -> Path | None:
    """Where the module of a task's function was imported from when it is a local file (not
    an installed package): the sys.path entry that holds it (a notebook's directory, say), the
    working_dir a bare task is shipped with. None for installed code or a Script."""
    fn = getattr(value, "__fn_or_cls__", None)
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if fn is None or not file or _installed(fn.__module__) or _in_site(Path(file).resolve()):
        return None
    path = Path(file).resolve()
    roots = [Path(p or ".").resolve() for p in sys.path]
    depth = fn.__module__.count(".") + 1 + (path.name == "__init__.py")  # a.b: 2 levels down
    root = path.parents[depth - 1]
    return root if root in roots else None


def unimportable(fn: Any, working_dir: Path | None) -> str | None:
    """Why the job cannot import `fn` by its module and name, or None when it can: its module
    must be installed (so the job's image has it) or shipped in working_dir."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        return "it is defined inside a function or is a lambda: define it at a module's top level"
    if module in ("__main__", "__mp_main__") or module.startswith("__external_main__"):
        return (
            "it is defined in __main__ (a script or a notebook), which the job does not have: "
            "move it into a module under JobSpec.working_dir"
        )
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None)
    if loaded is None or not file:
        return None if _installed(module) else f"module {module} is not importable here"
    path = Path(file).resolve()
    if working_dir is not None and path.is_relative_to(Path(working_dir).resolve()):
        rel = path.relative_to(Path(working_dir).resolve()).with_suffix("")
        shipped = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if shipped != module:
            return (
                f"its module {module} is at {rel} in working_dir, where the job imports it as "
                f"{shipped}: set working_dir to the directory {module} is imported from"
            )
        return None
    if _installed(module) or _in_site(path):
        return None
    root = next((p for p in sys.path if p and path.is_relative_to(Path(p).resolve())), None)
    return (
        f"its module {module} ({path}) is neither an installed package nor under "
        f"JobSpec.working_dir: set working_dir={root or path.parent} to ship it"
    )


def _installed(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in importlib.metadata.packages_distributions()


def _in_site(path: Path) -> bool:
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return any(path.is_relative_to(Path(r).resolve()) for r in roots if r)


def _target(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _callables(config: Any, fdl: Any) -> list[Any]:
    """Every function or class a configuration calls, depth first."""
    found: list[Any] = []

    def visit(value: Any) -> None:
        if isinstance(value, fdl.Buildable):
            found.append(value.__fn_or_cls__)
            for item in value.__arguments__.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(config)
    return found


def _secrets_to_env(config: Any, secrets: dict[str, SecretStr], fdl: Any) -> Any:
    """The configuration with each SecretStr replaced by a configured `SecretStr(os.getenv(NAME))`
    (built in the job: the function still receives a SecretStr), the values put in `secrets`
    under NAME (numbered in visiting order, so the payload stays the same run after run)."""

    def swap(value: Any) -> Any:
        if isinstance(value, SecretStr):
            name = f"{SECRET_ENV_PREFIX}{len(secrets)}"
            secrets[name] = value
            return fdl.Config(SecretStr, fdl.Config(os.getenv, name))
        if isinstance(value, fdl.Buildable):
            for key, item in list(value.__arguments__.items()):
                setattr(value, key, swap(item))
            return value
        if isinstance(value, list | tuple):
            return type(value)(swap(item) for item in value)
        if isinstance(value, dict):
            return {key: swap(item) for key, item in value.items()}
        return value

    return swap(config)
