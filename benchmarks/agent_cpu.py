"""CPU an agent spends per promotion, through Prefect, as it runs on a node.

A real ``ckpt agent`` (fast path on: its warm processes forked from it) against a Prefect
server on SQLite; a job commits ``--parts`` checkpoints of ``--mib`` MiB one after another and
waits for each to be verified on Tier 1. The figure is the CPU of the agent's whole process
tree (the agent, its fork server, the warm processes it forked and reaped, multiprocessing's
resource tracker) from before the first commit to after the last promotion, per promotion.
Idle agents cost nothing measurable here (0.07 % of a core between polls), so this is the
promotions' CPU: Prefect's engine, the catalog, the copy, forking and warming the next process.

Contenders, each a fresh agent per round, their order rotated:
- ours: the agent as it ships (``CKPT_PREFECT_REUSE`` on: its Prefect clients share one
  verified TLS context per CA file, deployments/tls.py, and it builds a run's Prefect settings and
  Prefect's models before it forks its warm processes, deployments/fast_path.py);
- Prefect as it comes (the baseline): the same agent with it off: a TLS context per client, the
  settings and models built in each warm process.
Medians, best rounds, the load average.

    .venv/bin/python benchmarks/agent_cpu.py [--rounds 3 --parts 8 --mib 1]
    .venv/bin/python benchmarks/agent_cpu.py --smoke
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.burst import cpu_between, descendants, proc_cpu
from benchmarks.common import bench_parser, load_line, parse, prefect_api, table
from ckpt.client import CheckpointStager
from ckpt.local_stack import stack_env, start_agent, wait_deployments
from ckpt.processes import stop_process
from core.settings import Settings
from db.catalog import Catalog, upgrade
from deployments import names

CONTENDERS = {"ours: built once, before the fork": "true", "Prefect as it comes": "false"}
BASE = "Prefect as it comes"


def tree_cpu(pid: int) -> dict[int, float]:
    return {p: proc_cpu(p) for p in (pid, *descendants(pid))}


def one_round(api: str, work: Path, reuse: str, parts: int, mib: float, tag: str) -> float:
    """A fresh agent promotes ``parts`` checkpoints one after another; its CPU per promotion."""
    import numpy as np

    catalog = f"sqlite:///{work / f'catalog-{tag}.db'}"
    upgrade(catalog)
    node = f"cpu-{tag}"
    env = stack_env(work / f"data-{tag}", api_url=api, s3_url=None, catalog_url=catalog)
    env.update(CKPT_TIER0_URL=str(work / f"t0-{tag}"), CKPT_TIER1_URL=str(work / f"t1-{tag}"),
               CKPT_RECONCILE_INTERVAL_SECONDS="3600", CKPT_PREFECT_REUSE=reuse)
    agent = start_agent(env, work / f"agent-{tag}.log", node=node, node_only=True)
    try:
        wait_deployments(api, [names.promote_deployment(node)], timeout=300, procs=[agent])
        time.sleep(2)  # the first warm process forked and warmed up
        settings = Settings(**{k[5:].lower(): v for k, v in env.items() if k.startswith("CKPT_")}, node=node)
        rng = np.random.default_rng(0)
        before = tree_cpu(agent.pid)
        with CheckpointStager(f"cpu-{tag}", settings=settings) as st, Catalog(catalog) as cat:
            for i in range(parts):
                st.save(100 + i, {"w": rng.standard_normal(int(mib * 2**18), dtype=np.float32)})
                deadline = time.monotonic() + 120
                while not _verified(cat, f"cpu-{tag}", 100 + i):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"step {100 + i} not verified on Tier 1 in 120 s (see the agent's log)")
                    time.sleep(0.1)
        time.sleep(1)  # the run's last writes, the next warm process
        return cpu_between(before, tree_cpu(agent.pid)) / parts
    finally:
        stop_process(agent)


def _verified(cat: Catalog, run: str, step: int) -> bool:
    try:
        ck = cat.get_checkpoint(run, step)
    except Exception:  # noqa: BLE001 - not registered yet
        return False
    return any(r.state == "verified" for r in cat.replicas(ck.id, tier=1))


def main() -> None:
    ap = bench_parser(__doc__, rounds=3, api_url=True)
    ap.add_argument("--parts", type=int, default=8, help="promotions per round")
    ap.add_argument("--mib", type=float, default=1.0, help="size of each checkpoint")
    args = parse(ap, {"parts": 2})
    load0 = os.getloadavg()[0]
    got: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="ckpt-agent-cpu-") as tmp, prefect_api(args.api_url, Path(tmp)) as api:
        names_ = list(CONTENDERS)
        for r in range(args.rounds):
            for j in range(len(names_)):
                name = names_[(r + j) % len(names_)]
                got[name].append(one_round(api, Path(tmp), CONTENDERS[name], args.parts, args.mib, f"{r}{j}"))
    table(f"agent CPU seconds per promotion (its whole process tree; {args.parts} promotions of {args.mib:g} MiB "
          f"per round, {args.rounds} rounds; the 's' columns are CPU seconds)", got, BASE)
    ours = statistics.median(got[names_[0]])
    base = statistics.median(got[BASE])
    print(load_line(load0))
    print(f"ratio: ours / Prefect as it comes = {ours / base:.2f} x CPU per promotion "
          f"(best rounds {min(got[names_[0]]) / min(got[BASE]):.2f} x)")

if __name__ == "__main__":
    main()
