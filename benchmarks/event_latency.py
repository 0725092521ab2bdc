"""Latency of the event path: emit -> verified on Tier 1, and emit -> the checkpoint's promote
run (created, running, completed: durable), as the agent promotes a part on its completed event
and then starts the checkpoint's one run itself.

Full size by hand; CI runs only its ``--smoke`` form. Starts a Prefect server on SQLite (unless
``--api-url`` names a running one) and one agent for a node of its own (no Tier 2), commits
``--rounds`` checkpoints of ``--mb`` MB on Tier 0 and announces each with a
``ckpt.checkpoint.completed`` event, ``--gap`` seconds apart so that promotions do not queue.
Printed: medians, and the breakdown (emit -> the server received it -> verified on Tier 1 -> the
checkpoint's run created -> running -> completed, from the server's and the catalog's
timestamps). Run and node names are unique per invocation, so a reused server's older flow runs
are never mistaken for this one's; on a reused server the agent's deployments are deleted at the end.

    python benchmarks/event_latency.py --rounds 6 --mb 64
    python benchmarks/event_latency.py --smoke [--api-url URL]    # one 4 MB checkpoint, no gap
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
LABEL = "agent"
STAGES = ("received", "verified on Tier 1", "run created", "flow running", "run completed")


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
    ap = bench_parser(__doc__, rounds=6, api_url=True)  # a round: one promotion
    ap.add_argument("--count", dest="rounds", type=int, default=argparse.SUPPRESS, help="same as --rounds")
    ap.add_argument("--gap", type=float, default=8.0)
    ap.add_argument("--mb", type=int, default=64)
    args = parse(ap, SMOKE)
    root = Path(tempfile.mkdtemp(prefix="ckpt-latency-"))
    try:
        with prefect_api(args.api_url, root / "prefect") as api:
            times, stages = bench(args, root, api, reused=bool(args.api_url))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.rounds} checkpoints of {args.mb} MB, {args.gap:.0f} s apart")
    table("emit -> verified on Tier 1 / durable, seconds", times, f"{LABEL}: emit -> verified on Tier 1")
    print("\nbreakdown, median seconds after the emit (server and catalog timestamps)\n" + f"{'':24}"
          + "".join(f"{s:>20}" for s in STAGES))
    print(f"{LABEL:24}" + "".join(f"{statistics.median(stages[s]):20.3f}" for s in STAGES))
    verified = times[f"{LABEL}: emit -> verified on Tier 1"]
    if verified:
        print(f"goal: emit -> verified on Tier 1 <= 2 s median ({args.mb} MB): {statistics.median(verified):.2f} s")


def bench(args, root: Path, api: str, *, reused: bool) -> tuple[Times, dict]:
    tag = uuid.uuid4().hex[:6]
    run, node = f"lat-{tag}", f"lat-{tag}-n"
    env = stack_env(root / "data", api_url=api, s3_url=None)
    os.environ.update(env)  # this process is the training job: same catalog and tiers as the agent
    upgrade(load_settings().catalog_url)
    tensors = {f"w{i}": np.ones(1_000_000, dtype=np.float32) * i for i in range(max(1, args.mb // 4))}
    times: Times = {f"{LABEL}: {what}": [] for what in ("emit -> verified on Tier 1", "emit -> durable (run done)")}
    stages: dict = {s: [] for s in STAGES}
    agent = start_agent(env, root / "logs" / f"agent-{node}.log", node=node, node_only=True)
    deps = []
    try:
        wait_deployments(api, [names.promote_deployment(node)], procs=[agent])
        deps = [httpx.get(f"{api}/deployments/name/{names.promote_deployment(node)}",
                          headers=auth_headers()).json()["id"]]
        with ExitStack() as stack:
            cat = stack.enter_context(Catalog(load_settings().catalog_url))
            stager = stack.enter_context(CheckpointStager(run, settings=load_settings(node=node), announce=False,
                                                          shard_bytes=64 << 20))
            cat.ensure_run(run, actor="bench")
            for step in range(1, args.rounds + 1):
                stager.save(step, tensors)
                os.sync()  # no writeback of the fresh checkpoint during the measurement
                measure(api, cat, events, run, step, node, times, stages, LABEL)
                time.sleep(args.gap)  # the promotions do not queue
    finally:
        stop_process(agent)
        if reused:  # someone else's server: take our deployments (and their runs' home) away
            for dep in deps:
                httpx.delete(f"{api}/deployments/{dep}", headers=auth_headers())
    return times, stages


def measure(api: str, cat, events, run: str, step: int, node: str, times: Times, stages: dict, label: str) -> None:
    """Emit one completed event and record when each stage of its promotion happened (its
    checkpoint's run ends once the checkpoint is durable)."""
    t0 = time.time()
    assert emit(events.COMPLETED, run, step, node=node, api_url=api)
    name = f"promote/{run}/step-{step}"
    done = wait(lambda: [r for r in _body(httpx.post(f"{api}/flow_runs/filter", json={
        "flow_runs": {"name": {"any_": [name]}}}, headers=auth_headers())) or () if r["end_time"]])[0]
    if done["state_type"] != "COMPLETED":  # said, not measured: the table holds promotions only
        print(f"{label:24} step {step}: run {done['state_type']}: {done['state']['message']}", flush=True)
        return
    verified = wait(lambda: [r for r in cat.replicas(cat.get_checkpoint(run, step).id, 1) if r.verified_at])
    received = _body(httpx.post(f"{api}/events/filter", json={"filter": {"id": {"id": [
        str(events.event_id(events.COMPLETED, run, step))]}}}, headers=auth_headers()))["events"]
    at = {"received": ts(received[0]["received"]) if received else float("nan"),
          "verified on Tier 1": verified[0].verified_at.timestamp(), "run created": ts(done["created"]),
          "flow running": ts(done["start_time"]), "run completed": ts(done["end_time"])}
    for stage, when in at.items():
        stages[stage].append(when - t0)
    times[f"{label}: emit -> verified on Tier 1"].append(at["verified on Tier 1"] - t0)
    times[f"{label}: emit -> durable (run done)"].append(at["run completed"] - t0)
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
