"""Aggregation job: combine the per-shard evaluation results into one metrics file."""

import argparse
import json
from pathlib import Path

from common import write_json

parser = argparse.ArgumentParser()
parser.add_argument("--evals", type=Path, required=True)
args = parser.parse_args()

results = [json.loads(p.read_text()) for p in sorted(args.evals.glob("eval-*.json"))]
if not results:
    raise SystemExit(f"no evaluation results in {args.evals}")
metrics = {
    "accuracy": sum(r["accuracy"] for r in results) / len(results),
    "loss": sum(r["loss"] for r in results) / len(results),
    "shards": len(results),
}
write_json(args.evals / "metrics.json", metrics)
print(json.dumps(metrics))
