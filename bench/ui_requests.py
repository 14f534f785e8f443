"""Record the API requests the Prefect UI's flow-run page makes (`python -m bench.ui_requests`).

`bench/scale.py` times "the UI's flow-run page" while 1,000 jobs run: it sends the requests this
script recorded from the real page (Prefect's own UI in Debian's headless Chromium, a finished
flow run with task runs, logs and an artifact), the way the browser sends them. Re-run it after
a Prefect upgrade and compare with `bench.scale._ui_page`: it prints each request the page made
(method, path with ids replaced by their names, JSON body) and when it was sent,
relative to the navigation.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from prefect_nemo.testing.prefect_server import PrefectServer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _a_flow_run(server: PrefectServer) -> dict[str, str]:
    """A finished flow run with 3 task runs, logs and a table artifact; its ids by name."""
    code = (
        "from prefect import flow, task, get_run_logger\n"
        "from prefect.artifacts import create_table_artifact\n"
        "@task\n"
        "def step(i):\n"
        "    get_run_logger().info('step %s', i)\n"
        "    return i\n"
        "@flow\n"
        "def page(n: int = 3):\n"
        "    [step.submit(i).result() for i in range(n)]\n"
        "    create_table_artifact([{'job': 'a', 'state': 'SUCCEEDED'}], key='jobs')\n"
        "page()\n"
    )
    subprocess.run([sys.executable, "-c", code], env=server.env(), check=True, timeout=300)
    runs = httpx.post(f"{server.api_url}/flow_runs/filter", json={"limit": 1}).json()
    return {"flow_run_id": runs[0]["id"], "flow_id": runs[0]["flow_id"]}


def record() -> list[dict[str, Any]]:
    """Open the page and return the API requests it made, ids replaced by their names."""
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="prefect-nemo-ui-record-"))
    try:
        with PrefectServer(home, ui=True) as server:
            ids = _a_flow_run(server)
            seen = _requests_of_the_page(f"{server.ui_url}/runs/flow-run/{ids['flow_run_id']}",
                                         server.ui_url, sync_playwright)  # fmt: skip
    finally:
        shutil.rmtree(home, ignore_errors=True)
    text = json.dumps(seen)
    for name, value in ids.items():
        text = text.replace(value, "{" + name + "}")
    requests: list[dict[str, Any]] = json.loads(_UUID.sub("{other_id}", text))
    return requests


def _requests_of_the_page(url: str, ui_url: str, sync_playwright: Any) -> list[dict[str, Any]]:
    """The API requests of one navigation to `url` (the SPA loaded and cached before)."""
    seen: list[dict[str, Any]] = []
    t0 = 0.0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page()
        page.goto(f"{ui_url}/dashboard", wait_until="networkidle")

        def sent(request: Any) -> None:
            if "/api/" in request.url:
                path = request.url.split("/api", 1)[1]
                body = request.post_data_json if request.method == "POST" else None
                seen.append({"method": request.method, "path": path, "body": body,
                             "sent_s": time.monotonic() - t0})  # fmt: skip

        page.on("request", sent)
        t0 = time.monotonic()
        page.goto(url, wait_until="networkidle")
        page.wait_for_timeout(3000)  # what the page asks after it settled (its polls)
        browser.close()
    return seen


def main() -> int:
    for item in record():
        body = item["body"]
        keys = json.dumps(body, sort_keys=True) if body is not None else ""
        print(f"{item['sent_s']:6.2f}s {item['method']:4} {item['path']} {keys}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
