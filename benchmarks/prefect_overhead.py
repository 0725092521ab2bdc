"""What Prefect costs a promotion: the same Tier 0 -> Tier 1 promotion (register, verify, copy
with read-back, complete, retention plan) run as the ``promote-checkpoint`` flow against a
running Prefect server, beside the same steps called as plain functions, in the same run.

    .venv/bin/python benchmarks/prefect_overhead.py [--size-mib 256] [--shards 16] [--rounds 10]
    .venv/bin/python benchmarks/prefect_overhead.py --smoke [--api-url URL]   # 2 MiB, one round

Starts its own Prefect server (SQLite) unless ``--api-url`` names a running one. Each round
promotes three fresh checkpoints of identical size: plain functions, the flow, and the flow with
Prefect's flow-run heartbeats off, rotating which goes first; retention is off so every round
does the same work. Prints per-round times, medians, the ratio, and the overhead in
milliseconds per promotion.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, parse, prefect_api, table, write_shards
from core.layout import checkpoint_prefix
from core.manifest_build import build_manifest, write_manifest
from core.settings import load_settings
from db.catalog import Catalog, upgrade
from tasks.prefect_events import auth_headers

NODE = "bench-node"
SMOKE = {"size_mib": 2, "shards": 2, "settle": 0.0}


def main() -> None:
    ap = bench_parser(__doc__, rounds=10, api_url=True)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet before each measurement")
    args = parse(ap, SMOKE)

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        with prefect_api(args.api_url, work / "prefect") as api:
            os.environ["PREFECT_API_URL"] = api
            os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
            os.environ.update({"CKPT_DATA_DIR": str(work / "data"), "CKPT_NODE": NODE, "CKPT_TASK_RETRIES": "0",
                               "CKPT_RETENTION_TIER0__ENABLED": "false", "CKPT_RETENTION_TIER1__ENABLED": "false"})
            run_rounds(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_checkpoint(tier0_url: str, step: int, total_bytes: int, shards: int) -> None:
    folder = Path(tier0_url) / checkpoint_prefix("bench", step)
    write_shards(folder, total_bytes, shards, seed=step)
    write_manifest(folder, build_manifest(folder, "bench", step, node=NODE))


def run_rounds(args) -> None:
    # Prefect takes its settings from the environment when first imported, and main() sets
    # PREFECT_API_URL: nothing that imports Prefect may load before (flows.* do)
    from flows.common import plain_steps  # deferred: start-up (Prefect reads its env on import)
    from flows.promote import promote, promote_checkpoint  # deferred: start-up (Prefect reads its env on import)

    settings = load_settings()
    upgrade(settings.catalog_url)
    with Catalog(settings.catalog_url) as cat:
        cat.ensure_run("bench", actor="bench")
    size = args.size_mib * (1 << 20)

    def plain(step: int) -> float:
        t0 = time.perf_counter()
        promote(settings, "bench", step, steps=plain_steps())
        return time.perf_counter() - t0

    phases: dict[str, dict[str, list[float]]] = {}

    def as_flow(step: int, label: str = "flow") -> float:
        t0_wall, t0 = time.time(), time.perf_counter()
        state = promote_checkpoint("bench", step, return_state=True)
        elapsed = time.perf_counter() - t0
        assert state.is_completed(), state.message
        for phase, seconds in flow_phases(state.state_details.flow_run_id, t0_wall, t0_wall + elapsed).items():
            phases.setdefault(label, {}).setdefault(phase, []).append(seconds)
        return elapsed

    def as_flow_no_heartbeat(step: int) -> float:
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            return as_flow(step, "flow, no heartbeat")

    def floor(step: int) -> float:
        """Prefect's own cost: an empty flow with the promotion's task runs, no heartbeats."""
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            t0_wall, t0 = time.time(), time.perf_counter()
            state = prefect_floor()
            elapsed = time.perf_counter() - t0
        assert state.is_completed(), state.message
        for phase, seconds in flow_phases(state.state_details.flow_run_id, t0_wall, t0_wall + elapsed).items():
            phases.setdefault(FLOOR, {}).setdefault(phase, []).append(seconds)
        return elapsed

    write_checkpoint(settings.tier0_url, 1, 2 << 20, 2)
    as_flow(1, "warm-up")  # flow and task registration, client connections
    floor(1)
    phases.clear()
    ways = [("plain functions", plain), ("flow", as_flow), ("flow, no heartbeat", as_flow_no_heartbeat),
            (FLOOR, floor)]
    times: dict[str, list[float]] = {name: [] for name, _ in ways}
    step = 10
    print(f"checkpoint: {args.size_mib} MiB in {args.shards} safetensors shards; {args.rounds} rounds")
    for r in range(args.rounds):
        # not common.run_rounds: each promotion needs its own fresh step, written untimed
        for name, fn in ways[r % len(ways):] + ways[:r % len(ways)]:
            step += 1
            write_checkpoint(settings.tier0_url, step, size, args.shards)
            os.sync()  # no writeback of the fresh checkpoint during the measurement
            time.sleep(args.settle)  # and the server done digesting the previous run's events
            times[name].append(fn(step))
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n, _ in ways))
    floor_s = statistics.median(times.pop(FLOOR))
    base = table("promotion Tier 0 -> Tier 1", times, "plain functions", nbytes=size)
    for name, _ in ways[1:3]:
        print(f"overhead of {name!r}: {(statistics.median(times[name]) - base) * 1000:+.0f} ms per promotion")
    over = statistics.median(times["flow, no heartbeat"]) - base
    print(f"Prefect's floor (an empty flow with 2 no-op task runs, no heartbeats): {floor_s * 1000:.0f} ms median;"
          f" the promotion flow's overhead {over * 1000:+.0f} ms is {over / floor_s:.2f} x that floor"
          f" ({(over - floor_s) * 1000:+.0f} ms above it)")
    print(f"\nwhere the flow's time goes, median seconds (Prefect server timestamps)\n{'contender':22}"
          + "".join(f"{p:>16}" for p in PHASES))
    for label, by_phase in phases.items():
        print(f"{label:22}" + "".join(f"{statistics.median(by_phase[p]):16.3f}" for p in PHASES))
    plain_med, flow_med = statistics.median(times["plain functions"]), statistics.median(times["flow, no heartbeat"])
    print(f"goal: flow <= 1.10 x plain functions: 'flow, no heartbeat' (how the agent runs a checkpoint's run) "
          f"{flow_med / plain_med:.2f} x, 'flow' {statistics.median(times['flow']) / plain_med:.2f} x")
    print("(2 task runs per promotion: tier0-to-tier1 (register, verify, copy, mark complete) and\n"
          " plan-retention; 3 artifacts posted together at the end;\n"
          " 'flow' runs with Prefect's default flow heartbeats, whose thread is joined at the end of\n"
          " every flow run after sleeping in 1 s steps; 'flow, no heartbeat' sets\n"
          " PREFECT_FLOWS_HEARTBEAT_FREQUENCY to None, as the agent runs a checkpoint's promote run:\n"
          " a killed run is detected by the agent that started its process, and a self-hosted server acts\n"
          " on heartbeats only through a zombie automation, which this stack does not create)")


FLOOR = "prefect floor"


def _noop() -> None:
    return None


def prefect_floor():
    """What Prefect itself costs the promotion, without any of its work: one flow run with the
    promotion's two task runs; its final state."""
    return _floor_flow()(return_state=True)


@lru_cache(maxsize=1)
def _floor_flow():
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    noop = task(_noop, name="bench-noop", cache_policy=NO_CACHE, persist_result=False)

    def body() -> None:
        noop()
        noop()

    return flow(body, name="bench-prefect-floor")


PHASES = ("to running", "to first task", "in tasks", "between tasks", "to completed", "to return")


def flow_phases(flow_run_id, t0: float, t_end: float) -> dict[str, float]:
    """Where one in-process flow run spent its time, from the server's records: the call to
    Running (create the run, Pending, Running), Running to the first task, inside task runs,
    between them, the last task to Completed (artifacts, the run's status page), Completed to
    the call's return (engine teardown, the heartbeat thread's join)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    states = httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": str(flow_run_id)}, timeout=30,
                       headers=auth_headers()).json()
    at = {s["type"]: datetime.fromisoformat(s["timestamp"]).timestamp() for s in states}
    tasks = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [str(flow_run_id)]}}},
                       timeout=30, headers=auth_headers()).json()
    stamp = lambda value: datetime.fromisoformat(value).timestamp()  # noqa: E731
    spans = sorted((stamp(t["start_time"]), stamp(t["end_time"])) for t in tasks if t["start_time"] and t["end_time"])
    inside = sum(end - start for start, end in spans)
    return {"to running": at["RUNNING"] - t0, "to first task": spans[0][0] - at["RUNNING"], "in tasks": inside,
            "between tasks": spans[-1][1] - spans[0][0] - inside, "to completed": at["COMPLETED"] - spans[-1][1],
            "to return": t_end - at["COMPLETED"]}


if __name__ == "__main__":
    main()
