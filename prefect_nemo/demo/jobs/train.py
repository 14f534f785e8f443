"""Training job: full-batch gradient descent on every shard; writes a checkpoint and metrics."""

import argparse
from pathlib import Path

import numpy as np
from common import FEATURES, log_loss, write_json

parser = argparse.ArgumentParser()
parser.add_argument("--data", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--lr", type=float, default=0.5)
args = parser.parse_args()

shards = sorted(args.data.glob("shard-*.npz"))
if not shards:
    raise SystemExit(f"no shards in {args.data}: did data-prep run?")
x = np.concatenate([np.load(s)["x"] for s in shards])
y = np.concatenate([np.load(s)["y"] for s in shards])
w = np.zeros(FEATURES)
for step in range(args.steps + 1):
    if step % 100 == 0:
        print(f"step {step}: loss {log_loss(w, x, y):.4f}", flush=True)
    p = 1.0 / (1.0 + np.exp(-(x @ w)))
    w -= args.lr * x.T @ (p - y) / len(y)
args.out.mkdir(parents=True, exist_ok=True)
np.save(args.out / "model.npy", w)
metrics = {"loss": log_loss(w, x, y), "rows": len(y), "steps": args.steps}
write_json(args.out / "train.json", metrics)
