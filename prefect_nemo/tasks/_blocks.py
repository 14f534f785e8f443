"""The one block resolver: a block given as an object, as a saved block's name, or left out."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.errors import InvalidJobSpec

B = TypeVar("B", bound=Block)
ClusterLike = ClusterBlock | str | None
KubeLike = KubernetesCluster | ClusterBlock | str


def resolve_block(value: B | str, kind: type[B], field: str, example: str, what: str = "") -> B:
    """`value` as a `kind` block: the block itself, or a saved block named
    '<block-type-slug>/<name>' loaded from the Prefect API. Errors name `field` and show
    `example` (a saved block name); `what` says what kind is (default: its class name)."""
    if isinstance(value, kind):
        return value
    what = what or f"{kind.__name__} block"
    example = f"'{example}'"
    if not isinstance(value, str):
        raise InvalidJobSpec(
            f"{field}: expected a {what} or a saved block name such as {example}, "
            f"got {type(value).__name__}"
        )
    if "/" not in value:
        raise InvalidJobSpec(
            f"{field}={value!r}: name a saved block as '<block-type-slug>/<name>', e.g. {example}"
        )
    try:
        block = Block.load(value)
    except (ValueError, ObjectNotFound) as exc:
        raise InvalidJobSpec(
            f"{field}={value!r}: no such block document ({exc}). Create it in the UI or with "
            "`prefect-nemo blocks apply`, or pass a block object"
        ) from None
    if not isinstance(block, kind):
        raise InvalidJobSpec(f"{field}={value!r} is a {type(block).__name__}, not a {what}")
    return block


def resolve_cluster(cluster: ClusterLike) -> ClusterBlock:
    """Where jobs run: a cluster block, a saved block's name ('ray-jobs-cluster/prod'), or None
    for the embedded default (a local Ray cluster, see local_ray.default_cluster)."""
    if cluster is None:
        from prefect_nemo.local_ray import default_cluster

        return default_cluster()
    if not isinstance(cluster, ClusterBlock | str):
        raise InvalidJobSpec(
            "cluster: expected a cluster block (e.g. RayJobsCluster), a saved block name or "
            f"None, got {type(cluster).__name__}"
        )
    # mypy takes only concrete classes for type[B] (python/mypy#4717); resolve_block only
    # checks isinstance
    return resolve_block(cluster, ClusterBlock, "cluster", "ray-jobs-cluster/prod", "cluster")  # type: ignore[type-abstract]


def resolve_kube(kube: KubeLike) -> KubernetesCluster:
    """A Kubernetes API: a KubernetesCluster, or a cluster block that holds one (a
    KubeRayCluster's `.kubernetes`), given as a block or a saved block's name."""
    block = resolve_block(kube, Block, "kube", "kubernetes-cluster/prod", "KubernetesCluster block")
    if isinstance(block, KubernetesCluster):
        return block
    inner = getattr(block, "kubernetes", None)
    if isinstance(inner, KubernetesCluster):
        return inner
    raise InvalidJobSpec(
        f"kube: {type(block).__name__} holds no Kubernetes credentials: pass a KubernetesCluster "
        "block or a saved block name such as 'kubernetes-cluster/prod'"
    )


def cluster_block_types() -> list[type[ClusterBlock]]:
    """Every cluster block type prefect-nemo ships (RayJobsCluster, KubeRayCluster, ...)."""
    import prefect_nemo.blocks as blocks

    return [
        cls
        for cls in vars(blocks).values()
        if isinstance(cls, type) and issubclass(cls, ClusterBlock) and cls is not ClusterBlock
    ]


def saved_block_names(types: Iterable[type[Block]]) -> list[str]:
    """'<slug>/<name>' of every saved (named) block document of these block types."""
    slugs = {cls.get_block_type_slug() for cls in types}
    with get_client(sync_client=True) as client:
        documents = client.read_block_documents(include_secrets=False)
    return sorted(
        f"{doc.block_type.slug}/{doc.name}"
        for doc in documents
        if doc.block_type is not None and doc.block_type.slug in slugs and not doc.is_anonymous
    )
