"""A tiny CPU model server: the demo's logistic-regression model behind HTTP (stdlib only).

    python model_server.py --port 8000 [--model checkpoint/model.npy] [--ignore-sigterm]

GET /health -> {"ok": true}; POST /predict {"x": [[16 floats], ...]} -> {"p": [...]}.
With no --model it trains the model itself (seeded, a fraction of a second; no downloads).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

# the demo jobs' data module (prefect_nemo/demo/jobs), found by path: importing the package
# would import Prefect, which this server does not need
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "prefect_nemo" / "demo" / "jobs"))
from common import FEATURES, sample


def train(steps: int = 200, lr: float = 0.5) -> np.ndarray:
    """Full-batch gradient descent on 4,000 synthetic rows (the demo's data distribution)."""
    x, y = sample(np.random.default_rng(1000), 4000)
    w = np.zeros(FEATURES)
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        w -= lr * x.T @ (p - y) / len(y)
    return w


def make_handler(w: np.ndarray, name: str) -> type[BaseHTTPRequestHandler]:
    """The request handler bound to weights w."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"ok": True, "replica": name})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path != "/predict":
                self._send(404, {"error": "not found"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                x = np.asarray(body["x"], dtype=np.float64).reshape(-1, FEATURES)
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": f"expected {{'x': [[{FEATURES} floats], ...]}}: {exc}"})
                return
            p = 1.0 / (1.0 + np.exp(-(x @ w)))
            self._send(200, {"p": p.tolist(), "replica": name})

        def log_message(self, *args: object) -> None:  # keep the log for errors
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--ignore-sigterm", action="store_true", help="for stop tests")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    w = np.load(args.model) if args.model else train()
    name = os.environ.get("PREFECT_NEMO_PLACEMENT", f"port-{args.port}")
    server = ThreadingHTTPServer((args.host, args.port), make_handler(w, name))
    print(f"serving {name} on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
