"""Supervised fine-tuning, CPU-sized: a softmax "next token" model trained on this rank's shard.

Runs alone (`python sft.py`) or under torchrun (RANK / WORLD_SIZE pick the shard). Rank 0
writes the checkpoint and metrics when --out is given.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from sftdata import CONTEXT, VOCAB, loss, shard, softmax

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--out", type=Path)
parser.add_argument("--step-delay-s", type=float, default=0.0, help="slow down (for demos)")
parser.add_argument("--fail-at-step", type=int, help="exit 3 at this step (for demos)")
args = parser.parse_args()

rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
node = os.environ.get("PET_NODE_RANK", "0")
x, y = shard(rank, world)
w = np.zeros((VOCAB * CONTEXT, VOCAB))
print(f"sft: rank {rank}/{world} on node {node}: {len(y)} examples", flush=True)
for step in range(args.steps + 1):
    if args.fail_at_step is not None and step == args.fail_at_step:
        print(f"sft: rank {rank}: giving up at step {step} (--fail-at-step)", flush=True)
        sys.exit(3)
    if step % 50 == 0:
        print(f"sft: rank {rank} step {step}: loss {loss(w, x, y):.4f}", flush=True)
    p = softmax(x @ w)
    p[np.arange(len(y)), y] -= 1.0
    w -= args.lr * x.T @ p / len(y)
    if args.step_delay_s:
        time.sleep(args.step_delay_s)
final = loss(w, x, y)
print(f"sft: rank {rank} done: final loss {final:.4f}", flush=True)
if args.out is not None and rank == 0:
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "model.npy", w)
    (args.out / "metrics.json").write_text(json.dumps({"loss": final, "steps": args.steps}))
