"""The small real function the NeMo-Run task tests run on every backend (shipped as working_dir)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from pydantic import SecretStr


def expected(n: int, seed: int) -> float:
    """The metric `summarize` reports, computed here to compare."""
    return float(np.round(np.random.default_rng(seed).normal(size=n).std(), 6))


def summarize(n: int, seed: int, out: str, token: SecretStr | None = None) -> None:
    """numpy work that writes a file and prints a metric; proves the secret arrived by its hash."""
    std = expected(n, seed)
    secret = token.get_secret_value() if isinstance(token, SecretStr) else ""
    record = {"n": n, "std": std, "token_sha256": hashlib.sha256(secret.encode()).hexdigest()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record))
    print(f"metric std={std}", flush=True)
