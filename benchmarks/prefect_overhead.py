"""What Prefect costs a promotion: the same Tier 0 -> Tier 1 promotion (register, verify, copy
with read-back, complete, retention plan) run as the ``promote-checkpoint`` flow against a
running Prefect server, beside the same steps called as plain functions, in the same run.

    .venv/bin/python benchmarks/prefect_overhead.py [--size-mib 256] [--shards 16] [--rounds 5]

Starts its own Prefect server (SQLite) unless PREFECT_API_URL is set. Each round promotes three
fresh checkpoints of identical size: plain functions, the flow, and the flow with Prefect's
flow-run heartbeats off, rotating which goes first; retention is off so every round does the
same work. Prints per-round times, medians, the ratio, and the
overhead in milliseconds per promotion and per task run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def start_server(home: Path) -> tuple[subprocess.Popen | None, str]:
    import httpx

    if os.environ.get("PREFECT_API_URL"):
        return None, os.environ["PREFECT_API_URL"]
    from conftest import free_port

    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_UI_ENABLED="false",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING",
               PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("Prefect server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet before each measurement")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    proc, api = start_server(work / "prefect")
    os.environ["PREFECT_API_URL"] = api
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    env = {"CKPT_DATA_DIR": str(work / "data"), "CKPT_NODE": "bench-node", "CKPT_TASK_RETRIES": "0",
           "CKPT_RETENTION_TIER0__ENABLED": "false", "CKPT_RETENTION_TIER1__ENABLED": "false"}
    os.environ.update(env)
    try:
        run_rounds(args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)


def run_rounds(args) -> None:
    from core.settings import load_settings
    from db.catalog import Catalog, upgrade
    from flows.common import plain_steps
    from flows.promote import promote, promote_checkpoint
    from pipeline_kit import write_checkpoint

    settings = load_settings()
    upgrade(settings.catalog_url)
    cat = Catalog(settings.catalog_url)
    cat.ensure_run("bench", actor="bench")
    cat.close()
    shard_bytes = args.size_mib * (1 << 20) // args.shards

    def plain(step: int) -> float:
        t0 = time.perf_counter()
        promote(settings, "bench", step, steps=plain_steps())
        return time.perf_counter() - t0

    def as_flow(step: int) -> float:
        t0 = time.perf_counter()
        state = promote_checkpoint("bench", step, return_state=True)
        elapsed = time.perf_counter() - t0
        assert state.is_completed(), state.message
        return elapsed

    def as_flow_no_heartbeat(step: int) -> float:
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            return as_flow(step)

    write_checkpoint(settings.tier0_url, "bench", 1, shards=2, shard_bytes=1 << 20)
    as_flow(1)  # warm-up: flow and task registration, client connections
    ways = [("plain", plain), ("flow", as_flow), ("flow-no-heartbeat", as_flow_no_heartbeat)]
    times: dict[str, list[float]] = {name: [] for name, _ in ways}
    step = 10
    print(f"checkpoint: {args.size_mib} MiB in {args.shards} safetensors shards; {args.rounds} rounds")
    for r in range(args.rounds):
        order = ways[r % len(ways):] + ways[:r % len(ways)]
        for name, fn in order:
            step += 1
            write_checkpoint(settings.tier0_url, "bench", step, shards=args.shards, shard_bytes=shard_bytes)
            os.sync()  # no writeback of the fresh checkpoint during the measurement
            time.sleep(args.settle)  # and the server done digesting the previous run's events
            times[name].append(fn(step))
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n, _ in ways))
    mb = args.size_mib * (1 << 20) / 1e6
    base = statistics.median(times["plain"])
    for name, _ in ways:
        med = statistics.median(times[name])
        print(f"median {name:18s}: {med:.3f} s  {mb / med:6.0f} MB/s  ratio {med / base:.3f}  "
              f"overhead {(med - base) * 1000:+.0f} ms per promotion")
    print("(5 task runs per promotion: register, verify, copy-to-tier1, mark-complete, plan-retention;\n"
          " 'flow' runs with Prefect's default flow heartbeats, whose thread is joined at the end of\n"
          " every flow run after sleeping in 1 s steps; 'flow-no-heartbeat' sets\n"
          " PREFECT_FLOWS_HEARTBEAT_FREQUENCY to None and loses crashed-run detection)")


if __name__ == "__main__":
    main()
