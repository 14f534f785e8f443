"""Block documents as YAML: one file per environment, secrets read from environment variables.

A file lists documents; each names its block type by slug (any registered Block, ours or
Prefect's), a document name and its field values:

    blocks:
      - type: ray-jobs-cluster
        name: remote
        data:
          dashboard_url: https://ray.example.com
          auth_token: ${RAY_AUTH_TOKEN}

`${VAR}` in a string is replaced by the environment variable VAR (an error if it is not set),
`${VAR:-default}` falls back to `default`, and `$${` writes a literal `${`. Values are never
printed: reports name documents and fields only.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from prefect.blocks.core import Block
from pydantic import ValidationError

from prefect_nemo.errors import InvalidJobSpec

log = logging.getLogger(__name__)

_REFERENCE = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_DOCUMENT_KEYS = {"type", "name", "data"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")

Outcome = Literal["created", "updated", "unchanged"]


@dataclass(frozen=True)
class BlockDocumentSpec:
    """One block document of a YAML file, with its environment references resolved."""

    block_type: str
    name: str
    data: dict[str, Any] = field(repr=False)
    where: str

    @property
    def ref(self) -> str:
        """The document's name as flows take it: '<block-type-slug>/<name>'."""
        return f"{self.block_type}/{self.name}"


@dataclass(frozen=True)
class Applied:
    """What `apply` did to one document; `changed` names fields only, never values."""

    ref: str
    outcome: Outcome
    changed: tuple[str, ...] = ()
    registered_type: bool = False

    def __str__(self) -> str:
        detail = f" (fields: {', '.join(self.changed)})" if self.changed else ""
        return f"{self.outcome:<9} {self.ref}{detail}"


def resolve_env(value: Any, where: str, env: dict[str, str] | None = None) -> Any:
    """`value` with every `${VAR}` reference replaced from the environment (recursively)."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    if isinstance(value, dict):
        return {k: resolve_env(v, f"{where}.{k}", env) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, f"{where}[{i}]", env) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        name, default = match.group(1), match.group(2)
        if name in env:  # type: ignore[operator]
            return env[name]  # type: ignore[index]
        if default is not None:
            return default
        raise InvalidJobSpec(
            f"{where}: environment variable {name} is not set; export it (or write "
            f"${{{name}:-default}} in the file for an optional value)"
        )

    return _REFERENCE.sub(substitute, value)


def load_documents(path: str | Path, env: dict[str, str] | None = None) -> list[BlockDocumentSpec]:
    """Read a block-documents YAML file and resolve its environment references."""
    path = Path(path)
    try:
        content = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InvalidJobSpec(f"{path}: cannot read the file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise InvalidJobSpec(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(content, dict) or not isinstance(content.get("blocks"), list):
        raise InvalidJobSpec(f"{path}: expected a mapping with a 'blocks:' list of documents")
    specs, seen = [], set()
    for i, entry in enumerate(content["blocks"]):
        where = f"{path}: blocks[{i}]"
        if not isinstance(entry, dict):
            raise InvalidJobSpec(f"{where}: expected a mapping with type, name and data")
        unknown = set(entry) - _DOCUMENT_KEYS
        if unknown:
            raise InvalidJobSpec(
                f"{where}: unknown key(s) {sorted(unknown)}; a document has type, name and data"
            )
        block_type, name = entry.get("type"), entry.get("name")
        if not isinstance(block_type, str) or not block_type:
            raise InvalidJobSpec(f"{where}.type: give the block type slug, e.g. ray-jobs-cluster")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidJobSpec(
                f"{where}.name: {name!r} is not a block document name: use lowercase letters, "
                "digits and dashes"
            )
        data = entry.get("data") or {}
        if not isinstance(data, dict):
            raise InvalidJobSpec(f"{where}.data: expected a mapping of field values")
        spec = BlockDocumentSpec(
            block_type=block_type,
            name=name,
            data=resolve_env(data, f"{where} ({block_type}/{name}) data", env),
            where=f"{where} ({block_type}/{name})",
        )
        if spec.ref in seen:
            raise InvalidJobSpec(f"{where}: {spec.ref} appears twice in the file")
        seen.add(spec.ref)
        specs.append(spec)
    return specs


def block_class(slug: str) -> type[Block]:
    """The Block class registered under `slug`: ours (every prefect_nemo.blocks module),
    Prefect's, or any installed Prefect collection's."""
    from prefect.utilities.dispatch import lookup_type

    failed = _import_block_modules()
    try:
        return lookup_type(Block, slug)
    except KeyError:
        pass
    known = sorted(
        cls.get_block_type_slug() for cls in _block_classes() if not cls.__name__.startswith("_")
    )
    hint = "; ".join(f"{mod} did not import ({err})" for mod, err in failed.items())
    raise InvalidJobSpec(
        f"type: no block type {slug!r} is installed. prefect-nemo's: {', '.join(known)}"
        + (f". Note: {hint}" if hint else "")
    )


def _import_block_modules() -> dict[str, str]:
    """Import every module of prefect_nemo.blocks and installed collections; report failures."""
    from prefect.plugins import load_prefect_collections

    import prefect_nemo.blocks as package

    failed: dict[str, str] = {}
    for module in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
        try:
            importlib.import_module(module.name)
        except ImportError as exc:  # an optional extra is not installed
            failed[module.name] = str(exc)
    load_prefect_collections()
    return failed


def _block_classes() -> list[type[Block]]:
    import prefect_nemo.blocks as package

    out: list[type[Block]] = []
    stack: list[type[Block]] = [Block]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith(package.__name__) and "_block_type_slug" in cls.__dict__:
            out.append(cls)
    return out


def build_block(spec: BlockDocumentSpec) -> Block:
    """Validate a document against its block class; errors name fields, never values."""
    cls = block_class(spec.block_type)
    _check_fields(cls, spec.data, f"{spec.where} data")
    try:
        return cls.model_validate(spec.data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '(document)'}: {err['msg']}"
            for err in exc.errors(include_input=False, include_url=False)
        )
        raise InvalidJobSpec(f"{spec.where}: {problems}") from None


def _check_fields(cls: type[Block], data: dict[str, Any], where: str) -> None:
    """Blocks accept unknown keys silently: a typo would be lost, so refuse them here."""
    fields = cls.model_fields
    unknown = sorted(set(data) - set(fields) - {"block_type_slug"})
    if unknown:
        raise InvalidJobSpec(
            f"{where}: unknown field(s) {unknown} for {cls.get_block_type_slug()}; "
            f"known: {', '.join(sorted(fields))}"
        )
    for name, info in fields.items():
        nested = info.annotation
        if isinstance(data.get(name), dict) and Block.is_block_class(nested):
            _check_fields(nested, data[name], f"{where}.{name}")


def _canonical(value: Any) -> Any:
    """Field values with secrets revealed, without the document bookkeeping a loaded block has."""
    if isinstance(value, Block):
        value = value.model_dump(mode="json", context={"include_secrets": True})
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _changed_fields(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(k for k in {*old, *new} if old.get(k) != new.get(k)))


def apply_document(spec: BlockDocumentSpec) -> Applied:
    """Create or update one block document; unchanged if the stored one already matches."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    block = build_block(spec)
    cls = type(block)
    registered = False
    with get_client(sync_client=True) as client:
        try:
            client.read_block_type_by_slug(cls.get_block_type_slug())
        except ObjectNotFound:
            cls.register_type_and_schema()
            registered = True
    try:
        stored = cls.load(spec.name)
    except Exception as exc:  # missing, or stored under an older schema: (over)write it
        log.debug("%s: no loadable stored document (%s)", spec.ref, type(exc).__name__)
        stored = None
    new = _canonical(block)
    if stored is None:
        outcome: Outcome = "created" if not _exists(spec) else "updated"
        block.save(spec.name, overwrite=True)
        return Applied(spec.ref, outcome, registered_type=registered)
    changed = _changed_fields(_canonical(stored), new)
    if not changed:
        return Applied(spec.ref, "unchanged", registered_type=registered)
    block.save(spec.name, overwrite=True)
    return Applied(spec.ref, "updated", changed, registered_type=registered)


def _exists(spec: BlockDocumentSpec) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_block_document_by_name(spec.name, spec.block_type, include_secrets=False)
            return True
        except ObjectNotFound:
            return False


def check_file(path: str | Path, env: dict[str, str] | None = None) -> list[BlockDocumentSpec]:
    """Read and validate every document of a file, without contacting the server."""
    specs = load_documents(path, env)
    for spec in specs:
        build_block(spec)
    return specs


def apply_file(path: str | Path, env: dict[str, str] | None = None) -> list[Applied]:
    """Apply every document of a file; all are validated before the first one is written."""
    return [apply_document(spec) for spec in check_file(path, env)]
