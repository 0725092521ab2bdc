"""Latency of the event path: emit -> promote flow start, and emit -> verified on Tier 1.

Not part of CI. Starts the local stack (Prefect server on SQLite, one agent; no Tier 2),
commits ``--count`` checkpoints of ``--mb`` MB on Tier 0 and announces each with a
``ckpt.checkpoint.completed`` event, ``--gap`` seconds apart so that runs do not queue. The
baseline, in the same run, is the API path: a flow run created directly on the same
deployment (what ``ckpt promote`` / ``run_deployment`` does), whose start latency is the
runner's pickup alone. Printed: medians and max, and the event path's ratio to the baseline.

    python benchmarks/event_latency.py --count 6 --gap 8
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np


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
    from ckpt.client import CheckpointStager
    from ckpt.local_stack import LocalStack
    from core import events
    from core.settings import load_settings
    from db.catalog import Catalog
    from deployments import names

    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=6)
    ap.add_argument("--gap", type=float, default=8.0)
    ap.add_argument("--mb", type=int, default=16)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-latency-"))
    node = "lat-0"
    tensors = {f"w{i}": np.ones(1_000_000, dtype=np.float32) * i for i in range(max(1, args.mb // 4))}
    try:
        with LocalStack(root, nodes=(node,), port=0, ui=False, tier2=False, archive_trigger=False) as stack:
            settings = load_settings(node=node)
            cat = Catalog(settings.catalog_url)
            cat.ensure_run("lat", actor="bench")
            dep = httpx.get(f"{stack.api_url}/deployments/name/{names.promote_deployment(node)}").json()
            ev_start, ev_durable, api_start = [], [], []
            with CheckpointStager("lat", settings=settings, announce=False, shard_bytes=64 << 20) as st:
                for i in range(args.count):
                    step = 2 * i + 1
                    st.save(step, tensors)
                    t0 = time.time()
                    assert events.emit(events.COMPLETED, "lat", step, node=node, api_url=stack.api_url)
                    run = wait(lambda: [r for r in httpx.post(f"{stack.api_url}/flow_runs/filter", json={
                        "flow_runs": {"name": {"any_": [f"promote/lat/step-{step}"]}}}).json()
                        if r["start_time"]])
                    ev_start.append(ts(run[0]["start_time"]) - t0)
                    rep = wait(lambda: [r for r in cat.replicas(cat.get_checkpoint("lat", step).id, 1)
                                        if r.verified_at] if _known(cat, step) else None)
                    ev_durable.append(rep[0].verified_at.timestamp() - t0)
                    time.sleep(args.gap)
                    # baseline: the same promotion requested through the API, no event
                    step += 1
                    st.save(step, tensors)
                    t0 = time.time()
                    fr = httpx.post(f"{stack.api_url}/deployments/{dep['id']}/create_flow_run", json={
                        "parameters": {"run": "lat", "step": step, "node": node}}).json()
                    started = wait(lambda: (r := httpx.get(f"{stack.api_url}/flow_runs/{fr['id']}").json())
                                   ["start_time"] and r)
                    api_start.append(ts(started["start_time"]) - t0)
                    time.sleep(args.gap)
            cat.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    print(f"{args.count} checkpoints of {args.mb} MB, {args.gap:.0f} s apart; seconds:")
    print(f"  emit -> flow start          median {med(ev_start):5.2f}  max {max(ev_start):5.2f}"
          f"  x{med(ev_start) / med(api_start):.2f} of the API path")
    print(f"  API create -> flow start    median {med(api_start):5.2f}  max {max(api_start):5.2f}  (baseline)")
    print(f"  emit -> verified on Tier 1  median {med(ev_durable):5.2f}  max {max(ev_durable):5.2f}")


def _known(cat, step: int) -> bool:
    from core.errors import NotFound

    try:
        cat.get_checkpoint("lat", step)
        return True
    except NotFound:
        return False


if __name__ == "__main__":
    main()
