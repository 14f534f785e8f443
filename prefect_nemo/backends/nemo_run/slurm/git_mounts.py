"""``${auto_mount:git+<url>@<ref>,<target>}`` container mounts (the Nemotron recipes' syntax):
the repository at `ref`, cloned once on the cluster under the job dir, bind-mounted at `target`.

Nemotron's own resolver registers such an entry and drops it from ``container_mounts`` (the
clone is symlinked at start-up instead), which is how a mount went missing from the sbatch
script; here each entry becomes an ordinary ``<clone>:<target>`` bind mount, so the sbatch
script NeMo-Run writes shows it (``srun --container-mounts``). Pure; no Prefect.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from prefect_nemo import names
from prefect_nemo.errors import InvalidJobSpec

_AUTO_MOUNT = re.compile(r"^\$\{auto_mount:git\+(?P<spec>[^,}]+)(?:,(?P<target>[^}]*))?\}$")


@dataclass(frozen=True)
class GitMount:
    """One auto_mount entry: what to clone, where on the cluster, where in the container."""

    url: str
    ref: str
    target: str
    clone_dir: str

    @property
    def mount(self) -> str:
        """The bind mount, as NeMo-Run's container_mounts takes it."""
        return f"{self.clone_dir}:{self.target}"

    def clone_command(self) -> str:
        """Clone at `ref` into `clone_dir` unless a finished clone is there (atomic rename)."""
        q, d = shlex.quote, shlex.quote(self.clone_dir)
        clone = (
            f'git clone --quiet {q(self.url)} "$t" && '
            f'git -C "$t" checkout --quiet {q(self.ref)} && mv "$t" {d}'
        )
        return (
            f'[ -d {d}/.git ] || {{ mkdir -p "$(dirname {d})" && t=$(mktemp -d {d}.XXXXXX) && '
            f'{clone}; }} || {{ rm -rf "${{t:-}}"; exit 1; }}'
        )


def is_auto_mount(entry: str) -> bool:
    """True for a ``${auto_mount:...}`` entry (well-formed or not)."""
    return entry.startswith("${auto_mount:")


def git_mounts(entries: list[str], root: str, field: str) -> list[GitMount]:
    """The auto_mount entries of a container_mounts list, each cloned under `root`;
    InvalidJobSpec naming the entry's field for a malformed one."""
    found = []
    for index, entry in enumerate(entries):
        if not is_auto_mount(entry):
            continue
        match = _AUTO_MOUNT.match(entry)
        spec = match.group("spec") if match else ""
        url, _, ref = spec.rpartition("@")
        target = (match.group("target") or "").strip() if match else ""
        if not match or not url or not ref or not target.startswith("/"):
            raise InvalidJobSpec(
                f"{field}[{index}]: {entry!r} is not '${{auto_mount:git+<url>@<ref>,<target>}}' "
                "(a git URL, '@' and a commit, tag or branch, ',' and an absolute path in the "
                "container)"
            )
        repo = names.dns_label(url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"), 40)
        clone = f"{root}/{repo}-{names.stable_hash(url, ref, length=12)}"
        found.append(GitMount(url=url, ref=ref, target=target, clone_dir=clone))
    return found
