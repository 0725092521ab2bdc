"""Latency of the event path: emit -> promote flow start, and emit -> verified on Tier 1, through
the runner's poll (``--path trigger``: the deployment trigger schedules the run, the served
runner finds it at its next poll and spawns a process for it) and through the agent's fast path
(``--path subscribe``: the agent hears the run scheduled and starts it in its warm process),
both in the same run by default, each with an agent of its own.

Full size by hand; CI runs only its ``--smoke`` form. Starts a Prefect server on SQLite (unless
``--api-url`` names a running one) and one agent per path for a node of its own (no Tier 2),
commits ``--rounds`` checkpoints of ``--mb`` MB per path on Tier 0 and announces each with a
``ckpt.checkpoint.completed`` event, ``--gap`` seconds apart so that runs do not queue. Printed:
medians per path, the breakdown (emit -> the server received it -> the trigger created the run
-> claimed (Pending) -> flow running -> verified on Tier 1 -> run completed, from the server's
and the catalog's timestamps), and the fast path's ratio to the trigger path. Run and node
names are unique per invocation, so a reused server's older flow runs are never mistaken for
this one's; on a reused server the agents' deployments are deleted at the end.

    python benchmarks/event_latency.py --rounds 6 --mb 64
    python benchmarks/event_latency.py --smoke [--api-url URL]    # one 4 MB checkpoint per path, no gap
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

from benchmarks.common import Times, bench_parser, parse, prefect_api, table
from ckpt.client import CheckpointStager
from ckpt.local_stack import stack_env, start_agent, wait_deployments
from ckpt.processes import stop_process
from core import events
from core.settings import load_settings
from db.catalog import Catalog, upgrade
from deployments import names
from tasks.prefect_events import auth_headers, emit

SMOKE = {"gap": 0.0, "mb": 4}
PATHS = {"trigger": "trigger", "subscribe": "fast path"}  # trigger: the runner's poll picks the run up
STAGES = ("received", "run created", "claimed (Pending)", "flow running", "verified on Tier 1", "run completed")


def ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def wait(pred, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError("timed out")


def main() -> None:
    ap = bench_parser(__doc__, rounds=6, api_url=True)  # a round: one promotion per path
    ap.add_argument("--count", dest="rounds", type=int, default=argparse.SUPPRESS, help="same as --rounds")
    ap.add_argument("--gap", type=float, default=8.0)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--path", choices=["trigger", "subscribe", "both"], default="both",
                    help="trigger: the runner's poll (CKPT_FAST_PATH=false); subscribe: the agent's fast path")
    args = parse(ap, SMOKE)
    paths = list(PATHS) if args.path == "both" else [args.path]
    root = Path(tempfile.mkdtemp(prefix="ckpt-latency-"))
    try:
        with prefect_api(args.api_url, root / "prefect") as api:
            times, stages = bench(args, paths, root, api, reused=bool(args.api_url))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.rounds} checkpoints of {args.mb} MB per path, {args.gap:.0f} s apart")
    base_path = PATHS[paths[0]]
    base = table("emit -> flow start / verified on Tier 1, seconds", times, f"{base_path}: emit -> verified on Tier 1")
    print(f"\nbreakdown, median seconds after the emit (server and catalog timestamps)\n{'path':24}"
          + "".join(f"{s:>20}" for s in STAGES))
    for p in paths:
        print(f"{PATHS[p]:24}" + "".join(f"{statistics.median(stages[p][s]):20.3f}" for s in STAGES))
    fast = times.get(f"{PATHS['subscribe']}: emit -> verified on Tier 1")
    if fast and len(paths) == 2:
        print(f"ratio: fast path / trigger, emit -> verified on Tier 1 = {statistics.median(fast) / base:.2f} x")
    if fast:
        print(f"goal: emit -> verified on Tier 1 <= 2 s median ({args.mb} MB): "
              f"fast path {statistics.median(fast):.2f} s")


def bench(args, paths: list[str], root: Path, api: str, *, reused: bool) -> tuple[Times, dict]:
    tag = uuid.uuid4().hex[:6]
    run = f"lat-{tag}"
    nodes = {p: f"lat-{tag}-{p}" for p in paths}
    env = stack_env(root / "data", api_url=api, s3_url=None)
    os.environ.update(env)  # this process is the training job: same catalog and tiers as the agents
    upgrade(load_settings().catalog_url)
    tensors = {f"w{i}": np.ones(1_000_000, dtype=np.float32) * i for i in range(max(1, args.mb // 4))}
    times: Times = {f"{PATHS[p]}: {what}": [] for p in paths for what in ("emit -> flow start",
                                                                            "emit -> verified on Tier 1")}
    stages: dict = {p: {s: [] for s in STAGES} for p in paths}
    agents = {p: start_agent({**env, "CKPT_FAST_PATH": str(p == "subscribe").lower()},
                             root / "logs" / f"agent-{nodes[p]}.log", node=nodes[p], node_only=True) for p in paths}
    deps = []
    try:
        wait_deployments(api, [names.promote_deployment(n) for n in nodes.values()], procs=list(agents.values()))
        deps = [httpx.get(f"{api}/deployments/name/{names.promote_deployment(n)}", headers=auth_headers()).json()["id"]
                for n in nodes.values()]
        with ExitStack() as stack:
            cat = stack.enter_context(Catalog(load_settings().catalog_url))
            stagers = {p: stack.enter_context(CheckpointStager(run, settings=load_settings(node=nodes[p]),
                                                               announce=False, shard_bytes=64 << 20)) for p in paths}
            cat.ensure_run(run, actor="bench")
            step = 0
            for i in range(args.rounds):
                for p in paths[i % len(paths):] + paths[:i % len(paths)]:
                    step += 1
                    stagers[p].save(step, tensors)
                    os.sync()  # no writeback of the fresh checkpoint during the measurement
                    measure(api, cat, events, run, step, nodes[p], times, stages[p], PATHS[p])
                    time.sleep(args.gap)  # the runs do not queue; the fast path's next warm process is up
    finally:
        for proc in agents.values():
            stop_process(proc)
        if reused:  # someone else's server: take our deployments (and their runs' home) away
            for dep in deps:
                httpx.delete(f"{api}/deployments/{dep}", headers=auth_headers())
    return times, stages


def measure(api: str, cat, events, run: str, step: int, node: str, times: Times, stages: dict, label: str) -> None:
    """Emit one completed event and record when each stage of its promotion happened."""
    t0 = time.time()
    assert emit(events.COMPLETED, run, step, node=node, api_url=api)
    name = f"promote/{run}/step-{step}"
    done = wait(lambda: [r for r in _body(httpx.post(f"{api}/flow_runs/filter", json={
        "flow_runs": {"name": {"any_": [name]}}}, headers=auth_headers())) or () if r["end_time"]])[0]
    if done["state_type"] != "COMPLETED":  # said, not measured: the table holds promotions only
        print(f"{label:24} step {step}: run {done['state_type']}: {done['state']['message']}", flush=True)
        return
    verified = wait(lambda: [r for r in cat.replicas(cat.get_checkpoint(run, step).id, 1) if r.verified_at])
    states: dict[str, float] = {}
    for s in _body(httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": done["id"]}, headers=auth_headers())):
        states[s["type"]] = min(states.get(s["type"], float("inf")), ts(s["timestamp"]))  # the first of each
    received = _body(httpx.post(f"{api}/events/filter", json={"filter": {"id": {"id": [
        str(events.event_id(events.COMPLETED, run, step))]}}}, headers=auth_headers()))["events"]
    at = {"received": ts(received[0]["received"]) if received else float("nan"), "run created": ts(done["created"]),
          "claimed (Pending)": states.get("PENDING", float("nan")), "flow running": ts(done["start_time"]),
          "verified on Tier 1": verified[0].verified_at.timestamp(), "run completed": ts(done["end_time"])}
    for stage, when in at.items():
        stages[stage].append(when - t0)
    times[f"{label}: emit -> flow start"].append(at["flow running"] - t0)
    times[f"{label}: emit -> verified on Tier 1"].append(at["verified on Tier 1"] - t0)
    print(f"{label:24} step {step}: " + ", ".join(f"{k} +{v - t0:.2f}" for k, v in at.items()), flush=True)


def _body(response: httpx.Response):
    """The response's JSON, or None on a 503 (a busy SQLite server) so that ``wait`` asks again,
    as Prefect's own client retries 503s (``run_deployment`` would see the same delay)."""
    if response.status_code == 503:
        return None
    response.raise_for_status()
    return response.json()


if __name__ == "__main__":
    main()
