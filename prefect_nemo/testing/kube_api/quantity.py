"""Resource quantities (`cpu: 500m`, `memory: 1Gi`, `nvidia.com/gpu: 8`) as kube-apiserver stores
them in built-in types: always a string, in canonical form.

The real server decodes each quantity of a Pod or PVC into a fixed-point number that remembers
its kind of suffix (decimal SI, binary SI or a decimal exponent) and writes it back in canonical
form: no fractional digits and the largest suffix that loses nothing, so `8` (a YAML integer)
is stored as "8", `0.5` as "500m", "1024Mi" as "1Gi", "1.5Ki" as "1536". A string that already
reads as canonical is kept as written ("+5" stays "+5"), and the values of a resource list
(requests, limits, overhead, capacity) are rounded up to thousandths first ("1500n" -> "1m").
What this module reproduces was checked value by value on kube-apiserver 1.37 (see
tests/test_kube_api.py, test_quantities_of_built_in_types_are_stored_as_canonical_strings).
Custom resources keep what their schema allows: an `x-kubernetes-int-or-string` 8 stays 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
FORMAT_WRONG = f"quantities must match the regular expression '{PATTERN}'"
_SUFFIX_WRONG = "unable to parse quantity's suffix"

_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exp: suffix for suffix, exp in _DECIMAL_SI.items()}
_BINARY_SI = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
_BINARY_SUFFIX = {power: suffix for suffix, power in _BINARY_SI.items()}
_MAX_INT64 = 2**63 - 1
_SUFFIX_CHARS = frozenset("eEinumkKMGTP")
_NANO = Fraction(1, 10**9)


class QuantityError(ValueError):
    """Not a quantity: the real server refuses the whole object with 400 BadRequest."""


@dataclass(frozen=True)
class _Parsed:
    value: Fraction
    format: str  # "DecimalSI", "BinarySI" or "DecimalExponent"
    text: str | None  # as written, when it is canonical already
    scale: int | None  # power of ten of its last digit when it is exact at nano; else None


def _split(text: str) -> tuple[bool, str, str, str]:
    """(positive, integer digits without leading zeros, fraction digits, suffix)."""
    pos, end, positive = 0, len(text), True
    if text[:1] in ("+", "-"):
        positive, pos = text[0] == "+", 1
    while pos < end and text[pos] == "0":
        pos += 1
    start = pos
    while pos < end and text[pos].isdigit():
        pos += 1
    whole = text[start:pos] or "0"
    fraction = ""
    if pos < end and text[pos] == ".":
        start = pos = pos + 1
        while pos < end and text[pos].isdigit():
            pos += 1
        fraction = text[start:pos]
    suffix_start = pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos].isdigit():
        pos += 1
    if pos < end:
        raise QuantityError(FORMAT_WRONG)
    return positive, whole, fraction, text[suffix_start:]


def _suffix(suffix: str) -> tuple[int, int, str]:
    """(base, exponent, format) of a suffix: 10 ** exponent or 2 ** exponent."""
    if suffix in _DECIMAL_SI:
        return 10, _DECIMAL_SI[suffix], "DecimalSI"
    if suffix in _BINARY_SI:
        return 2, 10 * _BINARY_SI[suffix], "BinarySI"
    if len(suffix) > 1 and suffix[0] in "eE":
        try:
            return 10, int(suffix[1:]), "DecimalExponent"
        except ValueError:
            pass
    raise QuantityError(_SUFFIX_WRONG)


def _parse(raw: Any) -> _Parsed:
    if raw is None:  # JSON null reads as zero
        return _Parsed(Fraction(0), "DecimalSI", None, 0)
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise QuantityError(FORMAT_WRONG)
    # a JSON number is read from its text: what the client wrote (Python writes 1e21 as 1e+21)
    text = raw.strip() if isinstance(raw, str) else repr(raw)
    if not text:
        raise QuantityError(FORMAT_WRONG)
    if text == "0":
        return _Parsed(Fraction(0), "DecimalSI", text, 0)
    positive, whole, fraction, suffix = _split(text)
    base, exponent, fmt = _suffix(suffix)
    digits = whole + fraction
    sign = 1 if positive else -1
    # The real parser takes a fast path for values that fit 18 digits at nano precision or
    # better; only there does it keep the text, when that already is canonical.
    if fmt != "BinarySI" and len(digits) <= 18 and exponent - len(fraction) >= -9:
        scale = exponent - len(fraction)
        canonical = scale % 3 == 0 and not digits.endswith("000") and digits[0] != "0"
        value = sign * int(digits) * Fraction(10) ** scale
        return _Parsed(value, fmt, text if canonical else None, scale)
    if fmt == "BinarySI" and not fraction and 15 - len(whole) - (exponent * 3 // 10) - 1 >= 0:
        amount = int(whole) << exponent
        if amount <= _MAX_INT64:
            canonical = int(whole) & 7 != 0
            return _Parsed(sign * Fraction(amount), fmt, text if canonical else None, 0)
    value = Fraction(int(digits), 10 ** len(fraction)) * Fraction(base) ** exponent
    if value % _NANO:  # finer than nano: rounded away from zero, so that some is some
        value = (value // _NANO + 1) * _NANO
    if fmt == "BinarySI":
        value = min(value, Fraction(_MAX_INT64))  # binary quantities are capped at 2^63-1
        if value < 1:
            fmt = "DecimalSI"
    return _Parsed(sign * value, fmt, None, None)


def _round_up_to_milli(parsed: _Parsed) -> _Parsed:
    """What the defaulting of a resource list does to each value (away from zero)."""
    if parsed.scale is not None and parsed.scale >= -3:
        return parsed
    milli = Fraction(1, 1000)
    magnitude = abs(parsed.value)
    if magnitude % milli:
        magnitude = (magnitude // milli + 1) * milli
    value = magnitude if parsed.value >= 0 else -magnitude
    return _Parsed(value, parsed.format, None, None)


def _canonical(parsed: _Parsed) -> str:
    if parsed.text is not None:
        return parsed.text
    value, fmt = parsed.value, parsed.format
    if value == 0:
        return "0"
    if fmt == "BinarySI" and (abs(value) < 1024 or value.denominator != 1):
        fmt = "DecimalSI"  # a small or fractional binary value reads better in decimal
    if fmt == "BinarySI":
        mantissa, power = int(value), 0
        while abs(mantissa) >= 1024 and mantissa % 1024 == 0 and power < 6:
            mantissa, power = mantissa // 1024, power + 1
        return f"{mantissa}{_BINARY_SUFFIX.get(power, '')}"
    # value = mantissa * 10 ** exponent, with an exponent that is a multiple of 3
    mantissa, exponent = int(value * 10**9), -9
    while abs(mantissa) >= 10 and mantissa % 10 == 0:
        mantissa, exponent = mantissa // 10, exponent + 1
    shift = exponent % 3
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    if fmt == "DecimalSI" and exponent in _DECIMAL_SUFFIX:
        return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
    return f"{mantissa}e{exponent}" if exponent else str(mantissa)


def canonical_quantity(raw: Any, *, resource_list: bool = False) -> str:
    """The string kube-apiserver stores for a quantity written as `raw` (a string or a JSON
    number); `resource_list`: a value of requests/limits/overhead/capacity, rounded up to
    milli. Raises QuantityError for what it refuses."""
    parsed = _parse(raw)
    return _canonical(_round_up_to_milli(parsed) if resource_list else parsed)


def canonicalize(plural: str, obj: dict[str, Any]) -> None:
    """Every quantity of a Pod or a PersistentVolumeClaim in canonical form, in place (the
    other built-in types the loopback server serves have none)."""
    spec = obj.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    lists: list[Any] = []

    def requirements(holder: Any) -> None:
        resources = holder.get("resources") if isinstance(holder, dict) else None
        if isinstance(resources, dict):
            lists.extend((resources.get("limits"), resources.get("requests")))

    if plural == "pods":
        lists.append(spec.get("overhead"))
        requirements(spec)  # pod-level resources
        for key in ("containers", "initContainers", "ephemeralContainers"):
            for container in spec.get(key) or []:
                requirements(container)
        for volume in spec.get("volumes") or []:
            empty_dir = volume.get("emptyDir") if isinstance(volume, dict) else None
            if isinstance(empty_dir, dict) and empty_dir.get("sizeLimit") is not None:
                empty_dir["sizeLimit"] = canonical_quantity(empty_dir["sizeLimit"])
    elif plural == "persistentvolumeclaims":
        requirements(spec)
        status = obj.get("status")
        if isinstance(status, dict):
            lists.extend((status.get("capacity"), status.get("allocatedResources")))
    for resource_list in lists:
        if isinstance(resource_list, dict):
            for name, value in resource_list.items():
                resource_list[name] = canonical_quantity(value, resource_list=True)
