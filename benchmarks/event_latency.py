"""Latency of the event path: emit -> promote flow start, and emit -> verified on Tier 1.

Full size by hand; CI runs only its ``--smoke`` form. Starts a Prefect server on SQLite (unless
``--api-url`` names a running one) and one agent for a node of its own (no Tier 2), commits
``--rounds`` checkpoints of ``--mb`` MB on Tier 0 and announces each with a
``ckpt.checkpoint.completed`` event, ``--gap`` seconds apart so that runs do not queue. The
baseline, in the same run, is the API path: a flow run created directly on the same deployment
(what ``ckpt promote`` / ``run_deployment`` does), whose start latency is the runner's pickup
alone. Printed: medians, and the event path's ratio to the baseline. Run and node names are
unique per invocation, so a reused server's older flow runs are never mistaken for this one's;
on a reused server the agent's deployment is deleted at the end.

    python benchmarks/event_latency.py --rounds 6 --gap 8
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
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np

from benchmarks.common import Times, bench_parser, parse, prefect_api, table

SMOKE = {"gap": 0.0, "mb": 4}
API_PATH = "API create -> flow start"


def ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def wait(pred, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError("timed out")


def main() -> None:
    ap = bench_parser(__doc__, rounds=6, api_url=True)  # a round: one event-path and one API-path promotion
    ap.add_argument("--count", dest="rounds", type=int, default=argparse.SUPPRESS, help="same as --rounds")
    ap.add_argument("--gap", type=float, default=8.0)
    ap.add_argument("--mb", type=int, default=16)
    args = parse(ap, SMOKE)
    root = Path(tempfile.mkdtemp(prefix="ckpt-latency-"))
    try:
        with prefect_api(args.api_url, root / "prefect") as api:
            times = bench(args, root, api, reused=bool(args.api_url))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.rounds} checkpoints of {args.mb} MB each way, {args.gap:.0f} s apart")
    base = table("event path vs API path, seconds", times, API_PATH)
    print(f"ratio: emit -> flow start = {statistics.median(times['emit -> flow start']) / base:.2f} x the API path")


def bench(args, root: Path, api: str, *, reused: bool) -> Times:
    from ckpt.client import CheckpointStager
    from ckpt.local_stack import stack_env, start_agent, stop_process, wait_deployments
    from core import events
    from core.settings import load_settings
    from db.catalog import Catalog, upgrade
    from deployments import names

    tag = uuid.uuid4().hex[:6]
    run, node = f"lat-{tag}", f"lat-{tag}"
    env = stack_env(root / "data", api_url=api, s3_url=None)
    os.environ.update(env)  # this process is the training job: same catalog and tiers as the agent
    settings = load_settings(node=node)
    upgrade(settings.catalog_url)
    tensors = {f"w{i}": np.ones(1_000_000, dtype=np.float32) * i for i in range(max(1, args.mb // 4))}
    times: Times = {API_PATH: [], "emit -> flow start": [], "emit -> verified on Tier 1": []}
    agent = start_agent(env, root / "logs" / f"agent-{node}.log", node=node, node_only=True)
    dep = None
    try:
        wait_deployments(api, [names.promote_deployment(node)], procs=[agent])
        dep = httpx.get(f"{api}/deployments/name/{names.promote_deployment(node)}").json()
        with Catalog(settings.catalog_url) as cat, \
                CheckpointStager(run, settings=settings, announce=False, shard_bytes=64 << 20) as st:
            cat.ensure_run(run, actor="bench")
            for i in range(args.rounds):
                step = 2 * i + 1
                st.save(step, tensors)
                t0 = time.time()
                assert events.emit(events.COMPLETED, run, step, node=node, api_url=api)
                started = wait(lambda: [r for r in _body(httpx.post(f"{api}/flow_runs/filter", json={
                    "flow_runs": {"name": {"any_": [f"promote/{run}/step-{step}"]}}})) or () if r["start_time"]])
                times["emit -> flow start"].append(ts(started[0]["start_time"]) - t0)
                rep = wait(lambda: [r for r in cat.replicas(cat.get_checkpoint(run, step).id, 1)
                                    if r.verified_at] if _known(cat, run, step) else None)
                times["emit -> verified on Tier 1"].append(rep[0].verified_at.timestamp() - t0)
                time.sleep(args.gap)
                # baseline: the same promotion requested through the API, no event
                step += 1
                st.save(step, tensors)
                t0 = time.time()
                fr = wait(lambda: _body(httpx.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={
                    "parameters": {"run": run, "step": step, "node": node}})))
                started = wait(lambda: (r := _body(httpx.get(f"{api}/flow_runs/{fr['id']}"))) and r["start_time"] and r)
                times[API_PATH].append(ts(started["start_time"]) - t0)
                time.sleep(args.gap)
    finally:
        stop_process(agent)
        if reused and dep:  # someone else's server: take our deployment (and its runs' home) away
            httpx.delete(f"{api}/deployments/{dep['id']}")
    return times


def _body(response: httpx.Response):
    """The response's JSON, or None on a 503 (a busy SQLite server) so that ``wait`` asks again,
    as Prefect's own client retries 503s (``run_deployment`` would see the same delay)."""
    if response.status_code == 503:
        return None
    response.raise_for_status()
    return response.json()


def _known(cat, run: str, step: int) -> bool:
    from core.errors import NotFound

    try:
        cat.get_checkpoint(run, step)
        return True
    except NotFound:
        return False


if __name__ == "__main__":
    main()
