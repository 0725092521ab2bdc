"""CPU an agent spends per promotion, through Prefect, as it runs on a node.

A real ``ckpt agent`` against a Prefect server on SQLite; a job commits ``--parts`` checkpoints of
``--mib`` MiB one after another and waits for each to be durable (its promote run finished). The
figure is the CPU of the agent's whole process tree (the agent, multiprocessing's fork server and
resource tracker, the part and checkpoint-run processes forked and reaped) from before the first
commit to after the last promotion, per promotion. Idle agents cost nothing measurable here
(0.07 % of a core between polls), so this is the promotions' CPU: the part's hop, the catalog,
the copy and its checkpoint's one promote run (Prefect's engine), as each single-part checkpoint
costs.

Each round is a fresh agent; ``--baseline-env KEY=VALUE`` (repeatable) adds the agent as it ships
with those settings changed, as the baseline beside it, their order rotated (e.g.
``--baseline-env CKPT_TIER1_DIRECT_IO=true``). Medians, best rounds, the load average.

When it starts its own Prefect server (no ``--api-url``), the server's side of the same
promotions too: its CPU per promotion and the API requests and events websockets per promotion
(counted from its access log, over the same span as the agent's CPU).

    .venv/bin/python benchmarks/agent_cpu.py [--rounds 3 --parts 8 --mib 1] [--baseline-env KEY=VALUE]
    .venv/bin/python benchmarks/agent_cpu.py --smoke
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.burst import cpu_between, descendants, proc_cpu
from benchmarks.common import bench_parser, load_line, parse, prefect_server, table
from ckpt.client import CheckpointStager
from ckpt.local_stack import stack_env, start_agent, wait_deployments
from ckpt.processes import stop_process
from core.settings import Settings
from db.catalog import Catalog, upgrade
from deployments import names

OURS = "ours: the agent as it ships"


def contenders(baseline_env: list[str]) -> tuple[dict[str, dict[str, str]], str]:
    """(name -> the agent's environment changes, the baseline's name): the agent alone (its own
    baseline), or beside it the agent with ``baseline_env`` (``KEY=VALUE`` each) changed."""
    if not baseline_env:
        return {OURS: {}}, OURS
    changed = dict(kv.split("=", 1) for kv in baseline_env)
    name = "baseline: " + " ".join(baseline_env)
    return {OURS: {}, name: changed}, name


# a request line of the access log; the runner's polls come with the clock, not with promotions
REQUEST = re.compile(r'"(GET|POST|PATCH|PUT|DELETE) /api/(?!deployments/get_scheduled_flow_runs)')
WEBSOCKET = re.compile(r'"WebSocket /api/events/(in|out)" \[accepted\]')


class Server:
    """The Prefect server the rounds run against: one started here (its pid and access log
    known: its side is measured) or the one ``--api-url`` names (not measured)."""

    def __init__(self, api: str, pid: int | None = None, log: Path | None = None) -> None:
        self.api, self.pid, self.log = api, pid, log

    def mark(self) -> tuple[float, int]:
        """(CPU seconds so far, access log length) of a server started here, else (0, 0)."""
        if self.pid is None or self.log is None:
            return 0.0, 0
        return proc_cpu(self.pid), self.log.stat().st_size

    def since(self, mark: tuple[float, int]) -> tuple[float, int, int]:
        """(CPU seconds, API requests, events websockets opened) since ``mark``. The runner's polls
        are left out of the requests: they come with time, not with promotions."""
        if self.pid is None or self.log is None:
            return 0.0, 0, 0
        with self.log.open("rb") as f:
            f.seek(mark[1])
            text = f.read().decode(errors="replace")
        return proc_cpu(self.pid) - mark[0], len(REQUEST.findall(text)), len(WEBSOCKET.findall(text))


def tree_cpu(pid: int) -> dict[int, float]:
    return {p: proc_cpu(p) for p in (pid, *descendants(pid))}


def one_round(server: Server, work: Path, changes: dict[str, str], parts: int, mib: float,
              tag: str) -> tuple[float, ...]:
    """A fresh agent promotes ``parts`` checkpoints one after another; per promotion: its CPU,
    and the server's CPU, API requests and events websockets (zeros when not measured)."""
    api = server.api
    import numpy as np

    catalog = f"sqlite:///{work / f'catalog-{tag}.db'}"
    upgrade(catalog)
    node = f"cpu-{tag}"
    env = stack_env(work / f"data-{tag}", api_url=api, s3_url=None, catalog_url=catalog)
    for root in (work / f"t0-{tag}", work / f"t1-{tag}"):  # the mounts (a store never creates a root)
        root.mkdir(parents=True, exist_ok=True)
    env.update(CKPT_TIER0_URL=str(work / f"t0-{tag}"), CKPT_TIER1_URL=str(work / f"t1-{tag}"),
               CKPT_RECONCILE_INTERVAL_SECONDS="3600")
    env.update(changes)
    agent = start_agent(env, work / f"agent-{tag}.log", node=node, node_only=True)
    try:
        wait_deployments(api, [names.promote_deployment(node)], timeout=300, procs=[agent])
        time.sleep(2)  # the agent's subscription and first Tier 0 scan under way
        settings = Settings(**{k[5:].lower(): v for k, v in env.items() if k.startswith("CKPT_")}, node=node)
        rng = np.random.default_rng(0)
        before, at = tree_cpu(agent.pid), server.mark()
        with CheckpointStager(f"cpu-{tag}", settings=settings) as st, Catalog(catalog) as cat:
            for i in range(parts):
                st.save(100 + i, {"w": rng.standard_normal(int(mib * 2**18), dtype=np.float32)})
                deadline = time.monotonic() + 120
                while not _durable(cat, f"cpu-{tag}", 100 + i):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"step {100 + i} not durable in 120 s (see the agent's log)")
                    time.sleep(0.1)
        time.sleep(1)  # the run's last writes, its process reaped
        agent_cpu = cpu_between(before, tree_cpu(agent.pid))
        server_cpu, requests, sockets = server.since(at)
        return agent_cpu / parts, server_cpu / parts, requests / parts, sockets / parts
    finally:
        stop_process(agent)


def _durable(cat: Catalog, run: str, step: int) -> bool:
    """Its promote run took the follow-ups (the catalog records them done at the run's end)."""
    return any(e.action == "followups-done" for e in cat.history(run, step))


def main() -> None:
    ap = bench_parser(__doc__, rounds=3, api_url=True)
    ap.add_argument("--parts", type=int, default=8, help="promotions per round")
    ap.add_argument("--mib", type=float, default=1.0, help="size of each checkpoint")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                    help="the baseline is the agent as it ships with this setting changed (repeatable)")
    args = parse(ap, {"parts": 2})
    load0 = os.getloadavg()[0]
    runs, base_name = contenders(args.baseline_env)
    got: dict[str, list[float]] = {name: [] for name in runs}
    srv: dict[str, list[float]] = {name: [] for name in runs}
    reqs: dict[str, list[float]] = {name: [] for name in runs}
    socks: dict[str, list[float]] = {name: [] for name in runs}
    with (tempfile.TemporaryDirectory(prefix="ckpt-agent-cpu-") as tmp,
          measured_server(args.api_url, Path(tmp)) as server):
        names_ = list(runs)
        for r in range(args.rounds):
            for j in range(len(names_)):
                name = names_[(r + j) % len(names_)]
                agent, server_cpu, requests, sockets = one_round(server, Path(tmp), runs[name], args.parts,
                                                                 args.mib, f"{r}{j}")
                got[name].append(agent)
                srv[name].append(server_cpu)
                reqs[name].append(requests)
                socks[name].append(sockets)
    table(f"agent CPU seconds per promotion (its whole process tree; {args.parts} promotions of {args.mib:g} MiB "
          f"per round, {args.rounds} rounds; the 's' columns are CPU seconds)", got, base_name)
    ours = statistics.median(got[names_[0]])
    base = statistics.median(got[base_name])
    if server.pid is not None:
        table("Prefect server CPU seconds per promotion (same rounds and span; the 's' columns are CPU seconds)",
              srv, base_name)
        for name in names_:
            print(f"API requests per promotion (the runner's polls left out), {name}: "
                  f"{statistics.median(reqs[name]):.1f} "
                  f"(events websockets opened: {statistics.median(socks[name]):.1f})")
    else:
        print("Prefect server: not measured (--api-url: a server this script did not start)")
    print(load_line(load0))
    print(f"agent CPU per promotion: {ours:.3f} s (best {min(got[names_[0]]):.3f})")
    if base_name == names_[0]:
        return
    print(f"ratio: ours / {base_name} = {ours / base:.2f} x CPU per promotion "
          f"(best rounds {min(got[names_[0]]) / min(got[base_name]):.2f} x)")
    if server.pid is not None:
        both = [a + b for a, b in zip(got[names_[0]], srv[names_[0]], strict=True)]
        both_base = [a + b for a, b in zip(got[base_name], srv[base_name], strict=True)]
        print(f"agent + server CPU per promotion: ours {statistics.median(both):.3f} s (best {min(both):.3f}), "
              f"{base_name} {statistics.median(both_base):.3f} s (best {min(both_base):.3f})")
        print(f"ratio: ours / {base_name} = {ratio_of(srv, names_[0], base_name):.2f} x server CPU per promotion, "
              f"{ratio_of(reqs, names_[0], base_name):.2f} x API requests per promotion")


def ratio_of(figures: dict[str, list[float]], name: str, base_name: str) -> float:
    base = statistics.median(figures[base_name])
    return statistics.median(figures[name]) / base if base else 0.0


@contextmanager
def measured_server(api_url: str | None, home: Path) -> Iterator[Server]:
    """The server named by ``api_url`` (not measured), else one started here on SQLite with its
    access log on (its requests are counted), stopped on exit."""
    with prefect_server(api_url, home / "server", access_log=True) as (url, proc):
        yield Server(url) if proc is None else Server(url, proc.pid, home / "server" / "server.log")


if __name__ == "__main__":
    main()
