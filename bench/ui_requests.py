"""Record the API requests the Prefect UI's flow-run page makes (`python -m bench.ui_requests`).

`bench/scale.py` times "the UI's flow-run page" while 1,000 jobs run: it sends the requests this
script recorded from the real page (Prefect's own UI in Debian's headless Chromium, a finished
flow run with task runs, logs and an artifact), the way the browser sends them. Re-run it after
a Prefect upgrade and compare with `bench.scale.UI_PAGE`: it prints each request the page made
(method, path with ids replaced by their names, JSON body keys) and when it was sent and
answered, relative to the navigation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from prefect_nemo.local_ray import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _serve(home: Path, port: int) -> subprocess.Popen[bytes]:
    """`prefect server start` with the UI, its own home and SQLite database."""
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILE")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_UI_API_URL=f"{url}/api",
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
    )
    prefect = str(Path(sys.executable).parent / "prefect")
    cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    log = open(home / "server.log", "wb")  # the child writes it until it stops
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _a_flow_run(api_url: str) -> dict[str, str]:
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
    env = dict(os.environ, PREFECT_API_URL=api_url)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    runs = httpx.post(f"{api_url}/flow_runs/filter", json={"limit": 1}).json()
    return {"flow_run_id": runs[0]["id"], "flow_id": runs[0]["flow_id"]}


def record() -> list[dict[str, Any]]:
    """Open the page and return the API requests it made, ids replaced by their names."""
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="prefect-nemo-ui-record-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _serve(home, port)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/api/health", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError((home / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        ids = _a_flow_run(f"{url}/api")
        names = {v: "{" + k + "}" for k, v in ids.items()}
        seen: list[dict[str, Any]] = []
        t0 = 0.0
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            page = browser.new_page()
            page.goto(f"{url}/dashboard", wait_until="networkidle")  # the SPA loaded and cached

            def sent(request: Any) -> None:
                if "/api/" in request.url:
                    path = request.url.split("/api", 1)[1]
                    body = request.post_data_json if request.method == "POST" else None
                    seen.append({"method": request.method, "path": path, "body": body,
                                 "sent_s": time.monotonic() - t0, "request": request})  # fmt: skip

            page.on("request", sent)
            t0 = time.monotonic()
            page.goto(f"{url}/runs/flow-run/{ids['flow_run_id']}", wait_until="networkidle")
            page.wait_for_timeout(3000)  # what the page asks after it settled (its polls)
            for item in seen:
                timing = item.pop("request").timing
                item["answered_ms"] = round(timing.get("responseEnd", -1))
            browser.close()
        text = json.dumps(seen)
        for value, name in names.items():
            text = text.replace(value, name)
        return json.loads(_UUID.sub("{other_id}", text))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    for item in record():
        body = item["body"]
        keys = json.dumps(body, sort_keys=True) if body is not None else ""
        print(f"{item['sent_s']:6.2f}s {item['method']:4} {item['path']} {keys}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
