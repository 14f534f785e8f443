"""The kit's CRDs stand on their own: shipped in the package (no folder beside the clone), each
file named in SOURCES.md, and byte for byte the CRDs of the Go modules the control plane builds
(so the schemas the loopback server enforces are the operator's own)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from prefect_nemo.testing.control_plane import build
from prefect_nemo.testing.kube_api import PACKAGED_CRDS, crd_dir
from tests.conftest import IN_CI

# the kit's file -> (Go module@version that carries it, its path in the module)
FROM_MODULES = {
    "ray.io_rayjobs.yaml": (f"github.com/ray-project/kuberay/ray-operator@{build.KUBERAY}",
                            "config/crd/bases"),
    "ray.io_rayclusters.yaml": (f"github.com/ray-project/kuberay/ray-operator@{build.KUBERAY}",
                                "config/crd/bases"),
    **{f"trainer.kubeflow.org_{kind}.yaml": (f"github.com/kubeflow/trainer/v2@{build.TRAINER}",
                                             "manifests/base/crds")
       for kind in ("trainjobs", "trainingruntimes", "clustertrainingruntimes")},
    "jobset.x-k8s.io_jobsets.yaml": (f"sigs.k8s.io/jobset@{build.JOBSET}",
                                     "config/components/crd/bases"),
    # in a folder of their own: the loopback server does not load them (control_plane/kueue.py)
    **{f"kueue/kueue.x-k8s.io_{plural}.yaml": (f"sigs.k8s.io/kueue@{build.KUEUE}",
                                               "config/components/crd/bases")
       for plural in ("admissionchecks", "clusterqueues", "cohorts", "localqueues",
                      "multikueueclusters", "multikueueconfigs", "provisioningrequestconfigs",
                      "resourceflavors", "topologies", "workloadpriorityclasses", "workloads")},
}  # fmt: skip


def test_the_default_crds_are_the_packaged_ones(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PREFECT_NEMO_CRDS", raising=False)
    assert crd_dir() == PACKAGED_CRDS
    assert PACKAGED_CRDS.is_relative_to(Path(__import__("prefect_nemo").__file__).parent)


def test_prefect_nemo_crds_overrides_and_a_bad_one_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("PREFECT_NEMO_CRDS", str(tmp_path))
    assert crd_dir() == tmp_path
    monkeypatch.setenv("PREFECT_NEMO_CRDS", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"PREFECT_NEMO_CRDS=.*is not a folder"):
        crd_dir()


def test_every_crd_file_is_a_crd_named_in_sources():
    sources = (PACKAGED_CRDS / "SOURCES.md").read_text()
    files = sorted([*PACKAGED_CRDS.glob("*.yaml"), *PACKAGED_CRDS.glob("kueue/*.yaml")])
    assert len(files) >= 18
    for path in files:
        name = path.relative_to(PACKAGED_CRDS).as_posix()
        assert f"`{name}`" in sources, f"{name} has no row in SOURCES.md"
        doc = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        assert doc["kind"] == "CustomResourceDefinition", path.name
        assert f"{doc['spec']['names']['plural']}.{doc['spec']['group']}" == doc["metadata"]["name"]
    for version in (build.KUBERAY, build.TRAINER, build.JOBSET, build.KUEUE):
        assert version in sources, f"SOURCES.md does not name the built version {version}"


def test_no_module_of_the_package_looks_outside_it():
    """A clone (or a wheel) alone must work: nothing may read a `shared/` folder beside it."""
    root = PACKAGED_CRDS.parents[1]
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "../shared" in (text := p.read_text()) or "shared/crds" in text]  # fmt: skip
    assert offenders == []


def _module_cache() -> Path | None:
    go = build.go_binary()
    if go is None:
        return None
    out = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, timeout=60)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


@pytest.mark.parametrize("name", sorted(FROM_MODULES))
def test_the_crds_are_those_of_the_module_version_built(name: str):
    """`make control-plane` downloads these modules to build the operators; their CRDs must be
    the kit's, byte for byte (a version bump in build.py without new CRDs fails here)."""
    module, folder = FROM_MODULES[name]
    cache = _module_cache()
    source = cache / module / folder / Path(name).name if cache else None
    if source is None or not source.is_file():
        reason = f"{module} is not in the Go module cache (run `make control-plane`)"
        if IN_CI and shutil.which("go") and not os.environ.get("PREFECT_NEMO_CRDS"):
            pytest.fail(reason)
        pytest.skip(reason)
    assert (PACKAGED_CRDS / name).read_bytes() == source.read_bytes(), (
        f"{name} differs from {module}'s {folder}/{name}: copy it from there"
    )
