"""Evaluation job: accuracy and loss of the checkpoint on one held-out shard."""

import argparse
from pathlib import Path

import numpy as np
from common import log_loss, sample, write_json

parser = argparse.ArgumentParser()
parser.add_argument("--model", type=Path, required=True)
parser.add_argument("--shard", type=int, required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

w = np.load(args.model)
x, y = sample(np.random.default_rng(5000 + args.shard), 10_000)
accuracy = float(np.mean(((x @ w) > 0) == (y > 0.5)))
args.out.mkdir(parents=True, exist_ok=True)
write_json(args.out / f"eval-{args.shard}.json", {"accuracy": accuracy, "loss": log_loss(w, x, y)})
print(f"shard {args.shard}: accuracy {accuracy:.4f}")
