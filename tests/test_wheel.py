"""The package as pip installs it: the wheel's requirements, its demo, and the testing kit's
import check (the extra it needs is named, not a random failure deep inside)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from prefect_nemo.testing import _MODULES, REQUIRES
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
JOBS = "prefect_nemo/demo/jobs"
CRDS = "prefect_nemo/testing/crds"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """prefect-nemo's wheel, built from a copy of the sources (no build/ left in the repo)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "prefect_nemo", src / "prefect_nemo",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist),
                    str(src)], check=True, timeout=300)
    (built,) = dist.glob("prefect_nemo-*.whl")
    return built


def _metadata(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(zf.read(name).decode())
    return [Requirement(line) for line in message.get_all("Requires-Dist") or []]


@pytest.mark.slow
def test_core_requires_none_of_the_testing_kits_packages(wheel: Path):
    requires = _metadata(wheel)
    core = {r.name for r in requires if r.marker is None}
    assert "prefect" in core and "ray" in core
    assert not core & set(REQUIRES), "the testing kit's packages are core requirements"
    for req in requires:
        if req.name in REQUIRES:
            assert str(req.marker) == 'extra == "testing"', req
    testing = {r.name for r in requires if r.marker and r.marker.evaluate({"extra": "testing"})}
    assert testing == set(REQUIRES), "the extra and the kit's import check name the same packages"


@pytest.mark.slow
def test_wheel_ships_the_demo_and_its_job_scripts(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "prefect_nemo/demo/pipeline.py" in names
    jobs = {n for n in names if n.startswith(f"{JOBS}/")}
    local = {f"{JOBS}/{p.name}" for p in (ROOT / JOBS).glob("*.py")}
    assert jobs == local and len(jobs) == 6


@pytest.mark.slow
def test_wheel_ships_the_testing_kits_crds_with_their_sources(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    shipped = {n for n in names if n.startswith(f"{CRDS}/")}
    local = {f"{CRDS}/{p.relative_to(ROOT / CRDS).as_posix()}"
             for p in (ROOT / CRDS).rglob("*") if p.is_file()}  # fmt: skip
    assert shipped == local and f"{CRDS}/SOURCES.md" in shipped and len(shipped) >= 19


@pytest.mark.slow
def test_wheel_is_typed(wheel: Path):
    """PEP 561: the py.typed marker ships, so type checkers read the package's own annotations."""
    with zipfile.ZipFile(wheel) as zf:
        assert "prefect_nemo/py.typed" in zf.namelist()


def _import_testing_without(*blocked: str) -> subprocess.CompletedProcess[str]:
    """`import prefect_nemo.testing` in a fresh interpreter where the distributions `blocked`
    cannot be imported (blocked by the module each is imported as: cel for
    common-expression-language)."""
    modules = tuple(_MODULES.get(name, name) for name in blocked)
    code = (
        "import sys\n"
        f"for name in {modules!r}:\n"
        "    sys.modules[name] = None  # what an uninstalled package looks like to import\n"
        "import prefect_nemo.testing\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("blocked", [REQUIRES, ("cryptography",)])
def test_testing_kit_without_its_extra_names_the_extra(blocked: tuple[str, ...]):
    result = _import_testing_without(*blocked)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: prefect_nemo.testing needs "), result.stderr[-2000:]
    assert "pip install 'prefect-nemo[testing]'" in last
    assert all(name in last for name in blocked)


# -- `prefect-nemo demo` from the wheel, installed in a fresh venv, run outside the repo ----------


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its demo and testing extras, pinned like `make install`
    pins (and installed the same way, by uv: pip took ~40 s of the 2-core CI's CPU resolving and
    unpacking Ray and Prefect; uv links them from its cache). uv compiles nothing: the venv's
    processes compile only what they import (_outside_repo lets them cache it)."""
    env_dir = tmp_path_factory.mktemp("wheel-venv")
    venv.create(env_dir, with_pip=False)
    uv = Path(sys.executable).parent / "uv"  # `make install` puts it next to the interpreter
    subprocess.run(
        [str(uv), "pip", "install", "--quiet", "--python", str(env_dir / "bin/python"),
         "-c", str(ROOT / "constraints/core.txt"), f"{wheel}[demo,testing]"],
        check=True, timeout=600, env=_outside_repo(dict(os.environ)),
    )
    return env_dir


def _outside_repo(env: dict[str, str]) -> dict[str, str]:
    """env without what would point the venv at the repo's code or at another Ray cluster."""
    for var in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS",
                "PYTHONDONTWRITEBYTECODE"):
        env.pop(var, None)
    return env


def _processes_of(env_dir: Path) -> set[int]:
    """Live sessions' members started from env_dir (the CLI, its Ray head and Ray's workers)."""
    sessions = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(env_dir).encode() in (proc / "cmdline").read_bytes():
                sessions.add(os.getsid(int(proc.name)))
        except OSError:
            continue
    sessions.discard(os.getsid(0))  # never pytest's own
    members = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and os.getsid(int(proc.name)) in sessions:
                members.add(int(proc.name))
        except (OSError, IndexError):
            continue
    return members


@pytest.fixture
def run_outside_repo(installed: Path, tmp_path: Path) -> Iterator[Path]:
    """A working directory outside the repo; whatever the venv started is killed afterwards."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    yield cwd
    for pid in _processes_of(installed):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(900)  # with the fresh venv's install
def test_demo_runs_from_the_installed_wheel(installed: Path, run_outside_repo: Path,
                                            prefect_api: str):
    """`prefect-nemo demo` as a pip user runs it: a fresh embedded Ray cluster, the session's
    Prefect API (so it starts no server), nothing of the repo importable."""
    env = _outside_repo(subprocess_env(prefect_api))
    where = subprocess.run(
        [str(installed / "bin/python"), "-c", "import prefect_nemo; print(prefect_nemo.__file__)"],
        cwd=run_outside_repo, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
    assert Path(where).is_relative_to(installed), f"imported {where}, not the installed wheel"

    cli = subprocess.Popen(
        [str(installed / "bin/prefect-nemo"), "demo", "--run-dir", str(run_outside_repo / "run")],
        cwd=run_outside_repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        out, err = cli.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        cli.send_signal(signal.SIGINT)  # the CLI stops its Ray cluster on the way out
        out, err = cli.communicate(timeout=60)
        pytest.fail(f"prefect-nemo demo did not finish in 420 s:\n{out[-3000:]}{err[-3000:]}")
    assert cli.returncode == 0, out[-3000:] + err[-3000:]
    assert "demo pipeline finished" in out
    assert out.count("SUCCEEDED") == 9, out[-4000:]
    assert "/runs/flow-run/" in out
    metrics = dict(re.findall(r"(accuracy|train_loss)=([\d.]+)", out))
    assert float(metrics["accuracy"]) > 0.8, "the trained model learned something"
    assert float(metrics["train_loss"]) < 0.5
    assert "stopped the local Ray cluster" in out
    assert _processes_of(installed) == set(), "the demo left processes running"
    assert not (run_outside_repo / ".prefect-nemo").exists(), "it started its own Prefect server"


@pytest.mark.slow
def test_the_installed_testing_kit_serves_its_crds(installed: Path, run_outside_repo: Path):
    """`pip install 'prefect-nemo[testing]'` alone: the loopback API server starts with the CRDs
    inside the installed package and validates a RayJob against them (no repository, no
    PREFECT_NEMO_CRDS)."""
    code = (
        "import kubernetes, prefect_nemo.testing.kube_api as k\n"
        "from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir\n"
        "print(crd_dir())\n"
        "with LoopbackKubeServer(crds=[crd_dir()]) as s:\n"
        "    api = kubernetes.client.CustomObjectsApi(s.api_client())\n"
        "    job = {'apiVersion': 'ray.io/v1', 'kind': 'RayJob', 'metadata': {'name': 'a'},\n"
        "           'spec': {'entrypoint': 'true', 'shutdownAfterJobFinishes': 'yes'}}\n"
        "    try:\n"
        "        api.create_namespaced_custom_object('ray.io', 'v1', 'default', 'rayjobs', job)\n"
        "    except kubernetes.client.ApiException as exc:\n"
        "        print('refused', exc.status)\n"
    )
    env = _outside_repo(dict(os.environ))
    env.pop("PREFECT_NEMO_CRDS", None)
    out = subprocess.run([str(installed / "bin/python"), "-c", code], cwd=run_outside_repo,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    where, verdict = out.stdout.split()[0], out.stdout.split("\n")[1]
    assert Path(where).is_relative_to(installed), f"CRDs from {where}, not the installed wheel"
    assert verdict == "refused 422", "the schema (shutdownAfterJobFinishes: boolean) was enforced"
