"""Plan how a `SourceArchive` reaches a backend's pods within that backend's limits.

Each backend caps what it accepts: Ray uploads a working_dir (under its gRPC message
limit); a Kubernetes ConfigMap holds at most 1 MiB; run:ai caps an env var value at
10,000 characters; Linux caps one argv/env string at 128 KiB (MAX_ARG_STRLEN), which
breaks Lepton's single-argument tarball. `plan_for` splits the archive accordingly, and
`TransportPlan.setup_command` is the one short shell command that puts it back together
in the pod, checking its sha256, and (on a shared path) lets only NODE_RANK=0 unpack.

This module must not import prefect or ray.
"""

from __future__ import annotations

import base64
import io
import re
import shlex
import tarfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.names import dns_label
from prefect_nemo.packaging.archive import SourceArchive
from prefect_nemo.packaging.source import stage_dir

Backend = Literal["ray", "kubernetes", "lepton", "dgx_cloud", "slurm"]
TransportKind = Literal["ray_working_dir", "env_chunks", "configmaps", "native"]

KiB = 1024
MiB = 1024 * KiB

#: Env var names carrying the archive (base64, split in order), the chunk count and the sha256.
ENV_PREFIX = "PREFECT_NEMO_CODE_"
ENV_CHUNKS = ENV_PREFIX + "CHUNKS"
ENV_SHA256 = ENV_PREFIX + "SHA256"

#: Linux MAX_ARG_STRLEN: one argv or env string ("NAME=value") must stay under this.
ARG_STRLEN_LIMIT = 128 * KiB
#: run:ai rejects an env var value longer than this.
RUNAI_ENV_VALUE_LIMIT = 10_000
#: The API server rejects a ConfigMap whose keys + values exceed this (etcd takes ~1.5 MiB).
CONFIGMAP_LIMIT = 1024 * KiB

#: Default chunk sizes: env chunks count base64 characters, ConfigMap chunks archive bytes.
DEFAULT_CHUNK_BYTES: dict[str, int] = {
    "lepton": 96 * KiB,
    "dgx_cloud": 9 * KiB,
    "kubernetes": 960 * KiB,  # 64 KiB headroom under 1 MiB for the key and metadata
}
#: Default ceilings on the archive size (bytes of tar.gz), per backend.
DEFAULT_MAX_BYTES: dict[str, int] = {
    "ray": 500 * MiB,  # Ray refuses packages at its 512 MiB gRPC message limit
    "kubernetes": 8 * MiB,  # ~9 ConfigMaps; past that, bake the code into the image
    # All env chunks together must fit the exec limit of argv + env (2 MiB with an 8 MiB
    # stack); 1 MiB of archive is ~1.37 MiB of base64.
    "lepton": 1 * MiB,
    "dgx_cloud": 1 * MiB,
}
_CHUNK_LIMITS: dict[str, int] = {
    "lepton": ARG_STRLEN_LIMIT - len(ENV_PREFIX) - 8,  # room for "<index>=" and the NUL
    "dgx_cloud": RUNAI_ENV_VALUE_LIMIT,
    "kubernetes": CONFIGMAP_LIMIT - 16,  # room for the key
}

#: Where the ConfigMaps are mounted in the pod (one projected volume, read-only).
PARTS_DIR = "/prefect-nemo/code-parts"
PARTS_VOLUME = "prefect-nemo-code"
MANAGED_BY = "app.kubernetes.io/managed-by"
SHA_LABEL = "prefect-nemo.io/code-sha256"

_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/-]*")
_BACKEND_KIND: dict[str, TransportKind] = {
    "ray": "ray_working_dir",
    "kubernetes": "configmaps",
    "lepton": "env_chunks",
    "dgx_cloud": "env_chunks",
    "slurm": "native",
}


class TransportTooLarge(InvalidJobSpec):
    """The code archive exceeds what the backend's transport can carry; nothing was submitted."""


def _part_key(index: int) -> str:
    return f"part-{index:05d}"


@dataclass(frozen=True)
class TransportPlan:
    """How one archive travels to a backend's pods, and the command that unpacks it there."""

    kind: TransportKind
    sha256: str
    """sha256 hex of the archive bytes."""
    chunks: int
    """How many env vars or ConfigMaps carry the archive (0 for ray and native)."""
    size: int = 0
    """Archive size in bytes."""
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """env_chunks: PREFECT_NEMO_CODE_0..N-1, PREFECT_NEMO_CODE_CHUNKS, PREFECT_NEMO_CODE_SHA256."""
    configmaps: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """configmaps: full ConfigMap manifests (caller sets namespace and owner references)."""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """configmaps: pod volumes projecting every ConfigMap part into one directory."""
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    """configmaps: container mounts of those volumes, read-only, at `PARTS_DIR`."""
    working_dir: Path | None = None
    """ray_working_dir: the staged directory to pass as runtime_env working_dir."""
    parts_dir: str = PARTS_DIR
    """configmaps: where `volume_mounts` puts the parts in the container."""

    @property
    def marker_name(self) -> str:
        """File written in dest once the tree is complete: names the content and chunk count."""
        return f".prefect-nemo-{self.sha256[:16]}-{self.chunks}.done"

    def _python(self) -> str:
        """The python3 one-liner that writes the verified archive to stdout (or exits 1)."""
        n = self.chunks
        if self.kind == "env_chunks":
            # Truncating to whole base64 quads turns a missing chunk into a checksum error.
            read = (
                f's="".join(os.environ.get("{ENV_PREFIX}%d"%i,"")for i in range({n}));'
                "d=base64.b64decode(s[:len(s)//4*4])"
            )
        elif self.kind == "configmaps":
            parts = self.parts_dir.rstrip("/")
            read = f'd=b"".join(open("{parts}/part-%05d"%i,"rb").read()for i in range({n}))'
        else:
            raise ValueError(
                f"a {self.kind} plan needs no setup command: the backend ships the code itself"
            )
        return (
            "import os,sys,hashlib,base64;"
            + read
            + ";h=hashlib.sha256(d).hexdigest();"
            + f'h=="{self.sha256}" or sys.exit("prefect-nemo: code archive sha256 is "+h+'
            + f'", expected {self.sha256}: a chunk is missing or corrupted");'
            + "sys.stdout.buffer.write(d)"
        )

    def setup_command(
        self,
        dest: str = "/workspace/code",
        *,
        shared: bool = False,
        wait_timeout_s: int = 600,
        rank_env: str = "NODE_RANK",
    ) -> str:
        """One POSIX-sh command that unpacks the archive into `dest`; non-zero on any failure.

        A python3 one-liner joins the chunks, checks the sha256 and only then writes the
        archive to ``tar -xz`` (so a bad checksum leaves tar an empty stream, which it
        rejects). Without `shared`, each pod unpacks into `dest` as it is (a fresh pod
        directory). With `shared` (one `dest` on a volume all pods see), only NODE_RANK=0
        unpacks, into a temp sibling renamed over `dest`, with the marker `marker_name`
        written inside before the rename; other ranks wait for the marker up to
        `wait_timeout_s`, then fail with a message on stderr. `dest` is replaced by a
        rename, so it must not itself be a mount point (mount the shared volume above it); a
        rank 0 killed mid-unpack leaves a ``<dest>.part.*`` directory behind. `rank_env`
        names the rank variable (Kubeflow Trainer's torch runtime sets PET_NODE_RANK); unset
        counts as 0.
        The command runs in a subshell, so its `exit` never ends the caller's script; it
        never embeds the payload (a few hundred characters whatever the archive size).
        """
        if not rank_env.isidentifier():
            raise ValueError(f"setup_command: rank_env={rank_env!r} is not a variable name")
        if not dest or dest == "/":
            raise ValueError("setup_command: dest must be a directory other than '/'")
        dest = dest.rstrip("/")
        py = shlex.quote(self._python())
        d = shlex.quote(dest)
        if not shared:
            return f"mkdir -p {d} && python3 -c {py} | tar -xzf - -C {d}"
        wait = int(wait_timeout_s)
        return (
            f'( d={d}; m="$d/{self.marker_name}"; '
            f'if [ "${{{rank_env}:-0}}" = 0 ]; then '
            '[ -e "$m" ] || { mkdir -p "$(dirname "$d")" && t=$(mktemp -d "$d.part.XXXXXX") '
            f'&& chmod 755 "$t" && {{ python3 -c {py} | tar -xzf - -C "$t"; }} '
            f'&& : > "$t/{self.marker_name}" '
            '&& { [ ! -e "$d" ] || mv "$d" "$t.old"; } && mv "$t" "$d" && rm -rf "$t.old"; } '
            f'|| {{ echo "prefect-nemo: {rank_env}=0 could not unpack the code into $d" >&2; '
            '[ -n "${t:-}" ] && rm -rf "$t"; exit 1; }; '
            "else s=$(date +%s); "
            'while [ ! -e "$m" ]; do '
            f"if [ $(( $(date +%s) - s )) -gt {wait} ]; then "
            f'echo "prefect-nemo: {rank_env}=${rank_env} gave up after {wait}s waiting for $m, '
            f"which {rank_env}=0 writes once it has unpacked the code: check the log of rank 0 "
            'and that $d is on a volume every pod shares" >&2; exit 1; fi; '
            "sleep 0.2 2>/dev/null || sleep 1; done; fi )"
        )


# --------------------------------------------------------------------------- planning


def _too_large(backend: str, archive: SourceArchive, limit: int) -> TransportTooLarge:
    """The error for an archive over `limit`, naming its largest files and the fixes."""
    largest = ""
    if archive.root is not None:
        sizes = []
        for rel in archive.files:
            try:
                sizes.append(((archive.root / rel).stat().st_size, rel))
            except OSError:
                continue
        top = sorted(sizes, reverse=True)[:3]
        largest = "; largest files: " + ", ".join(
            f"{rel} ({size / MiB:.1f} MiB)" for size, rel in top
        )
    return TransportTooLarge(
        f"code archive is {archive.size / MiB:.1f} MiB ({archive.size} bytes, compressed) but "
        f"the {backend} transport takes at most {limit / MiB:.1f} MiB (max_bytes={limit})"
        f"{largest}. Fix: leave data and checkpoints out with exclude=[...], ship one recipe "
        "family with recipe_family=..., raise max_bytes if the backend allows it, or bake the "
        "code into the container image"
    )


def _chunk_size(backend: str, chunk_bytes: int | None) -> int:
    size = DEFAULT_CHUNK_BYTES[backend] if chunk_bytes is None else int(chunk_bytes)
    limit = _CHUNK_LIMITS[backend]
    if size <= 0 or size > limit:
        raise InvalidJobSpec(
            f"chunk_bytes={size} for {backend}: must be between 1 and {limit} "
            f"(the service's per-value limit); the default is {DEFAULT_CHUNK_BYTES[backend]}"
        )
    return size


# Base64 parts of the last few archives planned (keyed by sha256, kind and chunk size): a
# re-plan of unchanged code in the same process skips re-encoding (most of a re-plan's cost).
_ENCODED: OrderedDict[tuple[str, str, int], list[str]] = OrderedDict()
_ENCODED_KEEP = 2
_ENCODED_LOCK = threading.Lock()  # Prefect runs tasks in threads


def _encoded_parts(archive: SourceArchive, kind: str, chunk: int) -> list[str]:
    """env_chunks: the base64 text cut every `chunk` characters; configmaps: each `chunk`
    bytes of the archive base64-encoded on its own (each ConfigMap must decode alone)."""
    key = (archive.sha256, kind, chunk)
    with _ENCODED_LOCK:
        parts = _ENCODED.get(key)
        if parts is not None:
            _ENCODED.move_to_end(key)
            return parts
    data = archive.data
    if kind == "env_chunks":
        text = base64.b64encode(data).decode("ascii")
        parts = [text[i : i + chunk] for i in range(0, len(text), chunk)] or [""]
    else:
        starts = range(0, len(data), chunk) if data else range(1)
        parts = [base64.b64encode(data[i : i + chunk]).decode("ascii") for i in starts]
    with _ENCODED_LOCK:
        _ENCODED[key] = parts
        while len(_ENCODED) > _ENCODED_KEEP:
            _ENCODED.popitem(last=False)
    return parts


def _env_chunks(archive: SourceArchive, chunk: int) -> dict[str, str]:
    parts = _encoded_parts(archive, "env_chunks", chunk)
    env = {f"{ENV_PREFIX}{i}": part for i, part in enumerate(parts)}
    env[ENV_CHUNKS] = str(len(parts))
    env[ENV_SHA256] = archive.sha256
    return env


def _configmap_name(name: str, sha256: str, index: int) -> str:
    """RFC 1123 name: readable head from `name`, then the content hash and the part index."""
    suffix = f"-code-{sha256[:10]}-{index}"
    return f"{dns_label(name, 63 - len(suffix))}{suffix}"


def _configmaps(
    archive: SourceArchive, name: str, chunk: int, parts_dir: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    parts = _encoded_parts(archive, "configmaps", chunk)
    manifests: list[dict[str, Any]] = []
    sources: list[dict[str, Any]] = []
    total = len(parts)
    for index, part in enumerate(parts):
        cm_name = _configmap_name(name, archive.sha256, index)
        key = _part_key(index)
        manifests.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": cm_name,
                    "labels": {MANAGED_BY: "prefect-nemo", SHA_LABEL: archive.sha256[:16]},
                    "annotations": {
                        SHA_LABEL: archive.sha256,
                        "prefect-nemo.io/code-part": f"{index}/{total}",
                    },
                },
                # Named by content, so never changed in place: kubelet need not watch it.
                "immutable": True,
                "binaryData": {key: part},
            }
        )
        sources.append({"configMap": {"name": cm_name, "items": [{"key": key, "path": key}]}})
    volumes = [{"name": PARTS_VOLUME, "projected": {"sources": sources, "defaultMode": 0o444}}]
    mounts = [{"name": PARTS_VOLUME, "mountPath": parts_dir, "readOnly": True}]
    return manifests, volumes, mounts


def stage_archive(archive: SourceArchive, cache_dir: str | Path | None = None) -> Path:
    """Unpack `archive` into ``<cache_dir>/<tree_hash[:20]>/`` (the `stage_source` layout,
    content-addressed: an existing directory is reused)."""

    def unpack(tmp: Path) -> None:
        with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")

    return stage_dir(archive.tree_hash[:20], unpack, cache_dir)


def plan_for(
    backend: Backend,
    archive: SourceArchive,
    *,
    name: str,
    chunk_bytes: int | None = None,
    max_bytes: int | None = None,
    cache_dir: str | Path | None = None,
    parts_dir: str = PARTS_DIR,
) -> TransportPlan:
    """Plan how `archive` reaches `backend`'s pods.

    ray: stage it as a working_dir (under `cache_dir`); lepton / dgx_cloud: base64 env-var
    chunks of at most `chunk_bytes` characters (96 KiB / 9 KiB by default); kubernetes:
    ConfigMaps of at most `chunk_bytes` archive bytes (960 KiB) named from `name`; slurm:
    native (NeMo-Run's packager ships the code). `max_bytes` caps the archive size (see
    `DEFAULT_MAX_BYTES`); over it raises `TransportTooLarge`. `parts_dir` is where the
    ConfigMaps are mounted (an absolute path).
    """
    kind = _BACKEND_KIND.get(backend)
    if kind is None:
        raise InvalidJobSpec(
            f"backend={backend!r} has no code transport; choose one of {sorted(_BACKEND_KIND)}"
        )
    limit = DEFAULT_MAX_BYTES.get(backend) if max_bytes is None else int(max_bytes)
    if limit is not None and archive.size > limit:
        raise _too_large(backend, archive, limit)
    sha256, size = archive.sha256, archive.size
    if kind == "native":
        return TransportPlan(kind=kind, sha256=sha256, chunks=0, size=size)
    if kind == "ray_working_dir":
        return TransportPlan(
            kind=kind,
            sha256=sha256,
            chunks=0,
            size=size,
            working_dir=stage_archive(archive, cache_dir),
        )
    if not name:
        raise InvalidJobSpec("plan_for: name is empty; pass the job name the parts are named after")
    chunk = _chunk_size(backend, chunk_bytes)
    if kind == "env_chunks":
        env = _env_chunks(archive, chunk)
        return TransportPlan(
            kind=kind, sha256=sha256, chunks=int(env[ENV_CHUNKS]), size=size, env=env
        )
    if not _SAFE_PATH.fullmatch(parts_dir):
        raise InvalidJobSpec(
            f"parts_dir={parts_dir!r} must be an absolute path of letters, digits, '.', '_', "
            "'-' and '/' (it is written into the setup command)"
        )
    manifests, volumes, mounts = _configmaps(archive, name, chunk, parts_dir)
    return TransportPlan(
        kind=kind,
        sha256=sha256,
        chunks=len(manifests),
        size=size,
        configmaps=manifests,
        volumes=volumes,
        volume_mounts=mounts,
        parts_dir=parts_dir,
    )
