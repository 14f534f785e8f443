"""Tests for prefect_nemo.packaging (no prefect, no ray)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
from pathlib import Path

import pytest

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.packaging import SourceTree, collect_source, stage_source

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes and symlinks")


def write(
    root: Path, relpath: str, content: str | bytes = "x", *, executable: bool = False
) -> Path:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    os.chmod(path, 0o755 if executable else 0o644)
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    write(root, "train.py", "print('train')\n")
    write(root, "run.sh", "#!/bin/sh\necho hi\n", executable=True)
    write(root, "pkg/__init__.py", "")
    write(root, "pkg/model.py", "class Model: ...\n")
    write(root, "configs/base.yaml", "lr: 0.1\n")
    return root


# --------------------------------------------------------------------------- digest


def test_collect_basic_fields(project: Path) -> None:
    tree = collect_source(project)
    assert isinstance(tree, SourceTree)
    assert tree.root == project.resolve()
    assert tree.root.is_absolute()
    assert tree.files == (
        "configs/base.yaml",
        "pkg/__init__.py",
        "pkg/model.py",
        "run.sh",
        "train.py",
    )
    assert tree.files == tuple(sorted(tree.files))
    assert tree.total_bytes == sum((project / f).stat().st_size for f in tree.files)
    assert len(tree.digest) == 64
    int(tree.digest, 16)


def test_accepts_str_root(project: Path) -> None:
    assert collect_source(str(project)) == collect_source(project)


def test_same_tree_same_digest(project: Path) -> None:
    assert collect_source(project).digest == collect_source(project).digest


def test_digest_independent_of_location(project: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(project, copy)  # copy2 keeps modes
    a, b = collect_source(project), collect_source(copy)
    assert a.digest == b.digest
    assert a.files == b.files
    assert a.root != b.root


def test_content_change_changes_digest(project: Path) -> None:
    before = collect_source(project).digest
    write(project, "pkg/model.py", "class Model: pass\n")
    assert collect_source(project).digest != before


@posix_only
def test_exec_bit_change_changes_digest(project: Path) -> None:
    before = collect_source(project).digest
    os.chmod(project / "train.py", 0o755)
    after = collect_source(project).digest
    assert after != before
    os.chmod(project / "train.py", 0o644)
    assert collect_source(project).digest == before


def test_rename_changes_digest(project: Path) -> None:
    before = collect_source(project)
    (project / "train.py").rename(project / "train2.py")
    after = collect_source(project)
    assert after.digest != before.digest
    assert after.total_bytes == before.total_bytes


def test_moving_bytes_between_files_changes_digest(tmp_path: Path) -> None:
    a = tmp_path / "a"
    write(a, "x", "ab")
    write(a, "y", "c")
    b = tmp_path / "b"
    write(b, "x", "a")
    write(b, "y", "bc")
    assert collect_source(a).digest != collect_source(b).digest


def test_large_file_streamed(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)
    write(tmp_path, "blob.bin", data)
    tree = collect_source(tmp_path)
    assert tree.total_bytes == len(data)
    write(tmp_path, "blob.bin", data[:-1] + bytes([data[-1] ^ 1]))
    assert collect_source(tmp_path).digest != tree.digest


# --------------------------------------------------------------------------- filtering


def test_root_gitignore(project: Path) -> None:
    write(project, ".gitignore", "*.log\n# comment\n\n/outputs\n")
    write(project, "train.log")
    write(project, "pkg/debug.log")
    write(project, "outputs/ckpt.pt")
    write(project, "pkg/outputs/kept.txt")  # /outputs is anchored to the root
    files = collect_source(project).files
    assert ".gitignore" in files
    assert "train.log" not in files
    assert "pkg/debug.log" not in files
    assert "outputs/ckpt.pt" not in files
    assert "pkg/outputs/kept.txt" in files


def test_negation(project: Path) -> None:
    write(project, ".gitignore", "*.log\n!keep.log\n")
    write(project, "drop.log")
    write(project, "keep.log")
    write(project, "sub/keep.log")
    files = collect_source(project).files
    assert "drop.log" not in files
    assert "keep.log" in files
    assert "sub/keep.log" in files


def test_dir_only_pattern(project: Path) -> None:
    write(project, ".gitignore", "build/\n")
    write(project, "build/lib/x.py")
    write(project, "pkg/build/y.py")
    write(project, "docs/build", "a file, not a dir")
    files = collect_source(project).files
    assert not any(f.startswith("build/") for f in files)
    assert "pkg/build/y.py" not in files
    assert "docs/build" in files  # dir-only pattern must not drop a file


def test_cannot_reinclude_inside_ignored_dir(project: Path) -> None:
    write(project, ".gitignore", "data/\n!data/keep.txt\n")
    write(project, "data/keep.txt")
    assert "data/keep.txt" not in collect_source(project).files


def test_reinclude_inside_dir_contents_pattern(project: Path) -> None:
    write(project, ".gitignore", "out/*\n!out/keep.txt\n")
    write(project, "out/drop.txt")
    write(project, "out/keep.txt")
    files = collect_source(project).files
    assert "out/keep.txt" in files
    assert "out/drop.txt" not in files


def test_nested_gitignore(project: Path) -> None:
    write(project, ".gitignore", "*.tmp\n")
    write(project, "pkg/.gitignore", "local.yaml\n/generated\n!special.tmp\n")
    write(project, "local.yaml")  # nested file only applies below pkg/
    write(project, "pkg/local.yaml")
    write(project, "pkg/deep/local.yaml")
    write(project, "pkg/generated/a.py")
    write(project, "pkg/deep/generated/b.py")  # anchored to pkg/, so kept
    write(project, "a.tmp")
    write(project, "pkg/special.tmp")  # nested negation overrides root pattern
    write(project, "special.tmp")
    files = collect_source(project).files
    assert "local.yaml" in files
    assert "pkg/local.yaml" not in files
    assert "pkg/deep/local.yaml" not in files
    assert "pkg/generated/a.py" not in files
    assert "pkg/deep/generated/b.py" in files
    assert "a.tmp" not in files
    assert "pkg/special.tmp" in files
    assert "special.tmp" not in files
    assert "pkg/.gitignore" in files


def test_gitignore_in_ignored_dir_is_not_read(project: Path) -> None:
    write(project, ".gitignore", "vendor/\n")
    write(project, "vendor/.gitignore", "!*\n")
    write(project, "vendor/lib.py")
    assert not any(f.startswith("vendor/") for f in collect_source(project).files)


def test_always_dropped(project: Path) -> None:
    dropped = [
        ".git/HEAD",
        ".git/objects/ab/cdef",
        "pkg/__pycache__/model.cpython-311.pyc",
        "stale.pyc",
        "pkg/stale.pyo",
        ".DS_Store",
        "pkg/.DS_Store",
        ".venv/bin/python",
        ".pytest_cache/v/cache",
        ".mypy_cache/3.11/x.json",
        "pkg/.ruff_cache/0.1/y",
    ]
    for rel in dropped:
        write(project, rel)
    # A .gitignore negation cannot bring them back.
    write(project, ".gitignore", "!*.pyc\n!.venv/\n")
    before = collect_source(project)
    for rel in dropped:
        assert rel not in before.files
    assert ".gitignore" in before.files
    # And they do not influence the digest.
    for rel in dropped:
        write(project, rel, "changed")
    assert collect_source(project).digest == before.digest


def test_git_file_dropped(project: Path) -> None:
    write(project, ".git", "gitdir: ../.git/modules/x\n")  # submodule / worktree
    assert ".git" not in collect_source(project).files


def test_exclude_patterns(project: Path) -> None:
    write(project, "data/big.bin")
    write(project, "notes.md")
    write(project, "pkg/notes.md")
    write(project, "configs/secret.yaml")
    tree = collect_source(project, exclude=["data/", "*.md", "/configs/secret.yaml"])
    assert "data/big.bin" not in tree.files
    assert "notes.md" not in tree.files
    assert "pkg/notes.md" not in tree.files
    assert "configs/secret.yaml" not in tree.files
    assert "configs/base.yaml" in tree.files
    assert tree.digest != collect_source(project).digest


def test_exclude_not_undone_by_gitignore_negation(project: Path) -> None:
    write(project, ".gitignore", "!notes.md\n")
    write(project, "notes.md")
    assert "notes.md" not in collect_source(project, exclude=["*.md"]).files


def test_ignored_dirs_are_pruned(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(project, ".gitignore", "huge/\n")
    for i in range(3):
        write(project, f"huge/sub{i}/f.txt")
    write(project, ".venv/lib/site.py")
    scanned: list[str] = []
    real_scandir = os.scandir

    def spy(path: str | os.PathLike[str]) -> object:
        scanned.append(Path(path).name)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", spy)
    collect_source(project)
    assert "huge" not in scanned
    assert not any(name.startswith("sub") for name in scanned)
    assert ".venv" not in scanned
    assert "pkg" in scanned


# --------------------------------------------------------------------------- symlinks


@posix_only
def test_symlink_inside_root_is_followed(project: Path) -> None:
    (project / "link.py").symlink_to("pkg/model.py")
    tree = collect_source(project)
    assert "link.py" in tree.files
    assert tree.total_bytes == 2 * (project / "pkg/model.py").stat().st_size + sum(
        (project / f).stat().st_size for f in tree.files if f not in ("link.py", "pkg/model.py")
    )


@posix_only
def test_symlink_escaping_root_is_skipped(project: Path, tmp_path: Path) -> None:
    outside = write(tmp_path, "outside/secret.txt", "secret")
    (project / "escape.txt").symlink_to(outside)
    (project / "pkg" / "escape_rel.txt").symlink_to(Path("..") / ".." / "outside" / "secret.txt")
    (project / "dangling.txt").symlink_to(project / "nope.txt")
    files = collect_source(project).files
    assert "escape.txt" not in files
    assert "pkg/escape_rel.txt" not in files
    assert "dangling.txt" not in files


@posix_only
def test_symlinked_dirs_not_descended(project: Path, tmp_path: Path) -> None:
    write(tmp_path, "outside/lib/mod.py")
    (project / "ext").symlink_to(tmp_path / "outside" / "lib", target_is_directory=True)
    (project / "pkg_alias").symlink_to(project / "pkg", target_is_directory=True)
    (project / "loop").symlink_to(project, target_is_directory=True)
    files = collect_source(project).files
    assert not any(f.startswith(("ext/", "pkg_alias", "loop")) for f in files)
    assert "pkg/model.py" in files


@posix_only
def test_special_files_skipped(project: Path) -> None:
    os.mkfifo(project / "pipe")
    assert "pipe" not in collect_source(project).files


# --------------------------------------------------------------------------- errors


def test_missing_root(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(InvalidJobSpec) as info:
        collect_source(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "does not exist" in message
    assert "pass the directory that holds your job code" in message
    assert isinstance(info.value, ValueError)


def test_root_is_a_file(tmp_path: Path) -> None:
    f = write(tmp_path, "file.py")
    with pytest.raises(InvalidJobSpec, match="not a directory"):
        collect_source(f)


def test_empty_tree(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidJobSpec, match="contains no files"):
        collect_source(tmp_path / "empty")


def test_empty_after_filtering(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "__pycache__/a.pyc")
    write(root, "x.log")
    with pytest.raises(InvalidJobSpec) as info:
        collect_source(root, exclude=["*.log"])
    assert str(root.resolve()) in str(info.value)
    assert "*.log" in str(info.value)


# --------------------------------------------------------------------------- staging


def test_stage_preserves_content_and_exec_bit(project: Path, tmp_path: Path) -> None:
    tree = collect_source(project)
    staged = stage_source(tree, tmp_path / "cache")
    assert staged == (tmp_path / "cache").resolve() / tree.digest[:20]
    assert staged.is_dir()
    staged_files = sorted(
        p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()
    )
    assert tuple(staged_files) == tree.files
    for rel in tree.files:
        assert (staged / rel).read_bytes() == (project / rel).read_bytes()
    if sys.platform != "win32":
        assert (staged / "run.sh").stat().st_mode & stat.S_IXUSR
        assert not (staged / "train.py").stat().st_mode & stat.S_IXUSR
    # The staged copy is itself the same tree.
    assert collect_source(staged).digest == tree.digest
    # No temp dirs left behind.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [staged.name]


def test_stage_is_idempotent(project: Path, tmp_path: Path) -> None:
    tree = collect_source(project)
    first = stage_source(tree, tmp_path / "cache")
    marker = first / "train.py"
    old = marker.stat().st_mtime_ns - 10_000_000_000
    os.utime(marker, ns=(old, old))
    dir_mtime = first.stat().st_mtime_ns
    second = stage_source(collect_source(project), tmp_path / "cache")
    assert second == first
    assert marker.stat().st_mtime_ns == old
    assert first.stat().st_mtime_ns == dir_mtime


def test_stage_new_digest_new_dir(project: Path, tmp_path: Path) -> None:
    a = stage_source(collect_source(project), tmp_path / "cache")
    write(project, "train.py", "print('v2')\n")
    b = stage_source(collect_source(project), tmp_path / "cache")
    assert a != b
    assert (b / "train.py").read_text() == "print('v2')\n"
    assert (a / "train.py").read_text() == "print('train')\n"


def test_stage_default_cache_dir_env(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_NEMO_CACHE_DIR", str(tmp_path / "envcache"))
    tree = collect_source(project)
    assert stage_source(tree) == (tmp_path / "envcache").resolve() / tree.digest[:20]


def test_stage_default_cache_dir_home(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_NEMO_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tree = collect_source(project)
    expected = (tmp_path / "home" / ".cache" / "prefect-nemo" / "source").resolve()
    assert stage_source(tree) == expected / tree.digest[:20]


def test_stage_losing_race_uses_winner(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = collect_source(project)
    cache = tmp_path / "cache"
    real_rename = os.rename

    def rename_after_winner(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # Another process finishes first, between our check and our rename.
        monkeypatch.setattr(os, "rename", real_rename)
        winner = stage_source(tree, cache)
        (winner / "WINNER").write_text("")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_after_winner)
    staged = stage_source(tree, cache)
    assert (staged / "WINNER").exists()
    assert [p.name for p in cache.iterdir()] == [staged.name]


def test_stage_concurrent_threads(project: Path, tmp_path: Path) -> None:
    tree = collect_source(project)
    results: list[Path] = []
    errors: list[BaseException] = []

    def stage() -> None:
        try:
            results.append(stage_source(tree, tmp_path / "cache"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=stage) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [results[0].name]


def test_stage_detects_changes_since_collect(project: Path, tmp_path: Path) -> None:
    tree = collect_source(project)
    write(project, "train.py", "print('edited')\n")
    with pytest.raises(RuntimeError, match="changed after collect_source"):
        stage_source(tree, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_no_prefect_or_ray_import() -> None:
    import ast

    import prefect_nemo.packaging as packaging

    for source in Path(packaging.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("prefect", "ray"), (source.name, name)
