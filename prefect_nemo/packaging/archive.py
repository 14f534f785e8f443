"""Build one deterministic, content-addressed tar.gz of a project's code.

Every transport (Ray working_dir, env-var chunks, ConfigMaps) ships the same archive, so
the code a job ran is named by one sha256 whatever the backend. Equal trees give equal
bytes: entries are sorted and their metadata normalised, and gzip carries no timestamp.

Include discovery (what a project's "code" is), relative to the project root:

- every top-level package: a directory holding ``__init__.py``, at the root or under
  ``src/`` (kept at ``src/<pkg>`` so a src-layout ``pyproject.toml`` still installs);
- top-level ``*.py`` files (scripts, ``setup.py``), ``pyproject.toml`` and ``setup.cfg``;
- whatever `include=` adds (data directories, configs, namespace packages).

Everything else at the root (data, checkpoints, notebooks, docs) stays home. ``.gitignore``
files and the always-dropped caches apply as in `collect_source`.

This module must not import prefect or ray.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.packaging.source import (
    SourceTree,
    _check_root,
    _is_executable,
    _tree_record,
    collect_source,
    default_cache_dir,
)

#: gzip level of the archive: tar's default (gzip -6), a good speed/size balance for code.
GZIP_LEVEL = 6
#: mtime of every entry (1980-01-01, the reproducible-builds convention; 0 makes tools warn).
ARCHIVE_MTIME = 315_532_800
#: Bumped whenever the archive bytes for a given tree would change (cache key component).
ARCHIVE_FORMAT = "1"
#: Root files shipped when present (with every top-level ``*.py``).
PROJECT_FILES: tuple[str, ...] = ("pyproject.toml", "setup.cfg")
#: Name of the directory whose sub-directories are recipe families.
RECIPES_DIR = "recipes"

_ARCHIVES_SUBDIR = "archives"
_COPY_BUFSIZE = 1 << 20


@dataclass(frozen=True)
class SourceArchive:
    """A project's code as one deterministic tar.gz, with its identity."""

    data: bytes = field(repr=False)
    """The tar.gz bytes."""
    sha256: str
    """sha256 hex of `data`: what the pod checks after reassembly."""
    size: int
    """len(data)."""
    files: tuple[str, ...]
    """Root-relative POSIX paths in the archive, in archive order."""
    tree_hash: str
    """`SourceTree.digest` of the files (paths, exec bits, contents): the cache key."""
    root: Path | None = None
    """The directory the files came from (None when built from bytes)."""


# --------------------------------------------------------------------------- discovery


def _escape(name: str) -> str:
    """Escape gitignore glob characters so a literal file name is matched as such."""
    return "".join("\\" + c if c in "\\*?[]!# " else c for c in name)


def _is_package(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / "__init__.py").is_file()


def discover_includes(root: Path, extra: Sequence[str] = ()) -> list[str]:
    """The root-relative entries (directories end in '/') that make up the project's code.

    See the module docstring for the rules. `extra` entries must exist under `root`.
    """
    entries: list[str] = []
    with os.scandir(root) as it:
        top = sorted(it, key=lambda e: e.name)
    for entry in top:
        path = Path(entry.path)
        if entry.is_file() and (entry.name.endswith(".py") or entry.name in PROJECT_FILES):
            entries.append(entry.name)
        elif _is_package(path):
            entries.append(entry.name + "/")
    src = root / "src"
    if src.is_dir() and not src.is_symlink():
        for sub in sorted(src.iterdir()):
            if _is_package(sub):
                entries.append(f"src/{sub.name}/")
    for raw in extra:
        rel = Path(raw)
        if rel.is_absolute() or ".." in rel.parts:
            raise InvalidJobSpec(
                f"include entry {raw!r} must be a path relative to the project root '{root}'"
            )
        target = root / rel
        if not target.exists():
            raise InvalidJobSpec(
                f"include entry {raw!r} does not exist under the project root '{root}': "
                "fix the path or drop it from include="
            )
        posix = rel.as_posix().strip("/")
        entries.append(posix + "/" if target.is_dir() else posix)
    return entries


def _recipe_excludes(root: Path, entries: Sequence[str], family: str) -> tuple[list[str], str]:
    """Exclude patterns that drop every recipe family but `family`, and the extra entry to add.

    A recipes tree is ``recipes/`` at the root or directly inside a shipped package (as in
    ``src/nemotron/recipes/<family>``). Files directly in ``recipes/`` are kept.
    """
    candidates = [RECIPES_DIR + "/"] + [e + RECIPES_DIR + "/" for e in entries if e.endswith("/")]
    trees = [c for c in dict.fromkeys(candidates) if (root / c).is_dir()]
    if not trees:
        raise InvalidJobSpec(
            f"recipe_family={family!r}: no '{RECIPES_DIR}/' directory at the project root "
            f"'{root}' or inside its packages: drop recipe_family or fix the project root"
        )
    excludes: list[str] = []
    found = False
    families: set[str] = set()
    for tree in trees:
        for sub in sorted((root / tree).iterdir()):
            if not sub.is_dir() or sub.name == "__pycache__":
                continue
            families.add(sub.name)
            if sub.name == family:
                found = True
            else:
                excludes.append("/" + _escape(tree + sub.name) + "/")
    if not found:
        raise InvalidJobSpec(
            f"recipe_family={family!r} is not a directory of {', '.join(trees)} under "
            f"'{root}'; families there: {sorted(families) or 'none'}"
        )
    # A root recipes/ tree is not a package, so discovery skipped it: ship it explicitly.
    extra = RECIPES_DIR + "/" if RECIPES_DIR + "/" in trees else ""
    return excludes, extra


# --------------------------------------------------------------------------- tar.gz


def _tarinfo(relpath: str, size: int, executable: bool) -> tarfile.TarInfo:
    """A header with everything but name, size and the exec bit normalised."""
    info = tarfile.TarInfo(relpath)
    info.size = size
    info.mtime = ARCHIVE_MTIME
    info.mode = 0o755 if executable else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class _HashingReader:
    """File wrapper that hashes what tarfile reads, so the bytes shipped are the bytes hashed."""

    def __init__(self, f: io.BufferedReader) -> None:
        self._f = f
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        block = self._f.read(n)
        self.sha.update(block)
        return block


def _write_targz(tree: SourceTree) -> bytes:
    """Stream the tree's files into a deterministic tar.gz held in memory.

    The tree hash is recomputed from the bytes actually written: a file edited after
    `collect_source` would otherwise be cached under the old tree's hash.
    """
    out = io.BytesIO()
    tree_hash = hashlib.sha256()
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=GZIP_LEVEL, mtime=0) as gz,
        # typeshed's overloads of tarfile.open leave out copybufsize (passed on to TarFile)
        tarfile.open(  # type: ignore[call-overload]
            fileobj=gz, mode="w|", format=tarfile.GNU_FORMAT, copybufsize=_COPY_BUFSIZE
        ) as tar,
    ):
        for relpath in tree.files:
            with open(tree.root / relpath, "rb") as f:
                st = os.fstat(f.fileno())
                executable = _is_executable(st.st_mode)
                reader = _HashingReader(f)
                tar.addfile(_tarinfo(relpath, st.st_size, executable), reader)
            tree_hash.update(_tree_record(relpath, executable, reader.sha.hexdigest()))
    if tree_hash.hexdigest() != tree.digest:
        raise RuntimeError(
            f"files under '{tree.root}' changed while they were being packed: pack again"
        )
    return out.getvalue()


# --------------------------------------------------------------------------- cache


def _cache_paths(cache_dir: Path, tree_hash: str) -> tuple[Path, Path]:
    base = cache_dir / _ARCHIVES_SUBDIR / f"{tree_hash}-v{ARCHIVE_FORMAT}"
    return base.with_suffix(".tar.gz"), base.with_suffix(".json")


def _load_cached(cache_dir: Path, tree: SourceTree) -> SourceArchive | None:
    """The cached archive of `tree`, or None if absent or unreadable."""
    data_path, meta_path = _cache_paths(cache_dir, tree.digest)
    try:
        meta = json.loads(meta_path.read_text())
        data = data_path.read_bytes()
    except (OSError, ValueError):
        return None
    if len(data) != meta.get("size") or meta.get("files") != list(tree.files):
        return None
    sha256 = hashlib.sha256(data).hexdigest()  # ~20 ms for 30 MB: never ship a damaged copy
    if sha256 != meta.get("sha256"):
        return None
    return SourceArchive(
        data=data,
        sha256=sha256,
        size=len(data),
        files=tree.files,
        tree_hash=tree.digest,
        root=tree.root,
    )


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp sibling and rename, so readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store_cached(cache_dir: Path, archive: SourceArchive) -> None:
    """Best effort: a cache that cannot be written only costs a re-tar next time."""
    data_path, meta_path = _cache_paths(cache_dir, archive.tree_hash)
    meta = {"sha256": archive.sha256, "size": archive.size, "files": list(archive.files)}
    try:
        data_path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(data_path, archive.data)
        _atomic_write(meta_path, json.dumps(meta).encode())  # written last: marks it complete
    except OSError:
        pass


# --------------------------------------------------------------------------- public API


def build_archive(
    root: str | Path,
    *,
    recipe_family: str | None = None,
    exclude: Sequence[str] = (),
    include: Sequence[str] = (),
    cache_dir: str | Path | None = None,
) -> SourceArchive:
    """Pack the project's code under `root` into a deterministic tar.gz.

    Files are chosen by include discovery (module docstring) plus `include`, minus
    ``.gitignore``, the always-dropped caches and `exclude` (gitignore patterns).
    `recipe_family` ships only ``recipes/<family>`` of the recipes tree. An unchanged tree
    is not re-tarred: archives are cached by tree hash under
    ``<cache_dir or default_cache_dir()>/archives``.

    Raises `InvalidJobSpec` if `root` holds no code, or `recipe_family` is not found.
    """
    if isinstance(exclude, str):
        exclude = (exclude,)
    if isinstance(include, str):
        include = (include,)
    base = _check_root(root)
    entries = discover_includes(base, include)
    patterns = list(exclude)
    if recipe_family is not None:
        recipe_excludes, extra = _recipe_excludes(base, entries, recipe_family)
        patterns += recipe_excludes
        if extra and extra not in entries:
            entries.append(extra)
    if not entries:
        raise InvalidJobSpec(
            f"'{base}' holds no Python package (a directory with __init__.py, at the root or "
            "under src/), no top-level *.py and no pyproject.toml: pass the project root, or "
            "name what to ship with include=[...]"
        )
    tree = collect_source(base, exclude=patterns, include=entries)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cached = _load_cached(cache, tree)
    if cached is not None:
        return cached
    data = _write_targz(tree)
    archive = SourceArchive(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        files=tree.files,
        tree_hash=tree.digest,
        root=tree.root,
    )
    _store_cached(cache, archive)
    return archive
