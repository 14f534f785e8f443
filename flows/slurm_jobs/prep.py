"""Data prep job: write a small instruction-tuning set as JSONL shards (stdlib only)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory for the shards")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for shard in range(args.shards):
        rows = []
        for _ in range(args.rows):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
        path = out / f"train-{shard:03d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {path}")
    (out / "_SUCCESS").write_text(json.dumps({"shards": args.shards, "rows": args.rows}))


if __name__ == "__main__":
    main()
