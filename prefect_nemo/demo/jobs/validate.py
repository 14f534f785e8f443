"""Checkpoint check: the saved model loads and beats chance on fresh data."""

import argparse
from pathlib import Path

import numpy as np
from common import log_loss, sample

parser = argparse.ArgumentParser()
parser.add_argument("--model", type=Path, required=True)
args = parser.parse_args()

w = np.load(args.model)
x, y = sample(np.random.default_rng(7), 5_000)
loss = log_loss(w, x, y)
print(f"validation loss {loss:.4f} (chance is {np.log(2):.4f})")
if not loss < np.log(2):
    raise SystemExit("the checkpoint is no better than chance")
