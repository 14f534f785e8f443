"""Synthetic SFT data: prompt tokens → response token, drawn from a fixed teacher (numpy only)."""

from __future__ import annotations

import numpy as np

VOCAB = 32
CONTEXT = 4


def teacher() -> np.ndarray:
    """The weights the responses come from; every rank derives the same ones."""
    return np.random.default_rng(0).normal(size=(VOCAB * CONTEXT, VOCAB)) * 2.0


def one_hot(prompts: np.ndarray) -> np.ndarray:
    """(n, CONTEXT) token ids → (n, VOCAB * CONTEXT) features."""
    n = len(prompts)
    x = np.zeros((n, VOCAB * CONTEXT))
    x[np.arange(n)[:, None], np.arange(CONTEXT) * VOCAB + prompts] = 1.0
    return x


def shard(rank: int, world: int, n: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of the examples (features, response ids)."""
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, VOCAB, size=(n, CONTEXT))
    x = one_hot(prompts)
    y = np.argmax(x @ teacher() + rng.gumbel(size=(n, VOCAB)), axis=1)
    return x[rank::world], y[rank::world]


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def loss(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy of the responses."""
    p = softmax(x @ w)
    return float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
