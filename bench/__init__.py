"""Benchmarks: ours against the raw client, measured in the same run (docs/guides/benchmarks.md)."""

import os

# The test servers the benches start send no telemetry: its heartbeat writes to the server's
# SQLite while the run does and logs "database is locked" tracebacks (no internet here anyway).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
