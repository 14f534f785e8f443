"""Data prep job: write one shard of training data."""

import argparse
from pathlib import Path

import numpy as np
from common import sample

parser = argparse.ArgumentParser()
parser.add_argument("--shard", type=int, required=True)
parser.add_argument("--rows", type=int, default=20_000)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

x, y = sample(np.random.default_rng(1000 + args.shard), args.rows)
args.out.mkdir(parents=True, exist_ok=True)
np.savez(args.out / f"shard-{args.shard}.npz", x=x, y=y)
print(f"shard {args.shard}: {len(y)} rows, {y.mean():.3f} positive")
