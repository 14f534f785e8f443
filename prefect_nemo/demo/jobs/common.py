"""Shared by the demo's jobs: a synthetic logistic-regression problem (numpy only, no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = 16


def true_weights() -> np.ndarray:
    """The weights the data is drawn from; every job derives the same ones."""
    return np.random.default_rng(0).normal(size=FEATURES)


def sample(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n labelled examples: features x and labels y ~ Bernoulli(sigmoid(x @ w))."""
    x = rng.normal(size=(n, FEATURES))
    p = 1.0 / (1.0 + np.exp(-(x @ true_weights())))
    return x, (rng.random(n) < p).astype(np.float64)


def log_loss(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean logistic loss of weights w on (x, y)."""
    z = x @ w
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write data as JSON atomically (readers never see half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
