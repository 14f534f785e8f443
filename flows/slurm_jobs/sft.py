"""SFT job stand-in: 'fine-tunes' a lookup model on the prepared shards and writes a checkpoint.

Real SFT (NeMo / Megatron on GPUs) takes the same inputs and outputs: a data dir in, a
checkpoint dir out. This one runs anywhere (stdlib only, CPU) and fails loudly without data.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="directory written by prep.py")
    parser.add_argument("--out", required=True, help="checkpoint directory")
    args = parser.parse_args()
    data = Path(args.data)
    if not (data / "_SUCCESS").exists():
        raise SystemExit(f"no prepared data in {data}: the prep job has not finished")
    table: dict[str, str] = {}
    for shard in sorted(data.glob("train-*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            table[row["prompt"]] = row["completion"]
    correct = sum(str(sum(map(int, p[:-1].split("+")))) == c for p, c in table.items())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.json").write_text(json.dumps(table))
    metrics = {
        "examples": len(table),
        "accuracy": correct / max(1, len(table)),
        "gpus": os.environ.get("SLURM_GPUS_PER_NODE", "0"),
    }
    (out / "metrics.json").write_text(json.dumps(metrics))
    print(f"trained on {len(table)} examples: {metrics}")


if __name__ == "__main__":
    main()
