"""The one naming scheme: deterministic job ids and the name sanitizer every backend uses."""

from __future__ import annotations

import hashlib
import re

from prefect_nemo.errors import InvalidJobSpec

_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_NOT_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")
# a Slurm partition or QOS as we pass it: nothing that ends an #SBATCH line or means more to a shell
_SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_LABEL = 63  # RFC 1123 / 1035 label length; Kubernetes names reuse it
_HASH_LEN = 8
_ATTEMPT_ROOM = 4  # "-r99"


def dns_label(text: str, max_len: int = MAX_LABEL) -> str:
    """Lowercase `text` into an RFC 1035 label: [a-z0-9-], starts with a letter, <= max_len."""
    label = _NOT_LABEL.sub("-", text.lower()).strip("-")
    label = re.sub(r"-{2,}", "-", label)
    if not label or not label[0].isalpha():
        label = f"j-{label}".rstrip("-")
    return label[:max_len].rstrip("-")


def resource_name(text: str, max_len: int = MAX_LABEL) -> str:
    """A valid Kubernetes object name (RFC 1035 label, also a valid RFC 1123 name) for `text`.

    A name that is already valid is kept; any other gets a stable hash of the original appended,
    so two different inputs never sanitise to the same name.
    """
    label = dns_label(text, max_len)
    if label == text:
        return label
    digest = stable_hash(text)
    return f"{dns_label(text, max_len - _HASH_LEN - 1)}-{digest}"


def is_dns1035_label(text: str, max_len: int = MAX_LABEL) -> bool:
    """True for a valid RFC 1035 label (Service, RayJob and TrainJob names): [a-z0-9-],
    starts with a letter, ends alphanumeric, at most max_len characters."""
    return len(text) <= max_len and bool(_DNS1035.match(text))


def is_dns1123_subdomain(text: str, max_len: int = 253) -> bool:
    """True for a valid RFC 1123 subdomain (most object names)."""
    return len(text) <= max_len and bool(_DNS1123.match(text))


def is_dns1123_label(text: str) -> bool:
    """True for a valid RFC 1123 label (namespace names): [a-z0-9-], alphanumeric at both ends,
    at most 63 characters."""
    return len(text) <= MAX_LABEL and bool(_DNS1123_LABEL.match(text))


def check_namespace(namespace: object, where: str = "namespace") -> str:
    """`namespace` when Kubernetes could name a namespace so; InvalidJobSpec naming `where` and
    the fix otherwise (before any request: the API server would answer 404 for a name no
    namespace can have, which reads like a missing namespace)."""
    if isinstance(namespace, str) and is_dns1123_label(namespace):
        return namespace
    example = dns_label(namespace) if isinstance(namespace, str) and namespace else "default"
    raise InvalidJobSpec(
        f"{where}: {namespace!r} is not a Kubernetes namespace name: use a lowercase RFC 1123 "
        "label (letters a-z, digits and '-', starting and ending with a letter or digit, at "
        f"most {MAX_LABEL} characters), e.g. {example!r}"
    )


def is_label_key(key: str) -> bool:
    """True for a valid Kubernetes label key: an optional DNS prefix and a 63-char name."""
    prefix, _, name = key.rpartition("/")
    if prefix and not is_dns1123_subdomain(prefix):
        return False
    return len(name) <= MAX_LABEL and bool(_LABEL_NAME.match(name))


def is_slurm_name(text: str, *, many: bool = False) -> bool:
    """True for a Slurm partition or QOS name (letters, digits, '_', '-', '.'); `many`: a
    comma-separated list of them (sbatch --partition takes one)."""
    return all(_SLURM_NAME.fullmatch(name) for name in (text.split(",") if many else [text]))


def label_value(value: str) -> str:
    """A valid label value from any string: [A-Za-z0-9-_.], <= 63, alphanumeric at both ends."""
    cleaned = _NOT_LABEL_VALUE.sub("-", value)[:MAX_LABEL]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cleaned)


def stable_hash(*parts: str, length: int = _HASH_LEN) -> str:
    """A short hex digest of the parts (NUL-separated so ('ab','c') != ('a','bc'))."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:length]


def secret_hash(*parts: str) -> str:
    """A digest that tells secret values apart without revealing them, long enough that two
    never collide (a registry keyed by credentials must not join two users)."""
    return stable_hash(*parts, length=32)


def job_id(
    scope: str, key: str, *, readable: str = "", attempt: int = 0, max_len: int = MAX_LABEL
) -> str:
    """Deterministic job id of `key` within `scope` (an experiment or a flow run).

    Identity is the hash of (scope, key); `readable` (e.g. the experiment name) only makes the
    id easier to read; the id fits max_len (a backend's name limit). Attempt n > 0 (a
    resubmission after a failed attempt) appends '-r<n>'.
    """
    digest = stable_hash(scope, key)
    room = max_len - _HASH_LEN - 1 - _ATTEMPT_ROOM
    head = dns_label(f"{readable}-{key}" if readable else key, room)
    base = f"{head}-{digest}"
    return base if attempt == 0 else f"{base}-r{attempt}"
