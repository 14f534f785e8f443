"""The `prefect-nemo` command: run the demo on the embedded default, manage the local server,
apply block documents (`blocks apply`) and deployments (`deploy`), render what a job or a
Dynamo graph would send (`render`, a dry run), clean up what no run needs (`cleanup`), and
check blocks before their first job (`doctor`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

STATE_DIR = Path(".prefect-nemo")
SERVER_FILE = STATE_DIR / "server.json"


# -- a local Prefect server that outlives the demo, so its runs can be looked at in the UI ------


def _healthy(api_url: str) -> bool:
    try:
        return requests.get(f"{api_url}/health", timeout=2).ok
    except requests.RequestException:
        return False


def ensure_prefect_server(timeout_s: float = 120.0) -> tuple[str, str]:
    """(API URL, UI URL) of a Prefect server: the configured one, ours if running, or a new one."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    configured = PREFECT_API_URL.value()
    if configured:
        return str(configured), str(PREFECT_UI_URL.value() or configured.removesuffix("/api"))
    if SERVER_FILE.exists():
        known = json.loads(SERVER_FILE.read_text())
        if _healthy(known["api_url"]):
            return known["api_url"], known["ui_url"]
    from prefect_nemo.local_ray import free_port

    port = 4200 if _port_free(4200) else free_port()
    ui_url = f"http://127.0.0.1:{port}"
    api_url = f"{ui_url}/api"
    # `--port` alone leaves the UI calling the API on 4200: tell it where its own server is
    server_env = {
        **os.environ,
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": api_url,
    }
    STATE_DIR.mkdir(exist_ok=True)
    log = open(STATE_DIR / "server.log", "ab")
    process = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=server_env,
        start_new_session=True,
    )
    print(
        f"starting a local Prefect server on {ui_url} (log: {STATE_DIR / 'server.log'})", flush=True
    )
    deadline = time.monotonic() + timeout_s
    while not _healthy(api_url):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the Prefect server did not start; see {STATE_DIR / 'server.log'}")
        time.sleep(0.5)
    SERVER_FILE.write_text(json.dumps({"pid": process.pid, "api_url": api_url, "ui_url": ui_url}))
    return api_url, ui_url


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def stop_prefect_server() -> None:
    """Stop the Prefect server `demo` started (by its process group)."""
    if not SERVER_FILE.exists():
        print("no Prefect server started by prefect-nemo here")
        return
    known = json.loads(SERVER_FILE.read_text())
    pid = known["pid"]
    if not _runs_our_server(pid, known["api_url"]):
        print("the Prefect server had already stopped")
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # its own session: the server and its workers
        print(f"stopped the Prefect server (pid {pid})")
    SERVER_FILE.unlink()


def _runs_our_server(pid: int, api_url: str) -> bool:
    """True when pid is still the `prefect server start` we recorded: after a reboot the pid in
    our file may name any process, which must not be signalled."""
    if not Path("/proc/self").exists():  # no procfs (macOS): the pid is all we can go by
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    port = api_url.rsplit(":", 1)[-1].split("/", 1)[0]
    return b"server" in argv and b"start" in argv and port.encode() in argv


# -- the demo -----------------------------------------------------------------------------------


def run_demo(run_dir: Path | None) -> int:
    """Run the demo pipeline on the embedded local Ray cluster and print what happened."""
    if importlib.util.find_spec("numpy") is None:  # the embedded cluster's jobs run this Python
        print(
            "error: the demo's jobs need numpy: pip install 'prefect-nemo[demo]'", file=sys.stderr
        )
        return 2
    api_url, ui_url = ensure_prefect_server()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo import local_ray

    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="prefect-nemo-demo-"))
    with temporary_settings({PREFECT_API_URL: api_url}):
        from prefect_nemo.demo import demo_pipeline

        local_ray.default_cluster()  # start (or find) the cluster before the clock starts
        started = time.monotonic()
        try:
            state = demo_pipeline(run_dir=str(run_dir), return_state=True)
        finally:
            if (pid := local_ray.stop_default()) is not None:
                print(f"stopped the local Ray cluster (pid {pid})", flush=True)
        elapsed = time.monotonic() - started
    flow_run_id = state.state_details.flow_run_id
    if not state.is_completed():
        print(f"\nthe demo pipeline ended {state.type.value}: {state.message}")
        print(f"see {ui_url}/runs/flow-run/{flow_run_id}")
        return 1
    _print_summary(state.result(), elapsed)
    print(f"\nPrefect UI: {ui_url}/runs/flow-run/{flow_run_id}")
    print("(the local Prefect server keeps running; `prefect-nemo server stop` stops it)")
    return 0


def _print_summary(outputs: dict[str, dict[str, Any]], elapsed: float) -> None:
    print(f"\ndemo pipeline finished in {elapsed:.1f}s\n")
    print(f"{'experiment':<28} {'job':<44} {'state':<10} {'seconds':>8}")
    for experiment, out in outputs.items():
        for job in out["jobs"]:
            seconds = f"{job['duration_s']:.1f}" if job["duration_s"] is not None else "-"
            print(f"{experiment:<28} {job['job_id']:<44} {job['state']:<10} {seconds:>8}")
    metrics = {k: v for out in outputs.values() for k, v in out.items() if k != "jobs"}
    print(
        "\nmetrics: "
        + ", ".join(
            f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
    )


# -- blocks and deployments -----------------------------------------------------------------------


def apply_blocks(files: list[Path]) -> int:
    """Create or update the block documents of YAML files; report each, never its values."""
    from prefect_nemo.blocks.documents import apply_document, check_file
    from prefect_nemo.errors import PrefectNemoError

    try:  # every document of every file is checked before the server is even asked
        specs = [spec for path in files for spec in check_file(path)]
    except PrefectNemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api_url, _ = ensure_prefect_server()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        for spec in specs:
            try:
                applied = apply_document(spec)
            except PrefectNemoError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except Exception as exc:
                # the server's 422 answer echoes the request body (secrets revealed): name only
                status = getattr(getattr(exc, "response", None), "status_code", "")
                print(
                    f"error: saving block document {spec.name!r} failed: "
                    f"{type(exc).__name__} {status}".rstrip(),
                    file=sys.stderr,
                )
                return 2
            if applied.registered_type:
                print(f"registered block type {spec.block_type}")
            print(applied, flush=True)
    return 0


def deploy(prefect_file: Path, names: list[str]) -> int:
    """Check a prefect.yaml, create the work pools it names, then `prefect deploy` it."""
    from prefect_nemo.deployments import checked_deployments
    from prefect_nemo.deployments import deploy as run_deploy
    from prefect_nemo.errors import PrefectNemoError

    try:
        checked_deployments(prefect_file, names=names)  # before a server is started
        api_url, _ = ensure_prefect_server()
        return run_deploy(prefect_file, names=names, api_url=api_url)
    except PrefectNemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


# -- dry runs and cleanup ---------------------------------------------------------------------


def _block(ref: str, document: Path | None) -> Any:
    """A block from a saved block's name ('kube-ray-cluster/prod', read from the Prefect API)
    or, with `document`, the document of that name in a block documents YAML file (offline)."""
    if document is not None:
        from prefect_nemo.blocks.documents import build_block, check_file

        specs = {spec.name: spec for spec in check_file(document)}
        if ref not in specs:
            raise SystemExit(f"error: {document} has no block document {ref!r} ({sorted(specs)})")
        return build_block(specs[ref])
    from prefect.blocks.core import Block
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.tasks import resolve_block

    api_url, _ = ensure_prefect_server()
    with temporary_settings({PREFECT_API_URL: api_url}):
        return resolve_block(ref, Block, "block", "kube-ray-cluster/prod", "saved block")


def render_job(args: argparse.Namespace) -> int:
    """Print what a job would send to its cluster (secrets masked); nothing is sent."""
    from prefect_nemo.jobs import JobSpec
    from prefect_nemo.lifecycle import JobIdentity, Supervisor
    from prefect_nemo.redaction import Redactor

    env = dict(item.split("=", 1) for item in args.env)
    spec = JobSpec(
        entrypoint=" ".join(args.entrypoint),
        name=args.name,
        env=env,
        working_dir=args.working_dir,
    )
    backend = _block(args.cluster, args.document).backend()
    backend.validate(spec)
    scope = f"experiment:{args.experiment}" if args.experiment else "task-run:none"
    identity = JobIdentity(scope, spec.name or "job", readable=args.experiment or "")
    dry = Supervisor(backend, redact=Redactor(backend.secrets)).render(spec, identity)
    print(f"# job {dry.job_id} on {dry.cluster} ({dry.backend}); nothing was sent")
    print(dry.yaml, end="")
    return 0


def render_dgd(args: argparse.Namespace) -> int:
    """Print the DynamoGraphDeployment deploy_dgd would apply (no owner reference, no API)."""
    import yaml

    from prefect_nemo.tasks.dgd import render_dgd as render

    doc = render(
        str(args.manifest),
        namespace=args.namespace,
        name=args.name,
        pick=args.pick,
        image=args.image,
        version=args.version,
    )
    print(yaml.safe_dump(doc, sort_keys=False), end="")
    return 0


def cleanup(refs: list[str], document: Path | None) -> int:
    """Remove what prefect-nemo created on each block's cluster that no run needs any more."""
    api_url, _ = ensure_prefect_server()  # which runs are over is Prefect's to say
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.errors import PrefectNemoError

    with temporary_settings({PREFECT_API_URL: api_url}):
        for ref in refs:
            try:
                removed = _block(ref, document).cleanup()
            except PrefectNemoError as exc:
                print(f"error: {ref}: {exc}", file=sys.stderr)
                return 2
            print(f"{ref}: " + (", ".join(removed) if removed else "nothing to remove"))
    return 0


def sweep(refs: list[str], dry_run: bool, every_s: float | None) -> int:
    """Stop the jobs of flow runs that died without a word (once, or every `every_s`)."""
    api_url, _ = ensure_prefect_server()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.errors import PrefectNemoError
    from prefect_nemo.tasks.sweeper import sweep_flow

    with temporary_settings({PREFECT_API_URL: api_url}):
        while True:
            try:
                verdicts = sweep_flow(blocks=refs, dry_run=dry_run)
            except PrefectNemoError as exc:  # e.g. an unknown block: nothing was stopped
                print(f"error: {exc}", file=sys.stderr)
                return 2
            stopped = [v for v in verdicts if v["stop"]]
            for v in stopped:
                outcome = v["outcome"] or "would stop"
                print(f"{v['block']}: {v['job_id']}: {v['why']} -> {outcome}")
            verb = "would stop" if dry_run else "stopped"
            print(f"swept {len(verdicts)} live job(s), {verb} {len(stopped)}", flush=True)
            if every_s is None:
                return 0
            time.sleep(every_s)


def doctor(refs: list[str]) -> int:
    """Check saved blocks before their first job (every saved block without names): print one
    row per check with its fix; 1 when a check failed, 2 when a named block does not exist."""
    api_url, _ = ensure_prefect_server()  # where the blocks are saved
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_nemo.doctor import failed, table
    from prefect_nemo.errors import PrefectNemoError
    from prefect_nemo.tasks.doctor import doctor as run_doctor

    with temporary_settings({PREFECT_API_URL: api_url}):
        try:
            checks = run_doctor(refs)
        except PrefectNemoError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(table(checks), flush=True)
    return 1 if failed(checks) else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `prefect-nemo` command."""
    parser = argparse.ArgumentParser(prog="prefect-nemo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the demo pipeline on a local Ray cluster")
    demo.add_argument("--run-dir", type=Path, help="where the demo's jobs write (default: temp)")
    server = commands.add_parser("server", help="the local Prefect server the demo starts")
    server.add_argument("action", choices=["stop"])
    blocks = commands.add_parser("blocks", help="block documents kept as YAML (blocks/*.yaml)")
    blocks_commands = blocks.add_subparsers(dest="action", required=True)
    apply = blocks_commands.add_parser(
        "apply", help="create or update the documents of YAML files (secrets from ${ENV_VARS})"
    )
    apply.add_argument("files", type=Path, nargs="+", help="e.g. blocks/ray-remote.yaml")
    deploy_cmd = commands.add_parser(
        "deploy", help="apply deployments/prefect.yaml (creates missing work pools)"
    )
    deploy_cmd.add_argument(
        "--prefect-file",
        type=Path,
        default=Path("deployments/prefect.yaml"),
        help="the prefect.yaml to apply (default: deployments/prefect.yaml)",
    )
    deploy_cmd.add_argument(
        "--name",
        action="append",
        default=[],
        help="only this deployment ('flow-name/deployment-name' or a deployment name); repeatable",
    )
    render = commands.add_parser(
        "render", help="print what would be sent (dry run: secrets masked, nothing sent)"
    )
    render_commands = render.add_subparsers(dest="what", required=True)
    job = render_commands.add_parser("job", help="a job on a cluster block")
    job.add_argument(
        "--cluster", required=True, help="a saved block ('kube-ray-cluster/prod'), or with "
        "--document a document name in that YAML file"
    )  # fmt: skip
    job.add_argument("--document", type=Path, help="a block documents YAML file (offline)")
    job.add_argument("--name", help="the job's name (part of its id)")
    job.add_argument("--experiment", help="render the id a run of this experiment would use")
    job.add_argument("--env", action="append", default=[], help="K=V; repeatable")
    job.add_argument("--working-dir", type=Path, help="local code shipped with the job")
    job.add_argument("entrypoint", nargs="+", help="the command, after --")
    dgd = render_commands.add_parser("dgd", help="a DynamoGraphDeployment manifest file")
    dgd.add_argument("manifest", type=Path)
    dgd.add_argument("--namespace", required=True)
    dgd.add_argument("--name", help="rename the DGD")
    dgd.add_argument("--pick", help="the DGD's name in a file that holds several")
    dgd.add_argument("--image", help="image default for containers that name none")
    dgd.add_argument("--version", default="v1alpha1", choices=["v1alpha1", "v1beta1"])
    clean = commands.add_parser(
        "cleanup", help="remove what prefect-nemo created that no run needs any more"
    )
    clean.add_argument("blocks", nargs="+", help="saved blocks, e.g. lepton-ray-cluster/rl")
    clean.add_argument("--document", type=Path, help="read the blocks from this YAML file")
    sweeper = commands.add_parser(
        "sweep", help="stop the jobs of flow runs that died without a word (kill -9, OOM)"
    )
    sweeper.add_argument("blocks", nargs="*", help="saved cluster blocks (default: all)")
    sweeper.add_argument("--dry-run", action="store_true", help="judge, stop nothing")
    sweeper.add_argument("--every", type=float, metavar="SECONDS", help="sweep again and again")
    doctor_cmd = commands.add_parser(
        "doctor", help="check saved blocks before the first job: credentials, permissions, "
        "CRDs, versions, Slurm, clock; one row per check with its fix"
    )  # fmt: skip
    doctor_cmd.add_argument(
        "blocks", nargs="*", help="saved blocks, e.g. kube-ray-cluster/prod (default: all)"
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(args.blocks)
    if args.command == "sweep":
        return sweep(args.blocks, args.dry_run, args.every)
    if args.command == "render":
        from prefect_nemo.errors import PrefectNemoError

        try:
            return render_job(args) if args.what == "job" else render_dgd(args)
        except PrefectNemoError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.command == "cleanup":
        return cleanup(args.blocks, args.document)
    if args.command == "demo":
        return run_demo(args.run_dir)
    if args.command == "blocks":
        return apply_blocks(args.files)
    if args.command == "deploy":
        return deploy(args.prefect_file, args.name)
    stop_prefect_server()
    return 0


if __name__ == "__main__":
    sys.exit(main())
