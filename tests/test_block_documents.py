"""Block documents as YAML (`prefect-nemo blocks apply`), against a real Prefect server."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from pydantic import Field, SecretStr

import prefect_nemo.blocks
from prefect_nemo.blocks.documents import (
    BlockDocumentSpec,
    apply_file,
    block_class,
    build_block,
    load_documents,
    resolve_env,
)
from prefect_nemo.errors import InvalidJobSpec
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
BLOCK_FILES = sorted((ROOT / "blocks").glob("*.yaml"))
PREFECT = str(Path(sys.executable).parent / "prefect")
SECRET = "s3cr3t-" + "9d1e77a04b"
OTHER_SECRET = "s3cr3t-" + "51c0ffee88"
DUMMY_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n"


def _env_names(text: str) -> set[str]:
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


def _cli(prefect_api: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect_nemo.cli", *args],
        env=subprocess_env(prefect_api, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _doc(tmp_path: Path, body: str, name: str = "docs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


# -- the syntax -----------------------------------------------------------------------------------


def test_env_references_resolve_with_defaults_and_escapes() -> None:
    env = {"TOKEN": SECRET, "EMPTY": ""}
    data = {"a": "${TOKEN}", "b": ["x-${TOKEN}-y"], "c": "${MISSING:-fallback}", "d": "$${TOKEN}"}
    assert resolve_env(data, "doc", env) == {
        "a": SECRET,
        "b": [f"x-{SECRET}-y"],
        "c": "fallback",
        "d": "${TOKEN}",
    }
    assert resolve_env("${EMPTY:-x}", "doc", env) == ""  # set (even empty) wins over the default
    assert resolve_env(7, "doc", env) == 7


def test_a_missing_variable_names_the_variable_and_the_field(tmp_path: Path) -> None:
    path = _doc(
        tmp_path,
        "blocks:\n  - type: ray-jobs-cluster\n    name: remote\n    data:\n"
        "      dashboard_url: http://ray:8265\n      headers:\n        X-Key: ${PROXY_KEY}\n",
    )
    with pytest.raises(InvalidJobSpec) as err:
        load_documents(path, env={})
    message = str(err.value)
    assert "PROXY_KEY" in message and "data.headers.X-Key" in message
    assert "ray-jobs-cluster/remote" in message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("nothing: here\n", "'blocks:' list"),
        ("blocks:\n  - type: ray-jobs-cluster\n    name: Bad_Name\n", "name"),
        ("blocks:\n  - name: x\n", "type"),
        ("blocks:\n  - type: ray-jobs-cluster\n    name: x\n    extra: 1\n", "unknown key"),
        (
            "blocks:\n  - {type: ray-jobs-cluster, name: x, data: {dashboard_url: 'http://a:1'}}\n"
            "  - {type: ray-jobs-cluster, name: x, data: {dashboard_url: 'http://a:1'}}\n",
            "twice",
        ),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, body: str, expected: str) -> None:
    with pytest.raises(InvalidJobSpec, match=expected):
        load_documents(_doc(tmp_path, body), env={})


def test_unknown_type_and_fields_are_refused_without_echoing_values() -> None:
    with pytest.raises(InvalidJobSpec, match=r"no block type 'ray-job-cluster'.*ray-jobs-cluster"):
        block_class("ray-job-cluster")
    typo = BlockDocumentSpec(
        "ray-jobs-cluster", "x", {"dashboard_url": "http://a:1", "auth_tokn": SECRET}, "doc"
    )
    with pytest.raises(InvalidJobSpec, match=r"unknown field\(s\) \['auth_tokn'\]") as err:
        build_block(typo)
    assert SECRET not in str(err.value)
    nested = BlockDocumentSpec(
        "kube-ray-cluster",
        "x",
        {"kubernetes": {"namespce": "ml"}, "ray_cluster_name": "rc"},
        "doc",
    )
    with pytest.raises(InvalidJobSpec, match=r"data.kubernetes: unknown field\(s\) \['namespce'\]"):
        build_block(nested)
    # a secret in the wrong field: pydantic would echo the input; our message does not
    wrong = BlockDocumentSpec(
        "ray-jobs-cluster", "x", {"dashboard_url": "http://a:1", "request_timeout_s": SECRET}, "doc"
    )
    with pytest.raises(InvalidJobSpec, match="request_timeout_s") as err:
        build_block(wrong)
    assert SECRET not in str(err.value)


def test_block_types_resolve_from_the_registry_not_a_list() -> None:
    from prefect.blocks.system import Secret

    assert block_class("secret") is Secret  # Prefect's own blocks work too
    assert block_class("kube-ray-cluster").__name__ == "KubeRayCluster"


@pytest.mark.parametrize("path", BLOCK_FILES, ids=[p.name for p in BLOCK_FILES])
def test_every_shipped_file_validates(path: Path) -> None:
    """Each blocks/*.yaml builds its blocks once its variables are set (and names them all)."""
    names = _env_names(path.read_text())
    env = {name: name.lower().replace("_", "-") for name in names}
    env.update({n: "https://example.com" for n in names if n.endswith("_URL")})
    env.update({n: DUMMY_KEY for n in names if n.endswith("_KEY")})
    specs = load_documents(path, env=env)
    assert specs, path
    for spec in specs:
        build_block(spec)
    if re.search(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", path.read_text()):  # a required variable
        with pytest.raises(InvalidJobSpec, match="is not set"):
            load_documents(path, env={})


def test_every_cluster_block_has_a_document() -> None:
    """Each environment (every ClusterBlock of prefect_nemo.blocks) has a blocks/*.yaml document."""
    from prefect_nemo.blocks.base import ClusterBlock

    types = {spec.block_type for path in BLOCK_FILES for spec in _load_with_dummies(path)}
    clusters = [c for c in _our_block_classes() if issubclass(c, ClusterBlock)]
    assert len(clusters) >= 6
    for cls in clusters:
        assert cls.get_block_type_slug() in types, f"no blocks/*.yaml document for {cls.__name__}"


def _load_with_dummies(path: Path) -> list[BlockDocumentSpec]:
    return load_documents(path, env=dict.fromkeys(_env_names(path.read_text()), "x"))


def _our_block_classes() -> list[type[Block]]:
    found = []
    for module in pkgutil.iter_modules(prefect_nemo.blocks.__path__, "prefect_nemo.blocks."):
        mod = importlib.import_module(module.name)
        for value in vars(mod).values():
            if (
                isinstance(value, type)
                and Block.is_block_class(value)
                and value.__module__ == mod.__name__
                and "_block_type_slug" in value.__dict__
            ):
                found.append(value)
    return found


# -- against the server ---------------------------------------------------------------------------


class ProbeBlock(Block):
    """A block type made for this test, so its registration is seen to happen."""

    _block_type_slug = f"nemo-probe-{uuid.uuid4().hex[:8]}"
    _block_type_name = _block_type_slug
    token: SecretStr = Field(description="a secret")


@pytest.mark.slow
def test_apply_creates_then_reports_unchanged_then_updates(prefect_api: str, tmp_path: Path):
    name = f"t-{uuid.uuid4().hex[:8]}"
    path = _doc(
        tmp_path,
        f"blocks:\n  - type: ray-jobs-cluster\n    name: {name}\n    data:\n"
        "      dashboard_url: ${RAY_URL:-http://127.0.0.1:8265}\n"
        "      auth_token: ${TOKEN}\n      headers: {X-Proxy: '${TOKEN}'}\n"
        f"  - type: kube-ray-cluster\n    name: {name}\n    data:\n"
        "      kubernetes: {namespace: ml, kubeconfig: {token: '${TOKEN}'}}\n"
        "      ray_cluster_name: rc\n      ray_token: ${TOKEN}\n",
    )
    first = _cli(prefect_api, "blocks", "apply", str(path), TOKEN=SECRET)
    second = _cli(prefect_api, "blocks", "apply", str(path), TOKEN=SECRET)
    third = _cli(prefect_api, "blocks", "apply", str(path), TOKEN=OTHER_SECRET)
    for result in (first, second, third):
        assert result.returncode == 0, result.stdout + result.stderr
        assert SECRET not in result.stdout + result.stderr
        assert OTHER_SECRET not in result.stdout + result.stderr
    assert f"created   ray-jobs-cluster/{name}" in first.stdout
    assert f"created   kube-ray-cluster/{name}" in first.stdout
    assert f"unchanged ray-jobs-cluster/{name}" in second.stdout
    assert f"unchanged kube-ray-cluster/{name}" in second.stdout
    assert f"updated   ray-jobs-cluster/{name} (fields: auth_token, headers)" in third.stdout
    assert f"updated   kube-ray-cluster/{name} (fields: kubernetes, ray_token)" in third.stdout

    ray = Block.load(f"ray-jobs-cluster/{name}")
    assert ray.auth_token.get_secret_value() == OTHER_SECRET
    assert ray.headers.get_secret_value() == {"X-Proxy": OTHER_SECRET}
    kuberay = Block.load(f"kube-ray-cluster/{name}")
    assert kuberay.kubernetes.kubeconfig.get_secret_value() == {"token": OTHER_SECRET}
    with get_client(sync_client=True) as client:  # stored as secrets: masked unless asked
        doc = client.read_block_document_by_name(name, "ray-jobs-cluster", include_secrets=False)
    assert OTHER_SECRET not in str(doc.data)


@pytest.mark.slow
def test_missing_variable_fails_before_anything_is_written(prefect_api: str, tmp_path: Path):
    name = f"t-{uuid.uuid4().hex[:8]}"
    path = _doc(
        tmp_path,
        f"blocks:\n  - type: ray-jobs-cluster\n    name: {name}\n"
        "    data: {dashboard_url: 'http://a:1'}\n"
        f"  - type: ray-jobs-cluster\n    name: {name}-b\n"
        "    data: {dashboard_url: 'http://a:1', auth_token: '${NOT_SET_ANYWHERE}'}\n",
    )
    result = _cli(prefect_api, "blocks", "apply", str(path))
    assert result.returncode == 2
    assert "NOT_SET_ANYWHERE" in result.stderr and "data.auth_token" in result.stderr
    with pytest.raises(ValueError):
        Block.load(f"ray-jobs-cluster/{name}")  # the valid first document was not written either


@pytest.mark.slow
def test_apply_registers_a_missing_block_type(prefect_api: str, tmp_path: Path) -> None:
    slug = ProbeBlock.get_block_type_slug()
    path = _doc(
        tmp_path, f"blocks:\n  - type: {slug}\n    name: probe\n    data: {{token: '${{T}}'}}\n"
    )
    applied = apply_file(path, env={"T": SECRET})
    assert [(a.ref, a.outcome, a.registered_type) for a in applied] == [
        (f"{slug}/probe", "created", True)
    ]
    assert apply_file(path, env={"T": SECRET})[0].registered_type is False
    assert ProbeBlock.load("probe").token.get_secret_value() == SECRET


@pytest.mark.slow
def test_prefect_block_register_registers_every_block_type(prefect_api: str) -> None:
    """`prefect block register -m prefect_nemo` finds every block of prefect_nemo.blocks."""
    result = subprocess.run(
        [PREFECT, "block", "register", "-m", "prefect_nemo"],
        env=subprocess_env(prefect_api),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    classes = _our_block_classes()
    assert len(classes) >= 5
    with get_client(sync_client=True) as client:
        for cls in classes:
            assert cls.get_block_type_name() in result.stdout, (
                f"{cls.__name__} is not registered by `prefect block register -m prefect_nemo`: "
                "list it in prefect_nemo/__init__.py _LAZY"
            )
            assert client.read_block_type_by_slug(cls.get_block_type_slug())
