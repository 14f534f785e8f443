"""Tests for the code archive and its transports (prefect_nemo.packaging; no cluster).

Every round trip runs the real setup command under dash, the way a pod would, and compares
the unpacked tree with the source file by file.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.packaging import (
    DEFAULT_MAX_BYTES,
    SourceArchive,
    TransportPlan,
    TransportTooLarge,
    build_archive,
    collect_source,
    plan_for,
)
from prefect_nemo.packaging import archive as archive_mod

DASH = shutil.which("dash") or "/bin/sh"
MARKER_PREFIX = ".prefect-nemo-"


def write(root: Path, relpath: str, content: str | bytes = "x", *, mode: int = 0o644) -> Path:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    os.chmod(path, mode)
    return path


def file_hashes(root: Path) -> dict[str, tuple[str, bool]]:
    """relpath -> (sha256, owner-executable) of every regular file under root, markers aside."""
    out = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.name.startswith(MARKER_PREFIX):
            rel = path.relative_to(root).as_posix()
            out[rel] = (
                hashlib.sha256(path.read_bytes()).hexdigest(),
                bool(path.stat().st_mode & 0o100),
            )
    return out


def expected_hashes(root: Path, archive: SourceArchive) -> dict[str, tuple[str, bool]]:
    return {
        rel: (
            hashlib.sha256((root / rel).read_bytes()).hexdigest(),
            bool((root / rel).stat().st_mode & 0o100),
        )
        for rel in archive.files
    }


def run_sh(
    command: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DASH, "-c", command],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def materialise(plan: TransportPlan) -> None:
    """Write the ConfigMap parts where the projected volume would put them in the pod."""
    parts = Path(plan.parts_dir)
    parts.mkdir(parents=True, exist_ok=True)
    names = {cm["metadata"]["name"]: cm for cm in plan.configmaps}
    for source in plan.volumes[0]["projected"]["sources"]:
        cm = names[source["configMap"]["name"]]
        for item in source["configMap"]["items"]:
            (parts / item["path"]).write_bytes(base64.b64decode(cm["binaryData"][item["key"]]))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every archive cache and staged tree inside the test's tmp dir."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PREFECT_NEMO_CACHE_DIR", str(path))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    write(root, "pyproject.toml", "[project]\nname = 'demo'\n")
    write(root, "setup.cfg", "[metadata]\n")
    write(root, "train.py", "print('train')\n")
    write(root, "README.md", "docs stay home\n")
    write(root, "mypkg/__init__.py", "")
    write(root, "mypkg/model.py", "W = 1\n")
    write(root, "mypkg/conf/base.yaml", "lr: 0.1\n")
    write(root, "mypkg/run.sh", "#!/bin/sh\necho hi\n", mode=0o755)
    write(root, "mypkg/weights.bin", random.Random(1).randbytes(50_000))
    write(root, "src/core/__init__.py", "")
    write(root, "src/core/recipes/__init__.py", "")
    write(root, "src/core/recipes/README.md", "families\n")
    write(root, "src/core/recipes/llama/pretrain.py", "llama = 1\n")
    write(root, "src/core/recipes/qwen/pretrain.py", "qwen = 1\n")
    write(root, "data/train.bin", b"\0" * 1000)
    write(root, "notebooks/explore.ipynb", "{}")
    write(root, "scripts/launch.py", "print('no __init__ here')\n")
    write(root, "mypkg/__pycache__/model.cpython-311.pyc", b"cache")
    write(root, ".gitignore", "*.log\n")
    write(root, "mypkg/debug.log", "ignored\n")
    return root


# --------------------------------------------------------------------------- archive


def test_include_discovery(project: Path) -> None:
    archive = build_archive(project)
    assert archive.files == (
        "mypkg/__init__.py",
        "mypkg/conf/base.yaml",
        "mypkg/model.py",
        "mypkg/run.sh",
        "mypkg/weights.bin",
        "pyproject.toml",
        "setup.cfg",
        "src/core/__init__.py",
        "src/core/recipes/README.md",
        "src/core/recipes/__init__.py",
        "src/core/recipes/llama/pretrain.py",
        "src/core/recipes/qwen/pretrain.py",
        "train.py",
    )
    with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
        assert tuple(tar.getnames()) == archive.files


def test_include_and_exclude(project: Path) -> None:
    archive = build_archive(project, include=["scripts", "data/train.bin"], exclude=["*.bin"])
    assert "scripts/launch.py" in archive.files
    assert "data/train.bin" not in archive.files  # exclude wins over include
    assert "mypkg/weights.bin" not in archive.files
    assert "mypkg/model.py" in archive.files
    with pytest.raises(InvalidJobSpec, match="does not exist"):
        build_archive(project, include=["nope/"])
    with pytest.raises(InvalidJobSpec, match="relative to the project root"):
        build_archive(project, include=["../outside"])


def test_no_code_is_a_clear_error(tmp_path: Path) -> None:
    write(tmp_path / "p", "data/x.csv", "1,2\n")
    with pytest.raises(InvalidJobSpec, match="holds no Python package"):
        build_archive(tmp_path / "p")


def test_recipe_family(project: Path) -> None:
    files = build_archive(project, recipe_family="llama").files
    assert "src/core/recipes/llama/pretrain.py" in files
    assert "src/core/recipes/__init__.py" in files
    assert "src/core/recipes/README.md" in files
    assert not any("/qwen/" in f for f in files)
    assert "mypkg/model.py" in files
    with pytest.raises(InvalidJobSpec) as info:
        build_archive(project, recipe_family="mistral")
    assert "'llama'" in str(info.value) and "'qwen'" in str(info.value)


def test_recipe_family_at_root(tmp_path: Path) -> None:
    root = tmp_path / "p"
    write(root, "train.py", "")
    write(root, "recipes/llama/a.yaml", "a")
    write(root, "recipes/qwen/b.yaml", "b")
    assert build_archive(root).files == ("train.py",)  # not a package: not shipped by default
    assert build_archive(root, recipe_family="qwen").files == ("recipes/qwen/b.yaml", "train.py")
    write(tmp_path / "flat", "train.py", "")
    with pytest.raises(InvalidJobSpec, match="no 'recipes/' directory"):
        build_archive(tmp_path / "flat", recipe_family="llama")


def test_deterministic_across_runs_paths_and_metadata(project: Path, tmp_path: Path) -> None:
    first = build_archive(project, cache_dir=tmp_path / "c1")
    again = build_archive(project, cache_dir=tmp_path / "c2")
    assert again.data == first.data and again.sha256 == first.sha256

    other = tmp_path / "elsewhere" / "copy"
    shutil.copytree(project, other)
    for path in other.rglob("*"):
        if path.is_file():
            os.utime(path, (1_600_000_000, 1_700_000_000))
            mode = path.stat().st_mode
            os.chmod(path, (mode & 0o100) | 0o600 | (0o070 if mode & 0o100 else 0o044))
            if os.geteuid() == 0:
                os.chown(path, 65534, 65534)
    copied = build_archive(other, cache_dir=tmp_path / "c3")
    assert copied.data == first.data
    assert copied.tree_hash == first.tree_hash

    assert first.data[4:8] == b"\0\0\0\0"  # gzip header mtime
    with tarfile.open(fileobj=io.BytesIO(first.data), mode="r:gz") as tar:
        for member in tar.getmembers():
            assert (member.uid, member.gid, member.uname, member.gname) == (0, 0, "", "")
            assert member.mtime == archive_mod.ARCHIVE_MTIME
            assert member.mode == (0o755 if member.name == "mypkg/run.sh" else 0o644)
    assert hashlib.sha256(first.data).hexdigest() == first.sha256
    assert first.size == len(first.data)


def test_content_and_exec_bit_change_the_hash(project: Path) -> None:
    base = build_archive(project)
    os.chmod(project / "train.py", 0o755)
    executable = build_archive(project)
    assert executable.sha256 != base.sha256
    os.chmod(project / "train.py", 0o644)
    assert build_archive(project).sha256 == base.sha256
    write(project, "train.py", "print('v2')\n")
    assert build_archive(project).sha256 != base.sha256


def test_unchanged_tree_is_not_retarred(
    project: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build_archive(project)
    assert list((cache_dir / "archives").glob("*.tar.gz"))

    def boom(tree: object) -> bytes:
        raise AssertionError("re-tarred an unchanged tree")

    monkeypatch.setattr(archive_mod, "_write_targz", boom)
    assert build_archive(project) == first
    monkeypatch.undo()
    monkeypatch.setenv("PREFECT_NEMO_CACHE_DIR", str(cache_dir))
    # A damaged cache entry is rebuilt, not trusted.
    (data_file,) = (cache_dir / "archives").glob("*.tar.gz")
    flipped = bytes([first.data[100] ^ 1])
    for damaged in (first.data[:-10], first.data[:100] + flipped + first.data[101:]):
        data_file.write_bytes(damaged)
        assert build_archive(project).data == first.data


def test_file_edited_while_packing_is_caught(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = archive_mod.collect_source

    def collect_then_edit(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        tree = real(*args, **kwargs)  # type: ignore[arg-type]
        write(project, "train.py", "print('edited')\n")
        return tree

    monkeypatch.setattr(archive_mod, "collect_source", collect_then_edit)
    with pytest.raises(RuntimeError, match="changed while they were being packed"):
        build_archive(project)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("backend", "chunk_bytes"), [("lepton", None), ("lepton", 4096), ("dgx_cloud", None)]
)
def test_env_chunks_round_trip(
    project: Path, tmp_path: Path, backend: str, chunk_bytes: int | None
) -> None:
    archive = build_archive(project)
    plan = plan_for(backend, archive, name="job", chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
    assert plan.kind == "env_chunks"
    n = plan.chunks
    assert n >= (2 if chunk_bytes else 1)
    assert set(plan.env) == {f"PREFECT_NEMO_CODE_{i}" for i in range(n)} | {
        "PREFECT_NEMO_CODE_CHUNKS",
        "PREFECT_NEMO_CODE_SHA256",
    }
    assert plan.env["PREFECT_NEMO_CODE_CHUNKS"] == str(n)
    assert plan.env["PREFECT_NEMO_CODE_SHA256"] == archive.sha256
    dest = tmp_path / "pod" / "code"
    result = run_sh(plan.setup_command(str(dest)), env=plan.env)
    assert result.returncode == 0, result.stderr
    assert file_hashes(dest) == expected_hashes(project, archive)


def test_configmaps_round_trip(project: Path, tmp_path: Path) -> None:
    archive = build_archive(project)
    plan = plan_for(
        "kubernetes", archive, name="SFT Job", chunk_bytes=10_000, parts_dir=str(tmp_path / "parts")
    )
    assert plan.kind == "configmaps" and plan.chunks == len(plan.configmaps) > 2
    materialise(plan)
    dest = tmp_path / "pod" / "code"
    result = run_sh(plan.setup_command(str(dest)))
    assert result.returncode == 0, result.stderr
    assert file_hashes(dest) == expected_hashes(project, archive)


def test_configmap_manifests(project: Path) -> None:
    archive = build_archive(project)
    plan = plan_for("kubernetes", archive, name="My_Experiment/SFT " * 5, chunk_bytes=10_000)
    names = [cm["metadata"]["name"] for cm in plan.configmaps]
    assert len(set(names)) == len(names)
    for index, cm in enumerate(plan.configmaps):
        name = cm["metadata"]["name"]
        assert len(name) <= 63 and name.endswith(f"-{index}") and archive.sha256[:10] in name
        assert name.replace("-", "").isalnum() and name == name.lower() and name[0].isalpha()
        assert cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "prefect-nemo"
        assert "namespace" not in cm["metadata"]
        assert cm["immutable"] is True
    sources = plan.volumes[0]["projected"]["sources"]
    assert [s["configMap"]["name"] for s in sources] == names
    assert plan.volume_mounts == [
        {"name": plan.volumes[0]["name"], "mountPath": "/prefect-nemo/code-parts", "readOnly": True}
    ]
    joined = b"".join(
        base64.b64decode(next(iter(cm["binaryData"].values()))) for cm in plan.configmaps
    )
    assert joined == archive.data


def test_ray_and_native_plans(project: Path, cache_dir: Path) -> None:
    archive = build_archive(project)
    ray = plan_for("ray", archive, name="job")
    assert ray.kind == "ray_working_dir" and ray.working_dir is not None
    assert ray.working_dir.parent == cache_dir.resolve()
    assert file_hashes(ray.working_dir) == expected_hashes(project, archive)
    assert collect_source(ray.working_dir).digest == archive.tree_hash
    assert plan_for("ray", archive, name="job").working_dir == ray.working_dir
    native = plan_for("slurm", archive, name="job")
    assert (native.kind, native.chunks, native.env, native.configmaps) == ("native", 0, {}, [])
    for plan in (ray, native):
        with pytest.raises(ValueError, match="needs no setup command"):
            plan.setup_command()
    with pytest.raises(InvalidJobSpec, match="no code transport"):
        plan_for("docker", archive, name="job")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- limits


def big_project(tmp_path: Path, nbytes: int) -> Path:
    root = tmp_path / "big"
    write(root, "pkg/__init__.py", "")
    write(root, "pkg/blob.bin", random.Random(7).randbytes(nbytes))  # incompressible
    return root


def test_env_chunks_fit_service_limits(tmp_path: Path) -> None:
    archive = build_archive(big_project(tmp_path, 700_000))
    lepton = plan_for("lepton", archive, name="job")
    dgx = plan_for("dgx_cloud", archive, name="job")
    assert lepton.chunks > 1 and dgx.chunks > 50
    for name, value in lepton.env.items():
        assert len(f"{name}={value}".encode()) < 128 * 1024  # MAX_ARG_STRLEN, NUL included
    assert max(len(v) for v in lepton.env.values()) == 96 * 1024
    assert max(len(v) for v in dgx.env.values()) <= 9 * 1024 < 10_000
    # Both really pass through execve and reassemble.
    for plan in (lepton, dgx):
        dest = tmp_path / plan.kind / str(plan.chunks)
        result = run_sh(plan.setup_command(str(dest)), env=plan.env)
        assert result.returncode == 0, result.stderr
        assert (dest / "pkg/blob.bin").read_bytes() == (tmp_path / "big/pkg/blob.bin").read_bytes()


@pytest.mark.parametrize(
    ("backend", "chunk_bytes"),
    [("lepton", 128 * 1024), ("dgx_cloud", 10_001), ("kubernetes", 1024 * 1024), ("lepton", 0)],
)
def test_chunk_over_service_limit_rejected(project: Path, backend: str, chunk_bytes: int) -> None:
    with pytest.raises(InvalidJobSpec, match="chunk_bytes"):
        plan_for(backend, build_archive(project), name="j", chunk_bytes=chunk_bytes)  # type: ignore[arg-type]


def test_configmaps_fit_the_api_server(tmp_path: Path) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    archive = build_archive(big_project(tmp_path, 2_500_000))
    plan = plan_for("kubernetes", archive, name="sft-job")
    assert plan.chunks == 3
    with LoopbackKubeServer([crd_dir()], namespaces=("default",)) as server:
        core = client.CoreV1Api(server.api_client())
        for cm in plan.configmaps:
            core.create_namespaced_config_map("default", cm)
        stored = core.list_namespaced_config_map(
            "default", label_selector="app.kubernetes.io/managed-by=prefect-nemo"
        )
        assert len(stored.items) == 3
        # The limit is real: one byte past 1 MiB is refused.
        over = {
            "metadata": {"name": "over"},
            "binaryData": {"k": base64.b64encode(b"\0" * (1024 * 1024)).decode()},
        }
        with pytest.raises(ApiException) as info:
            core.create_namespaced_config_map("default", over)
        assert info.value.status == 422


def test_oversize_payload_is_a_clear_error(tmp_path: Path) -> None:
    archive = build_archive(big_project(tmp_path, 9 * 1024 * 1024))
    assert archive.size > DEFAULT_MAX_BYTES["kubernetes"]
    with pytest.raises(TransportTooLarge) as info:
        plan_for("kubernetes", archive, name="job")
    message = str(info.value)
    assert isinstance(info.value, InvalidJobSpec)
    assert "max_bytes=8388608" in message and "8.0 MiB" in message
    assert "pkg/blob.bin" in message
    for fix in ("exclude=", "recipe_family=", "image"):
        assert fix in message
    with pytest.raises(TransportTooLarge, match="max_bytes=1000"):
        plan_for("lepton", archive, name="job", max_bytes=1000)
    assert plan_for("kubernetes", archive, name="job", max_bytes=10 * 1024 * 1024).chunks == 10


def test_setup_command_is_short_and_never_embeds_the_payload(tmp_path: Path) -> None:
    archive = build_archive(big_project(tmp_path, 700_000))
    for plan in (
        plan_for("lepton", archive, name="j"),
        plan_for("dgx_cloud", archive, name="j"),
        plan_for("kubernetes", archive, name="j", chunk_bytes=1000),
    ):
        for shared in (False, True):
            command = plan.setup_command("/workspace/code", shared=shared)
            assert len(command) < 1500, (plan.kind, shared, len(command))
            assert all(value not in command for value in list(plan.env.values())[:-2])


# --------------------------------------------------------------------------- failures


def test_bad_checksum_fails(project: Path, tmp_path: Path) -> None:
    plan = plan_for("lepton", build_archive(project), name="j", chunk_bytes=2048)
    command = plan.setup_command(str(tmp_path / "code"))
    corrupted = dict(plan.env)
    value = corrupted["PREFECT_NEMO_CODE_1"]
    corrupted["PREFECT_NEMO_CODE_1"] = ("A" if value[0] != "A" else "B") + value[1:]
    missing = {k: v for k, v in plan.env.items() if k != "PREFECT_NEMO_CODE_1"}
    for env in (corrupted, missing):
        result = run_sh(command, env=env)
        assert result.returncode != 0
        assert f"expected {plan.sha256}" in result.stderr
        assert not any((tmp_path / "code").iterdir())


def test_bad_configmap_part_fails(project: Path, tmp_path: Path) -> None:
    plan = plan_for(
        "kubernetes",
        build_archive(project),
        name="j",
        chunk_bytes=5000,
        parts_dir=str(tmp_path / "parts"),
    )
    materialise(plan)
    part = tmp_path / "parts" / "part-00001"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    result = run_sh(plan.setup_command(str(tmp_path / "code"), shared=True))
    assert result.returncode == 1
    assert "sha256" in result.stderr and "could not unpack" in result.stderr
    assert not (tmp_path / "code").exists()
    assert not list(tmp_path.glob("code.part.*"))  # the temp dir is cleaned up


def test_tar_error_fails(tmp_path: Path) -> None:
    data = b"this is not a gzip stream"
    bogus = SourceArchive(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        files=(),
        tree_hash="0" * 64,
    )
    plan = plan_for("dgx_cloud", bogus, name="j")
    for shared in (False, True):
        result = run_sh(
            plan.setup_command(str(tmp_path / f"code{shared}"), shared=shared), env=plan.env
        )
        assert result.returncode != 0, shared
        assert "gzip" in result.stderr or "tar" in result.stderr


# --------------------------------------------------------------------------- shared path


VERIFY = """
import hashlib, json, os, sys
dest, expected = sys.argv[1], json.load(open(sys.argv[2]))
seen = {}
for base, dirs, files in os.walk(dest):
    for name in files:
        if name.startswith(".prefect-nemo-"):
            continue
        path = os.path.join(base, name)
        seen[os.path.relpath(path, dest)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
if seen != expected:
    sys.exit("partial or wrong tree: %d of %d files" % (len(seen), len(expected)))
"""


def many_files_project(tmp_path: Path) -> Path:
    root = tmp_path / "many"
    rng = random.Random(3)
    write(root, "pkg/__init__.py", "")
    for i in range(400):
        write(root, f"pkg/m{i // 50}/f{i}.py", f"X = {rng.random()!r}\n" * rng.randint(10, 400))
    write(root, "pkg/blob.bin", rng.randbytes(3_000_000))
    return root


@pytest.mark.parametrize("rank0_delay_s", [0.0, 0.7])
def test_node_rank_race_on_shared_path(tmp_path: Path, rank0_delay_s: float) -> None:
    root = many_files_project(tmp_path)
    archive = build_archive(root)
    plan = plan_for("kubernetes", archive, name="race", parts_dir=str(tmp_path / "parts"))
    assert plan.chunks >= 2
    materialise(plan)
    shared = tmp_path / "nfs" / "code"
    write(shared, "stale_from_old_version.py", "old")  # a previous run's tree is replaced
    expected = {rel: sha for rel, (sha, _) in expected_hashes(root, archive).items()}
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    (tmp_path / "verify.py").write_text(VERIFY)
    command = (
        plan.setup_command(str(shared), shared=True, wait_timeout_s=60)
        + f" && python3 {tmp_path / 'verify.py'} {shared} {tmp_path / 'expected.json'}"
    )

    def start(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [DASH, "-c", command],
            env={**os.environ, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [start(rank) for rank in range(1, 8)]
    time.sleep(rank0_delay_s)
    procs.insert(0, start(0))
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    assert [rc for rc, _ in results] == [0] * 8, results
    assert file_hashes(shared) == expected_hashes(root, archive)
    assert (shared / plan.marker_name).exists()
    assert sorted(p.name for p in shared.parent.iterdir()) == ["code"]  # no temp or old dirs


def test_shared_rerun_reuses_the_tree(project: Path, tmp_path: Path) -> None:
    plan = plan_for("lepton", build_archive(project), name="j")
    dest = tmp_path / "nfs with 'quotes' $HOME" / "code"
    command = plan.setup_command(str(dest), shared=True)
    assert run_sh(command, env={**plan.env, "NODE_RANK": "0"}).returncode == 0
    (dest / "written_by_the_job").write_text("kept")
    assert run_sh(command, env={**plan.env, "NODE_RANK": "0"}).returncode == 0
    assert (dest / "written_by_the_job").exists()  # marker present: not unpacked again
    assert run_sh(command, env={**plan.env, "NODE_RANK": "5"}).returncode == 0


def test_waiting_rank_times_out_clearly(project: Path, tmp_path: Path) -> None:
    plan = plan_for("dgx_cloud", build_archive(project), name="j")
    dest = tmp_path / "nfs" / "code"
    started = time.monotonic()
    result = run_sh(
        plan.setup_command(str(dest), shared=True, wait_timeout_s=1, rank_env="PET_NODE_RANK"),
        env={**plan.env, "PET_NODE_RANK": "3"},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert "PET_NODE_RANK=3 gave up after 1s waiting for" in result.stderr
    assert plan.marker_name in result.stderr
    assert elapsed < 5
    assert not dest.exists()


def test_setup_command_validates_its_arguments(project: Path) -> None:
    plan = plan_for("lepton", build_archive(project), name="j")
    with pytest.raises(ValueError):
        plan.setup_command("/")
    with pytest.raises(ValueError):
        plan.setup_command("/x", shared=True, rank_env="NODE RANK; rm -rf /")
    with pytest.raises(InvalidJobSpec, match="parts_dir"):
        plan_for("kubernetes", build_archive(project), name="j", parts_dir='/a"b')
    with pytest.raises(InvalidJobSpec, match="parts_dir"):
        plan_for("kubernetes", build_archive(project), name="j", parts_dir="relative")
