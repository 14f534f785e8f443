"""Snapshot a job's local source tree and stage it in a content-addressed cache.

`collect_source` walks a directory the way git would decide what belongs in a
commit (``.gitignore`` files, plus a fixed set of caches that never belong in a
job) and fingerprints the result; `stage_source` copies that snapshot into a
directory named after its digest so identical code is staged only once.

This module must not import prefect or ray.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pathspec import GitIgnoreSpec

from prefect_nemo.errors import InvalidJobSpec

#: Patterns (gitignore syntax) that are dropped everywhere and cannot be re-included.
ALWAYS_EXCLUDED: tuple[str, ...] = (
    ".git",
    "__pycache__/",
    "*.pyc",
    "*.pyo",
    ".DS_Store",
    ".venv/",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
)

#: Environment variable that overrides the default staging directory.
CACHE_DIR_ENV = "PREFECT_NEMO_CACHE_DIR"

_BLOCK_SIZE = 1 << 20  # 1 MiB
_DIGEST_PREFIX_LEN = 20
_GITIGNORE = ".gitignore"
_ALWAYS_SPEC = GitIgnoreSpec.from_lines(ALWAYS_EXCLUDED)


@dataclass(frozen=True)
class SourceTree:
    """A snapshot of the local files that make up a job's code."""

    root: Path
    """Absolute, resolved directory the files were collected from."""
    files: tuple[str, ...]
    """POSIX paths relative to `root`, sorted; regular files only."""
    digest: str
    """sha256 hex over (relpath, executable bit, file bytes) of every file, in order."""
    total_bytes: int
    """Sum of the sizes of all files."""


# --------------------------------------------------------------------------- hashing


def _hash_file(path: Path) -> tuple[str, int]:
    """Return the sha256 hex of a file's bytes and its size, streaming in 1 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK_SIZE):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _is_executable(mode: int) -> bool:
    """Whether a file mode counts as executable (git's rule: the owner's x bit)."""
    return bool(mode & stat.S_IXUSR)


def _tree_record(relpath: str, executable: bool, content_sha256: str) -> bytes:
    """One file's contribution to the tree digest.

    Each file is framed as ``<relpath>\\0<x|->\\0<sha256 of bytes>\\n``; relpaths
    cannot contain NUL, so the encoding is unambiguous.
    """
    return b"%s\0%s\0%s\n" % (
        os.fsencode(relpath),
        b"x" if executable else b"-",
        content_sha256.encode("ascii"),
    )


# --------------------------------------------------------------------------- walking


@dataclass(frozen=True)
class _IgnoreLevel:
    """The patterns of one ``.gitignore`` and the root-relative dir it lives in."""

    base: str  # "" for root, else "a/b/" (with trailing slash)
    spec: GitIgnoreSpec


def _read_gitignore(path: Path) -> GitIgnoreSpec | None:
    """Parse a ``.gitignore`` file, or return None if there is none (or it is empty)."""
    try:
        if not path.is_file():
            return None
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return None
    spec = GitIgnoreSpec.from_lines(text.splitlines())
    return spec if len(spec.patterns) else None


def _gitignored(levels: Sequence[_IgnoreLevel], relpath: str) -> bool:
    """Apply git's precedence: the nearest ``.gitignore`` with a matching pattern decides."""
    for level in reversed(levels):
        result = level.spec.check_file(relpath[len(level.base) :])
        if result.include is not None:
            return result.include
    return False


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` resolves (following links) to a location inside `root`."""
    try:
        return path.resolve(strict=True).is_relative_to(root)
    except (OSError, RuntimeError):  # broken link or symlink loop
        return False


def _selected(include: Sequence[str] | None, match_path: str) -> bool:
    """Whether `match_path` (dirs end in '/') is on the way to, or inside, an `include` entry.

    Entries are root-relative POSIX paths, directories with a trailing '/'. A directory is
    walked if it holds an entry or lies inside one; a file is kept if it is an entry or lies
    inside a directory entry.
    """
    if include is None:
        return True
    is_dir = match_path.endswith("/")
    for entry in include:
        if match_path == entry or (entry.endswith("/") and match_path.startswith(entry)):
            return True
        if is_dir and entry.startswith(match_path):
            return True
    return False


def _walk(
    root: Path, exclude: GitIgnoreSpec | None, include: Sequence[str] | None = None
) -> Iterator[tuple[str, Path]]:
    """Yield ``(relpath, path)`` for every kept file, pruning ignored directories."""
    stack: list[tuple[Path, str, tuple[_IgnoreLevel, ...]]] = [(root, "", ())]
    while stack:
        directory, rel_dir, levels = stack.pop()
        spec = _read_gitignore(directory / _GITIGNORE)
        if spec is not None:
            levels = (*levels, _IgnoreLevel(rel_dir, spec))
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:
            raise InvalidJobSpec(
                f"cannot list directory '{directory}' under working_dir '{root}': {exc}; "
                "fix its permissions or add it to exclude="
            ) from exc
        for entry in entries:
            relpath = rel_dir + entry.name
            path = Path(entry.path)
            try:
                is_link = entry.is_symlink()
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_link:
                # Symlinked dirs are never descended; file links only if they stay inside root.
                if path.is_dir() or not _inside(path, root):
                    continue
            # Git matches directories with a trailing slash so `build/`-style patterns apply.
            match_path = relpath + "/" if is_dir else relpath
            if not _selected(include, match_path):
                continue
            if _ALWAYS_SPEC.match_file(match_path):
                continue
            if exclude is not None and exclude.match_file(match_path):
                continue
            if _gitignored(levels, match_path):
                continue
            if is_dir:
                stack.append((path, match_path, levels))
                continue
            try:
                is_regular = stat.S_ISREG(path.stat().st_mode)  # follows allowed links
            except OSError:
                continue  # vanished
            if is_regular:  # skip fifos, sockets, devices
                yield relpath, path


def _relpath_key(relpath: str) -> bytes:
    """Sort key: byte order of the encoded path, stable across platforms and locales."""
    return os.fsencode(relpath)


def _check_root(root: str | Path) -> Path:
    """Resolve `root` and make sure it is an existing directory."""
    raw = Path(root).expanduser()
    if not raw.exists():
        raise InvalidJobSpec(
            f"working_dir '{raw}' does not exist: pass the directory that holds your job code"
        )
    if not raw.is_dir():
        raise InvalidJobSpec(
            f"working_dir '{raw}' is not a directory: pass the directory that holds your job code"
        )
    return raw.resolve()


# --------------------------------------------------------------------------- public API


def collect_source(
    root: str | Path, *, exclude: Sequence[str] = (), include: Sequence[str] | None = None
) -> SourceTree:
    """Snapshot the files under `root` that belong in a job and fingerprint them.

    Honours ``.gitignore`` files at the root and in subdirectories with git's
    semantics (nearest file wins, negation, dir-only patterns; files inside an
    ignored directory cannot be re-included). Always drops `ALWAYS_EXCLUDED`.
    `exclude` adds gitignore-style patterns relative to `root`; like the
    always-dropped set, ``.gitignore`` negations cannot re-include what they
    exclude. Symlinks to files are followed only if they resolve inside `root`;
    symlinked directories are never descended. `include` (root-relative POSIX
    paths, directories ending in '/') narrows the walk to those entries; None keeps
    everything.

    Raises `InvalidJobSpec` if `root` is missing, not a directory, or holds no
    files after filtering.
    """
    if isinstance(exclude, str):
        exclude = (exclude,)
    base = _check_root(root)
    exclude_spec = GitIgnoreSpec.from_lines(list(exclude)) if exclude else None

    found = sorted(_walk(base, exclude_spec, include), key=lambda item: _relpath_key(item[0]))
    tree_hash = hashlib.sha256()
    files: list[str] = []
    total = 0
    for relpath, path in found:
        try:
            executable = _is_executable(path.stat().st_mode)
            content_sha, size = _hash_file(path)
        except FileNotFoundError:
            continue  # removed while we were walking
        except OSError as exc:
            raise InvalidJobSpec(
                f"cannot read '{path}' under working_dir '{base}': {exc}; "
                "fix its permissions or add it to exclude="
            ) from exc
        tree_hash.update(_tree_record(relpath, executable, content_sha))
        files.append(relpath)
        total += size

    if not files:
        raise InvalidJobSpec(
            f"working_dir '{base}' contains no files once .gitignore, the always-excluded "
            f"caches, exclude={list(exclude)!r}"
            + (f" and include={list(include)!r}" if include is not None else "")
            + " are applied: pass the directory that holds "
            "your job code, or loosen those patterns"
        )
    return SourceTree(
        root=base, files=tuple(files), digest=tree_hash.hexdigest(), total_bytes=total
    )


def default_cache_dir() -> Path:
    """Where `stage_source` puts trees by default.

    ``$PREFECT_NEMO_CACHE_DIR`` if set, else ``~/.cache/prefect-nemo/source``.
    """
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "prefect-nemo" / "source"


def _copy_file(src: Path, dst: Path) -> tuple[str, int]:
    """Copy `src` to `dst` in 1 MiB blocks; return the sha256 hex and size of what was copied."""
    h = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while block := fin.read(_BLOCK_SIZE):
            h.update(block)
            fout.write(block)
            size += len(block)
    return h.hexdigest(), size


def _populate(tree: SourceTree, dest: Path) -> None:
    """Copy every file of `tree` under `dest`, checking the copy still matches `tree.digest`."""
    tree_hash = hashlib.sha256()
    for relpath in tree.files:
        src = tree.root / relpath
        dst = dest / relpath
        dst.parent.mkdir(parents=True, exist_ok=True)
        executable = _is_executable(src.stat().st_mode)
        content_sha, _ = _copy_file(src, dst)
        os.chmod(dst, 0o755 if executable else 0o644)
        tree_hash.update(_tree_record(relpath, executable, content_sha))
    if tree_hash.hexdigest() != tree.digest:
        raise RuntimeError(
            f"files under '{tree.root}' changed after collect_source: "
            "call collect_source again and stage the new tree"
        )


def stage_source(tree: SourceTree, cache_dir: str | Path | None = None) -> Path:
    """Copy `tree` into ``<cache_dir>/<digest[:20]>/`` and return that directory.

    Content-addressed (see `stage_dir`). Executable bits are preserved (files are written 0755
    or 0644). `cache_dir` defaults to `default_cache_dir()`.

    Raises `RuntimeError` if the files changed since `collect_source`.
    """
    return stage_dir(tree.digest[:_DIGEST_PREFIX_LEN], lambda tmp: _populate(tree, tmp), cache_dir)


def stage_dir(name: str, fill: Callable[[Path], None], cache_dir: str | Path | None = None) -> Path:
    """The directory ``<cache_dir>/<name>``, filled by `fill(tmp)` unless it already exists.

    It is built in a temporary sibling and renamed into place, so readers never see a partial
    tree; a concurrent stager that loses the race uses the winner's directory.
    """
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    base = base.resolve()
    target = base / name
    if target.is_dir():
        return target

    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=base))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            # Lost the race: someone else renamed their copy into place first.
            lost = isinstance(exc, FileExistsError) or exc.errno in (errno.EEXIST, errno.ENOTEMPTY)
            if lost and target.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
