"""DynamoGraphDeployment (DGD) manifests, pure: load one from a (multi-document) file, render it
(name, namespace, labels, deep-merged overrides, image as a default only, imagePullSecrets; never
`serviceAccountName`, which the operator sets per DGD), validate it, and derive its frontend.

Both stored shapes are handled: v1alpha1 keeps `spec.services` (a map of service name to
config, the container under `extraPodSpec.mainContainer`); v1beta1 keeps `spec.components`
(a list of `{name, type, podTemplate}` with the container named `main`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from prefect_nemo import kube
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.names import check_namespace, is_dns1035_label, resource_name

DGD_KIND = "DynamoGraphDeployment"
DGD_GROUP = "nvidia.com"
VERSIONS = ("v1alpha1", "v1beta1")
FRONTEND_TYPE = "frontend"
FRONTEND_PORT = 8000
MAIN_CONTAINER = "main"  # v1beta1: the container the operator treats as the workload

_MAX_NAME = 63


# ---------------------------------------------------------------------------------------------
# Loading and rendering (pure: no API call)


def dgd_kind(version: str = "v1alpha1") -> kube.Kind:
    """The Kind of DGDs at `version` (validated)."""
    _check_version(version)
    return kube.dgd_kind(version)


def load_dgd(path: str | Path, *, name: str | None = None) -> dict[str, Any]:
    """Read a DGD manifest from a YAML file, picking the DGD out of a multi-document file.

    Dynamo recipes often ship a DGD next to a benchmark Pod or a ConfigMap. With several DGDs
    in one file, `name` chooses one by `metadata.name`.
    """
    file = Path(path)
    if not file.is_file():
        raise InvalidJobSpec(f"DGD manifest {file}: no such file")
    try:
        docs = [d for d in yaml.safe_load_all(file.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidJobSpec(f"DGD manifest {file}: not valid YAML: {exc}") from None
    dgds = [d for d in docs if isinstance(d, dict) and d.get("kind") == DGD_KIND]
    if not dgds:
        kinds = [d.get("kind") if isinstance(d, dict) else type(d).__name__ for d in docs]
        raise InvalidJobSpec(
            f"DGD manifest {file}: no document of kind {DGD_KIND} (found kinds: {kinds})"
        )
    if name is not None:
        chosen = [d for d in dgds if (d.get("metadata") or {}).get("name") == name]
        if not chosen:
            names = [(d.get("metadata") or {}).get("name") for d in dgds]
            raise InvalidJobSpec(f"DGD manifest {file}: no {DGD_KIND} named {name!r} in {names}")
        dgds = chosen
    if len(dgds) > 1:
        names = [(d.get("metadata") or {}).get("name") for d in dgds]
        raise InvalidJobSpec(
            f"DGD manifest {file} holds {len(dgds)} {DGD_KIND}s ({names}): pass the name of "
            "the one to deploy"
        )
    return dgds[0]


def deep_merge(base: Any, override: Any) -> Any:
    """`override` merged into a copy of `base`: dicts merge key by key, lists and scalars
    replace, a None value deletes the key.

    One extension for v1beta1's `spec.components` (a list of named dicts): a dict override on
    such a list merges into the entries by `name` (`{"components": {"worker": {...}}}`).
    """
    if isinstance(override, Mapping) and isinstance(base, list) and _named_list(base):
        merged_list = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(merged_list)}
        for key, value in override.items():
            if value is None:
                merged_list = [i for i in merged_list if i["name"] != key]
                index = {item["name"]: i for i, item in enumerate(merged_list)}
            elif key in index:
                merged_list[index[key]] = deep_merge(merged_list[index[key]], value)
            else:
                merged_list.append({"name": key, **copy.deepcopy(dict(value))})
                index[key] = len(merged_list) - 1
        return merged_list
    if not isinstance(override, Mapping) or not isinstance(base, Mapping):
        return copy.deepcopy(override)
    merged = {k: copy.deepcopy(v) for k, v in base.items()}
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif key in merged:
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = _drop_nones(copy.deepcopy(value))
    return merged


def _drop_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    return value


def _named_list(items: list[Any]) -> bool:
    return bool(items) and all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
    )


def render_dgd(
    manifest: Mapping[str, Any],
    *,
    namespace: str,
    name: str | None = None,
    labels: Mapping[str, str] | None = None,
    flow_run_id: str | None = None,
    image: str | None = None,
    image_pull_secrets: Iterable[str] = (),
    overrides: Mapping[str, Any] | None = None,
    version: str = "v1alpha1",
) -> dict[str, Any]:
    """The DGD to apply: a validated copy of `manifest` with our settings on it.

    `overrides` deep-merge into the whole document (`{"spec": {...}}`, see `deep_merge`).
    `image` is only a default for containers that name none; `image_pull_secrets` are added to
    every pod. Labels: the manifest's, then `labels`, then ours (managed-by, flow run id).
    `serviceAccountName` is left exactly as the user wrote it: we never add one.
    Raises InvalidJobSpec before any API call when something is wrong.
    """
    _check_version(version)
    check_namespace(namespace)
    if not isinstance(manifest, Mapping):
        raise InvalidJobSpec(f"DGD manifest: expected a mapping, got {type(manifest).__name__}")
    doc = (
        deep_merge(dict(manifest), dict(overrides)) if overrides else copy.deepcopy(dict(manifest))
    )
    _check_api_version(doc, version)
    meta = doc.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise InvalidJobSpec("DGD manifest: metadata must be a mapping")
    if name is not None:
        meta["name"] = name
    meta["namespace"] = namespace
    meta["labels"] = {
        **(meta.get("labels") or {}),
        **dict(labels or {}),
        **kube.managed_labels(flow_run_id),
    }
    for key in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
        meta.pop(key, None)
    doc.pop("status", None)
    validate_dgd(doc, version)
    secrets = list(dict.fromkeys(image_pull_secrets))
    if image is None and not secrets:
        return doc
    for pod, container in _pod_specs(doc, version, with_container=image is not None):
        if image is not None and container is not None and not container.get("image"):
            container["image"] = image
        if secrets:
            present = pod.setdefault("imagePullSecrets", [])
            known = {s.get("name") for s in present if isinstance(s, dict)}
            present.extend({"name": s} for s in secrets if s not in known)
    return doc


def _pod_specs(
    doc: dict[str, Any], version: str, *, with_container: bool
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(pod spec, main container) of every service, created where missing.

    The main container is created only when `with_container` (to give it the default image).
    """
    found: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for _, svc in _services(doc, version):
        if version == "v1alpha1":
            pod = _child(svc, "extraPodSpec")
            container = pod.get("mainContainer")
            if container is None and with_container:
                container = pod["mainContainer"] = {}
        else:
            pod = _child(_child(svc, "podTemplate"), "spec")
            container = next(
                (c for c in pod.get("containers") or [] if c.get("name") == MAIN_CONTAINER), None
            )
            if container is None and with_container:
                container = {"name": MAIN_CONTAINER}
                pod.setdefault("containers", []).append(container)
        found.append((pod, container))
    return found


def _child(parent: dict[str, Any], key: str) -> dict[str, Any]:
    child = parent.get(key)
    if child is None:
        child = parent[key] = {}
    if not isinstance(child, dict):
        raise InvalidJobSpec(f"DGD manifest: {key} must be a mapping, got {type(child).__name__}")
    return child


# ---------------------------------------------------------------------------------------------
# Validation


def _check_version(version: str) -> None:
    if version not in VERSIONS:
        raise InvalidJobSpec(
            f"DGD version {version!r} is not known: use one of {list(VERSIONS)} "
            "(v1alpha1 stores spec.services, v1beta1 spec.components)"
        )


def _check_api_version(doc: Mapping[str, Any], version: str) -> None:
    if doc.get("kind") != DGD_KIND:
        raise InvalidJobSpec(f"DGD manifest: kind is {doc.get('kind')!r}, expected {DGD_KIND}")
    want = f"{DGD_GROUP}/{version}"
    if doc.get("apiVersion") != want:
        raise InvalidJobSpec(
            f"DGD manifest {_name_of(doc)!r}: apiVersion is {doc.get('apiVersion')!r} but "
            f"version={version!r} asks for {want}: pass the matching version (the two store "
            "different shapes: v1alpha1 spec.services, v1beta1 spec.components)"
        )


def _name_of(doc: Mapping[str, Any]) -> str:
    meta = doc.get("metadata")
    return str(meta.get("name", "")) if isinstance(meta, Mapping) else ""


def check_dgd_name(name: Any) -> str:
    """`name` if it is a valid DGD name as is; InvalidJobSpec naming the rule otherwise.

    The operator names the frontend Service `<dgd>-frontend` (a DNS-1035 label), so a DGD name
    must be a lowercase RFC 1123 label that starts with a letter, short enough for that suffix.
    We never rename a name the user chose.
    """
    if not isinstance(name, str) or not name:
        raise InvalidJobSpec("DGD metadata.name is missing: set it in the manifest or pass name=")
    room = _MAX_NAME - len("-frontend")
    if resource_name(name, room) != name or not is_dns1035_label(name):
        raise InvalidJobSpec(
            f"DGD name {name!r} is not valid: use lowercase letters, digits and '-', starting "
            f"with a letter and ending with a letter or digit, at most {room} characters (the "
            f"operator adds '-frontend' for the frontend Service). For example: "
            f"{resource_name(name, room)!r}"
        )
    return name


def _services(doc: Mapping[str, Any], version: str) -> list[tuple[str, dict[str, Any]]]:
    """(service name, service dict) for every service/component, validated for shape."""
    spec = doc.get("spec")
    name = _name_of(doc)
    if not isinstance(spec, Mapping):
        raise InvalidJobSpec(f"DGD {name!r}: spec is missing")
    ours, theirs, other = (
        ("services", "components", "v1beta1") if version == "v1alpha1"
        else ("components", "services", "v1alpha1")
    )  # fmt: skip
    if theirs in spec:
        raise InvalidJobSpec(
            f"DGD {name!r}: spec.{theirs} is the {other} shape; pass version={other!r} or use "
            f"spec.{ours}"
        )
    if version == "v1alpha1":
        services = spec.get("services")
        if not isinstance(services, Mapping) or not services:
            raise InvalidJobSpec(f"DGD {name!r}: spec.services must be a non-empty map")
        for key, svc in services.items():
            if not isinstance(svc, dict):
                raise InvalidJobSpec(f"DGD {name!r}: spec.services.{key} must be a map")
        return list(services.items())
    components = spec.get("components")
    if not isinstance(components, list) or not components:
        raise InvalidJobSpec(f"DGD {name!r}: spec.components must be a non-empty list")
    out: list[tuple[str, dict[str, Any]]] = []
    for i, comp in enumerate(components):
        if not isinstance(comp, dict) or not isinstance(comp.get("name"), str):
            raise InvalidJobSpec(f"DGD {name!r}: spec.components[{i}] must be a map with a name")
        out.append((comp["name"], comp))
    names = [n.lower() for n, _ in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidJobSpec(f"DGD {name!r}: duplicate component names {dupes}")
    return out


def _component_type(svc: Mapping[str, Any], version: str) -> str | None:
    value = svc.get("type") if version == "v1beta1" else None
    return value or svc.get("componentType")


def validate_dgd(doc: Mapping[str, Any], version: str = "v1alpha1") -> None:
    """Raise InvalidJobSpec unless `doc` is a DGD we can deploy and wait on.

    Checks the version and kind, the name, the services' shape, and that exactly one service
    is the frontend (the readiness probe and the URL we hand to training depend on it).
    """
    _check_version(version)
    _check_api_version(doc, version)
    name = check_dgd_name(_name_of(doc))
    for key, svc in _services(doc, version):
        _check_replicas(svc, f"DGD {name!r} service {key!r}")
    frontends = _frontends(doc, version)
    if len(frontends) != 1:
        what = "no service" if not frontends else f"{len(frontends)} services {frontends}"
        raise InvalidJobSpec(
            f"DGD {name!r}: {what} with componentType 'frontend'; exactly one frontend is "
            "needed (its Service is what training talks to)"
        )
    service = f"{name}-{frontends[0].lower()}"
    if not is_dns1035_label(service, _MAX_NAME):
        raise InvalidJobSpec(
            f"DGD {name!r}: the frontend service key {frontends[0]!r} gives Service name "
            f"{service!r}, which is not a valid DNS-1035 name of at most {_MAX_NAME} characters"
        )


def _check_replicas(svc: Mapping[str, Any], where: str) -> None:
    """The operator turns `replicas` (and autoscaling's bounds) into the replicas of the
    service's Deployment, which Kubernetes refuses when negative ("must be greater than or
    equal to 0"): the DGD would be stored and never become ready."""
    autoscaling = svc.get("autoscaling")
    bounds = autoscaling if isinstance(autoscaling, Mapping) else {}
    for field, value in (("replicas", svc.get("replicas")),
                         ("autoscaling.minReplicas", bounds.get("minReplicas")),
                         ("autoscaling.maxReplicas", bounds.get("maxReplicas"))):  # fmt: skip
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidJobSpec(f"{where}: {field} is {value!r}: give a whole number of pods >= 0")


def _frontends(doc: Mapping[str, Any], version: str) -> list[str]:
    found = []
    for key, svc in _services(doc, version):
        ctype = _component_type(svc, version)
        if ctype == FRONTEND_TYPE or (ctype is None and key.lower() == FRONTEND_TYPE):
            found.append(key)
    return found


# ---------------------------------------------------------------------------------------------
# The frontend


def frontend_service(manifest: Mapping[str, Any], version: str | None = None) -> str:
    """The Kubernetes Service name of the DGD's frontend: `<dgd>-<frontend key lowercased>`."""
    version = version or str(manifest.get("apiVersion", "")).rpartition("/")[2] or "v1alpha1"
    validate_dgd(manifest, version)
    return f"{_name_of(manifest)}-{_frontends(manifest, version)[0].lower()}"


def frontend_url(
    name: str, namespace: str, *, service: str | None = None, port: int = FRONTEND_PORT
) -> str:
    """The in-cluster URL of a DGD's frontend (OpenAI-compatible HTTP, port 8000 by default)."""
    return f"http://{service or f'{name}-frontend'}.{namespace}.svc.cluster.local:{port}"


def resolve_frontend_url(
    manifest: Mapping[str, Any],
    explicit: str | None = None,
    version: str | None = None,
    *,
    port: int = FRONTEND_PORT,
) -> str:
    """The URL training should use: the DGD's frontend, or `explicit` when it agrees.

    An explicit in-cluster URL (`<svc>.<ns>.svc[.cluster.local]`) that names another Service,
    namespace or port than the DGD's frontend is a conflict: InvalidJobSpec. Any other explicit
    URL (an ingress, a gateway) is the user's choice and is used as is. `port` is the
    frontend's port (checked against what the manifest says the frontend listens on).
    """
    meta = manifest.get("metadata") or {}
    service = frontend_service(manifest, version)
    check_frontend_port(manifest, port, version)
    derived = frontend_url(meta.get("name", ""), meta.get("namespace", ""), service=service,
                           port=port)  # fmt: skip
    if not explicit:
        return derived
    parts = urlsplit(explicit)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidJobSpec(f"frontend_url {explicit!r} is not an http(s) URL")
    host = parts.hostname.split(".")
    if len(host) >= 3 and host[2] == "svc":
        explicit_port = parts.port or (443 if parts.scheme == "https" else 80)
        if (host[0], host[1], explicit_port) != (service, meta.get("namespace"), port):
            raise InvalidJobSpec(
                f"frontend_url {explicit!r} disagrees with DGD {meta.get('name')!r}, whose "
                f"frontend is {derived}: drop frontend_url to use the DGD's frontend, or fix it"
            )
    return explicit


def check_frontend_port(manifest: Mapping[str, Any], port: Any, version: str | None = None) -> int:
    """`port` if the DGD's frontend listens there; InvalidJobSpec naming the field otherwise.

    The Dynamo frontend "accepts either --http-port flag or DYN_HTTP_PORT env var (defaults to
    8000)": a port the manifest does not say the frontend listens on would be probed (and
    handed to training) in vain.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidJobSpec(
            f"frontend_port {port!r} is not a TCP port: give an integer from 1 to 65535 (the "
            f"port the DGD's frontend serves on; Dynamo's default is {FRONTEND_PORT})"
        )
    version = version or str(manifest.get("apiVersion", "")).rpartition("/")[2] or "v1alpha1"
    key = _frontends(manifest, version)[0]
    declared, where = _declared_port(dict(_services(manifest, version))[key], manifest, version)
    if declared != port:
        raise InvalidJobSpec(
            f"frontend_port {port}: DGD {_name_of(manifest)!r}'s frontend {key!r} listens on "
            f"{declared} ({where}): set frontend_port={declared}, or change {where}"
        )
    return port


def _declared_port(
    svc: Mapping[str, Any], doc: Mapping[str, Any], version: str
) -> tuple[int | None, str]:
    """(port, where it is said) of a frontend: its `--http-port` argument, else DYN_HTTP_PORT
    in its env (the container's, the service's, the graph's), else Dynamo's default."""
    if version == "v1alpha1":
        main = ((svc.get("extraPodSpec") or {}).get("mainContainer")) or {}
    else:
        containers = ((svc.get("podTemplate") or {}).get("spec") or {}).get("containers") or []
        main = next((c for c in containers if c.get("name") == MAIN_CONTAINER), {})
    args = [str(a) for a in [*(main.get("command") or []), *(main.get("args") or [])]]
    for i, arg in enumerate(args):
        if arg == "--http-port" and i + 1 < len(args):
            return _as_port(args[i + 1]), "its --http-port argument"
        if arg.startswith("--http-port="):
            return _as_port(arg.split("=", 1)[1]), "its --http-port argument"
    spec = doc.get("spec") or {}
    for env in (main.get("env"), svc.get("envs"), spec.get("envs")):
        for item in env or []:
            if isinstance(item, Mapping) and item.get("name") == "DYN_HTTP_PORT":
                return _as_port(item.get("value")), "DYN_HTTP_PORT in its env"
    return FRONTEND_PORT, "Dynamo's default: no --http-port or DYN_HTTP_PORT"


def _as_port(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None
