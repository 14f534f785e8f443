"""Every block: Prefect's standard block checks, registration, secret round trips."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
import uuid
import zlib
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.request import urlopen

import pytest
from prefect.client.orchestration import get_client
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_nemo.blocks import (
    DGXCloudCluster,
    DGXCloudRayCluster,
    KubeflowTrainerCluster,
    KubeRayCluster,
    KubernetesCluster,
    LeptonRayCluster,
    LeptonWorkspace,
    RayJobsCluster,
    SlurmCluster,
)
from prefect_nemo.blocks.base import LOGOS_URL
from tests.conftest import subprocess_env

PREFECT = str(Path(sys.executable).parent / "prefect")
TOKEN = "tok-" + "7f3a9c21e5d84b60"
PROXY_KEY = "hdr-" + "c0ffee5ecret42"
WANDB_KEY = "wandb-" + "5ec12e7c1a5de2"
ROOT = Path(__file__).resolve().parent.parent


BLOCKS = {
    "ray-jobs-cluster": RayJobsCluster,
    "kubernetes-cluster": KubernetesCluster,
    "kube-ray-cluster": KubeRayCluster,
    "kubeflow-trainer-cluster": KubeflowTrainerCluster,
    "slurm-cluster": SlurmCluster,
    "lepton-workspace": LeptonWorkspace,
    "lepton-ray-cluster": LeptonRayCluster,
    "dgx-cloud-cluster": DGXCloudCluster,
    "dgx-cloud-ray-cluster": DGXCloudRayCluster,
}


@pytest.fixture(scope="module")
def logo_server() -> Iterator[str]:
    """The repository's assets/block-logos over loopback HTTP, as raw.githubusercontent.com
    serves them from the repository; yields the base URL."""
    handler = partial(SimpleHTTPRequestHandler, directory=str(ROOT / "assets" / "block-logos"))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class TestEveryBlock(BlockStandardTestSuite):
    @pytest.fixture(params=list(BLOCKS.values()), ids=list(BLOCKS))
    def block(self, request: pytest.FixtureRequest) -> type:
        return request.param

    def test_has_a_valid_image(self, block: type, logo_server: str) -> None:
        """Prefect's rule for block logos (BlockStandardTestSuite.test_has_a_valid_image): "Logo
        should be a square image" more than 45 and less than 1000 px wide. Prefect's test
        downloads the logo, which an offline machine cannot; a logo this repository ships
        (LOGOS_URL: assets/block-logos, published by raw.githubusercontent.com as Prefect
        publishes its own block logos) is served here from the checkout, fetched with urlopen as
        Prefect's test does, and decoded as a PNG (checksums and pixel data verified) for its
        size. A logo on another site cannot be fetched here: an expected failure that names it."""
        url = str(block._logo_url)
        assert url.startswith("https://"), f"{block.__name__}: the logo must be an https URL"
        if not url.startswith(f"{LOGOS_URL}/"):
            pytest.xfail(
                f"{block.__name__}'s logo {url} is on another site, which this offline check "
                "cannot fetch: ship it in assets/block-logos and use LOGOS_URL"
            )
        with urlopen(f"{logo_server}/{url.removeprefix(f'{LOGOS_URL}/')}", timeout=10) as reply:
            width, height = png_size(reply.read())
        assert width == height, f"{block.__name__}: the logo should be a square image"
        assert 1000 > width > 45, f"{block.__name__}: the logo is {width}px wide"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG whose chunks' checksums hold and whose pixel data inflates
    to exactly its rows (non-interlaced, 8 bits per sample: what a logo needs)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, chunks, idat = 8, [], b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad checksum in the {kind!r} chunk"
        chunks.append(kind)
        idat += body if kind == b"IDAT" else b""
        offset += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND", chunks
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    assert depth == 8 and interlace == 0, (depth, interlace)
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    assert len(zlib.decompress(idat)) == height * (1 + width * channels), "truncated pixels"
    return width, height


def _register(prefect_api: str, module: str) -> subprocess.CompletedProcess[str]:
    # the CLI imports the code under test (this checkout), not whatever checkout the venv's
    # editable install points at: a worktree shares the main checkout's venv, and registering
    # from that checkout tested its blocks, and failed while its files were mid-change
    return subprocess.run(
        [PREFECT, "block", "register", "-m", module],
        env=subprocess_env(prefect_api, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _assert_registered(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    for slug, cls in BLOCKS.items():
        assert cls.get_block_type_name() in result.stdout
        with get_client(sync_client=True) as client:
            block_type = client.read_block_type_by_slug(slug)
            # the schema of this checkout's class was registered (its checksum covers its fields)
            client.read_block_schema_by_checksum(cls._calculate_schema_checksum())
        assert block_type.name == cls.get_block_type_name()
        assert block_type.code_example and cls.__name__ in block_type.code_example


@pytest.mark.slow
def test_block_register_from_the_package(prefect_api):
    _assert_registered(_register(prefect_api, "prefect_nemo"))


@pytest.mark.slow
def test_block_register_from_the_blocks_module(prefect_api):
    _assert_registered(_register(prefect_api, "prefect_nemo.blocks"))


@pytest.mark.slow
def test_save_load_round_trip_keeps_secrets_secret(prefect_api):
    name = f"roundtrip-{uuid.uuid4().hex[:8]}"
    block = RayJobsCluster(
        dashboard_url="https://ray-head.example:8265/",
        auth_token=TOKEN,
        headers={"X-Proxy-Key": PROXY_KEY},
        token_header="X-Ray-Authorization",
        verify_tls=False,
        max_concurrent_jobs=3,
        runtime_env={"pip": ["numpy"]},
        env={"HF_HOME": "/models/hf"},
        secret_env={"WANDB_API_KEY": WANDB_KEY},
        image_label_selectors={"nvcr.io/nvidia/nemo-rl:*": {"nemo/workload": "rl"}},
        image_label_key="nemo/image",
    )
    block.save(name, overwrite=True)
    block.save(name, overwrite=True)  # overwriting an existing document works too

    loaded = RayJobsCluster.load(name)
    assert loaded.auth_token is not None and loaded.auth_token.get_secret_value() == TOKEN
    assert loaded.headers is not None
    assert loaded.headers.get_secret_value() == {"X-Proxy-Key": PROXY_KEY}
    assert loaded.dashboard_url == "https://ray-head.example:8265"
    assert loaded.token_header == "X-Ray-Authorization"
    assert loaded.verify_tls is False
    assert loaded.max_concurrent_jobs == 3
    assert loaded.runtime_env == {"pip": ["numpy"]}
    assert loaded.env == {"HF_HOME": "/models/hf"}
    assert loaded.secret_env is not None
    assert loaded.secret_env.get_secret_value() == {"WANDB_API_KEY": WANDB_KEY}
    assert loaded.image_label_selectors == {"nvcr.io/nvidia/nemo-rl:*": {"nemo/workload": "rl"}}
    assert loaded.image_label_key == "nemo/image"

    # The backend gets the real values ...
    backend = loaded.backend()
    assert backend._headers["X-Ray-Authorization"] == f"Bearer {TOKEN}"
    assert backend._headers["X-Proxy-Key"] == PROXY_KEY
    assert WANDB_KEY in backend.secrets, "the secret env is masked in what the backend reports"

    # ... and nothing we print or serialise shows them.
    for shown in (
        repr(loaded),
        str(loaded),
        loaded.model_dump_json(),
        repr(block),
        block.model_dump_json(),
    ):
        assert TOKEN not in shown
        assert PROXY_KEY not in shown
        assert WANDB_KEY not in shown

    # The API hands out obfuscated values unless secrets are asked for.
    with get_client(sync_client=True) as client:
        document = client.read_block_document_by_name(
            name, block_type_slug="ray-jobs-cluster", include_secrets=False
        )
    assert TOKEN not in str(document.data) and PROXY_KEY not in str(document.data)
    assert WANDB_KEY not in str(document.data)


@pytest.mark.slow
def test_loaded_block_by_name_string_resolves(prefect_api):
    """A saved block is found by the 'ray-jobs-cluster/<name>' string run_job accepts."""
    from prefect_nemo.tasks import resolve_cluster

    name = f"by-name-{uuid.uuid4().hex[:8]}"
    RayJobsCluster(dashboard_url="http://127.0.0.1:1", auth_token=TOKEN).save(name)
    resolved = resolve_cluster(f"ray-jobs-cluster/{name}")
    assert isinstance(resolved, RayJobsCluster)
    assert resolved.auth_token is not None and resolved.auth_token.get_secret_value() == TOKEN


@pytest.mark.slow
def test_kubernetes_block_keeps_the_kubeconfig_secret(prefect_api):
    token = "k8s-" + "5ecret0fthe0cluster"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://k8s.example:6443"}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    name = f"k8s-{uuid.uuid4().hex[:8]}"
    KubernetesCluster(kubeconfig=kubeconfig, namespace="team-a").save(name)
    loaded = KubernetesCluster.load(name)
    assert loaded.kubeconfig is not None and loaded.kubeconfig.get_secret_value() == kubeconfig
    assert loaded.namespace == "team-a"
    for shown in (repr(loaded), loaded.model_dump_json()):
        assert token not in shown
    with get_client(sync_client=True) as client:
        document = client.read_block_document_by_name(
            name, block_type_slug="kubernetes-cluster", include_secrets=False
        )
    assert token not in str(document.data)


def test_a_rejected_secret_is_not_echoed_in_the_error():
    """A key pasted wrong is refused by field name; none of its text reaches the message."""
    key = "PuTTY-User-Key-File-3: ssh-ed25519 " + "K3YM4T3R14L" * 8
    with pytest.raises(ValueError) as info:
        SlurmCluster(host="login", user="u", account="a", job_dir="/j", identity_key=key)
    assert "identity_key" in str(info.value)
    assert "K3YM4T3R14L" not in str(info.value) and "PuTTY" not in str(info.value)
