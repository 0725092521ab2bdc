"""A checkpoint burst: N nodes commit their parts of one checkpoint at the same instant.

Each node is served by its own agent process (``ckpt agent --node ...``, as in production),
Tier 1 (a local folder) and Tier 2 (moto's S3 server) are shared, the catalog is on
PostgreSQL. The checkpoint is a milestone, so durable means every part verified on Tier 1,
the checkpoint complete there once and archived to Tier 2 once. All N parts are committed on
their nodes' Tier 0 first; the burst is one ``POST /events`` carrying the N
``ckpt.checkpoint.completed`` events.

The same burst runs twice in one invocation: against Prefect in its production shape (API
server and services processes on PostgreSQL + Redis, ``ckpt.production_stack``) and, as the
baseline beside it, against a Prefect server on SQLite. Printed per server: time from the
burst to every part verified on Tier 1 and to durable; orchestrator events/s, flow runs/s and
task runs/s sustained over the burst (from the burst to the last flow run's end); CPU seconds
per part spent outside the byte copy (all CPU of the Prefect server processes; the agents with
everything under them: the zygote, the part and checkpoint-run processes it forked and
reaped, flow-run subprocesses; PostgreSQL: the stack's live backends and, through the postmaster's children's
time, the backends that exited during the burst; Redis; less what the same byte work costs done
directly with the transfer engine here; moto not counted), and that CPU split by role.

Memory: an agent's processes (the agent, its zygote, a part's process forked from it while
one runs) at rest, PSS by role, measured and printed for the first agent (it also serves the
cluster's flows) once it serves, alone, and again beside the others, and for a node's agent
(every other one), just before the burst. When N agents
plus one flow run each do not fit in ``--mem-fraction`` of the available memory (the machine is
shared), fewer agent processes run, each serving the parts of several ranks of one node (a node
with several GPUs) one flow run at a time (``--limit 1``); the figures say how many ran.
``--agents N`` caps that count: two versions compared at the count the larger one fitted.

``--baseline-env KEY=VALUE`` adds the same burst on the same stack with one setting of the agents
changed (repeatable), e.g. ``PREFECT_RUNNER_POLL_FREQUENCY=5`` or ``CKPT_TIER1_DIRECT_IO=true``;
the agent count stays the first phase's. ``--env KEY=VALUE`` sets a setting of the agents in every
phase (repeatable; a ``--baseline-env`` of the same key wins in its phase).
``--warm-bursts N`` first makes N earlier checkpoints durable the same way, unmeasured: the burst
then costs what it costs an agent that has promoted before (its catalog connection and compiled
statements, its events client: what a long-running agent has at every checkpoint but its first).
``--rest S`` first watches each phase's served stack for S seconds with nothing to do: its CPU
per second by role (the runner's polls, the event subscriptions, the server's loops), and the
burst's CPU per part above it (its figure less that rate over the burst's span): what the parts
add, apart from what the stack costs whether or not checkpoints come.

    python benchmarks/burst.py --nodes 64 --part-mb 16 [--json burst.json]
    python benchmarks/burst.py --nodes 16 --part-mb 16 --no-sqlite --rest 60
    python benchmarks/burst.py --nodes 64 --part-mb 16 --no-sqlite --mem-fraction 0.7 \
        --baseline-env PREFECT_RUNNER_POLL_FREQUENCY=5
    python benchmarks/burst.py --smoke            # 2 nodes, 1 MB parts
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, cpu_seconds, parse, s3_bucket
from ckpt.client import CheckpointStager
from ckpt.local_stack import stack_env, start_agent, start_prefect_server, wait_deployments
from ckpt.processes import stop_process
from ckpt.production_stack import ProductionStack, create_database, drop_database, pg_url
from core import events
from core.errors import ConfigError
from core.settings import Settings
from core.storage import open_store
from core.transfer import copy_part, verify_part
from db.catalog import Catalog, upgrade
from deployments import names

SMOKE = {"nodes": 2, "part_mb": 1.0}
RUN, STEP = "burst", 1000


# --- the figures (plain, tested in tests/unit/test_burst_summary.py) ----------------------------
@dataclass
class Phase:
    """What one burst against one Prefect server measured."""

    server: str
    parts: int
    agents: int
    verified: int = 0                 # parts verified on Tier 1
    completions: int = 0              # times the checkpoint became complete on Tier 1
    archives: int = 0                 # times it became complete on Tier 2
    to_verified_s: float | None = None
    to_durable_s: float | None = None
    span_s: float = 0.0               # burst -> last flow run's end
    events: int = 0
    flow_runs: int = 0
    task_runs: int = 0
    cpu_s: float = 0.0                # orchestration + byte work, all processes counted
    cpu_by_role: dict[str, float] = field(default_factory=dict)  # the same CPU split: server, agents, database
    copy_cpu_per_part_s: float = 0.0  # the byte work alone, per part
    agent_rss_mb: float = 0.0
    agent_pss_by_role: dict[str, float] = field(default_factory=dict)  # MB: agent, fork server, parts, tracker
    node_agent_pss_by_role: dict[str, float] = field(default_factory=dict)  # the same, a node's agent (--node-only)
    cluster_agent_pss_by_role: dict[str, float] = field(default_factory=dict)  # the first agent's, beside the others
    peak_rss_mb: float = 0.0          # agents and their flow runs together
    window_s: float = 0.0             # the span the burst's CPU was counted over (burst -> all finished)
    rest_s: float = 0.0               # --rest: seconds the stack was watched at rest before the burst
    rest_cores_by_role: dict[str, float] = field(default_factory=dict)  # CPU at rest, cores, by role
    notes: list[str] = field(default_factory=list)

    def rate(self, n: int) -> float:
        return n / self.span_s if self.span_s > 0 else 0.0

    @property
    def cpu_outside_copy_per_part_s(self) -> float:
        return max(0.0, self.cpu_s / self.parts - self.copy_cpu_per_part_s) if self.parts else 0.0

    @property
    def rest_cores(self) -> float:
        return sum(self.rest_cores_by_role.values())

    @property
    def cpu_above_rest_per_part_s(self) -> float | None:
        """CPU per part outside the byte copy less what the stack spends at rest over the same
        span (polls, subscriptions, the server's loops): the cost the parts add. None without --rest."""
        if not self.rest_s or not self.parts or self.to_durable_s is None:
            return None
        return max(0.0, self.cpu_outside_copy_per_part_s - self.rest_cores * self.window_s / self.parts)

    def failures(self) -> list[str]:
        out = []
        if self.verified < self.parts:
            out.append(f"{self.server}: {self.parts - self.verified} of {self.parts} parts not verified on Tier 1")
        if self.completions != 1:
            out.append(f"{self.server}: the checkpoint completed {self.completions} times on Tier 1 (want 1)")
        if self.archives > 1:
            out.append(f"{self.server}: the checkpoint was archived {self.archives} times (want 1)")
        return out


# An agent's process tree (agent, zygote) at rest, measured by ``proc_rss``, grows while a
# part's process (forked from the zygote, sharing the agent's imported pages) runs a
# promotion: the flow run of a checkpoint runs in such a process too, no second interpreter per
# run. 1.5 of the figure at rest leaves room for the busiest agent (docs/benchmarks.md).
BUSY_GROWTH = 1.5


def agents_that_fit(nodes: int, agent_rss: float, available: float, fraction: float) -> int:
    """How many agents fit in ``fraction`` of ``available`` bytes, each its process tree's
    measured PSS at rest (``agent_rss``, its zygote included) times ``BUSY_GROWTH`` for the
    promotion it runs; at least 1, at most ``nodes``."""
    per_agent = BUSY_GROWTH * agent_rss
    return max(1, min(nodes, int(fraction * available // per_agent)))


def fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.1f} {unit}".strip()


def report(phases: list[Phase]) -> str:
    """The table: one column per server, the last column the first server over the second."""
    rows = [
        ("agent processes (parts)", lambda p: f"{p.agents} ({p.parts})"),
        ("burst -> all parts verified on Tier 1", lambda p: fmt(p.to_verified_s)),
        ("burst -> durable (complete + archived)", lambda p: fmt(p.to_durable_s)),
        ("parts verified / completions / archives", lambda p: f"{p.verified} / {p.completions} / {p.archives}"),
        ("events/s sustained", lambda p: f"{p.rate(p.events):.1f} ({p.events})"),
        ("flow runs/s sustained", lambda p: f"{p.rate(p.flow_runs):.2f} ({p.flow_runs})"),
        ("task runs/s sustained", lambda p: f"{p.rate(p.task_runs):.1f} ({p.task_runs})"),
        ("CPU s per part outside the byte copy", lambda p: f"{p.cpu_outside_copy_per_part_s:.2f}"),
        ("  of which above the stack at rest", lambda p: (
            "-" if p.cpu_above_rest_per_part_s is None else f"{p.cpu_above_rest_per_part_s:.2f}")),
        ("CPU at rest, cores: server / agents / db", lambda p: " / ".join(
            f"{p.rest_cores_by_role.get(r, 0.0):.3f}" for r in CPU_ROLES) if p.rest_s else "-"),
        ("CPU s per part, byte copy alone", lambda p: f"{p.copy_cpu_per_part_s:.3f}"),
        ("CPU s per part: server / agents / database", lambda p: " / ".join(
            f"{p.cpu_by_role.get(r, 0.0) / p.parts:.2f}" if p.parts else "-" for r in CPU_ROLES)),
        ("PSS per agent (its processes) / peak all", lambda p: f"{p.agent_rss_mb:.0f} / {p.peak_rss_mb:.0f} MB"),
        ("  agent / fork server / parts / tracker", lambda p: " / ".join(
            f"{p.agent_pss_by_role.get(r, 0.0):.0f}" for r in PSS_ROLES) + " MB"),
        ("PSS per cluster agent, beside all agents", lambda p: (
            f"{sum(p.cluster_agent_pss_by_role.values()):.0f} MB" if p.cluster_agent_pss_by_role else "-")),
        ("PSS per node agent (--node-only), at rest", lambda p: (
            f"{sum(p.node_agent_pss_by_role.values()):.0f} MB" if p.node_agent_pss_by_role else "-")),
        ("  agent / fork server / parts / tracker", lambda p: " / ".join(
            f"{p.node_agent_pss_by_role.get(r, 0.0):.0f}" for r in PSS_ROLES) + " MB"
            if p.node_agent_pss_by_role else "-"),
    ]
    width = 42
    lines = [f"{'':{width}}" + "".join(f"{p.server:>26}" for p in phases)]
    for name, get in rows:
        lines.append(f"{name:{width}}" + "".join(f"{get(p):>26}" for p in phases))
    if len(phases) == 2 and phases[0].to_durable_s and phases[1].to_durable_s:
        lines.append(f"durable time, {phases[0].server} / {phases[1].server}: "
                     f"x{phases[0].to_durable_s / phases[1].to_durable_s:.2f}")
    return "\n".join(lines)


def last_line(prod: Phase, sqlite: Phase | None) -> str:
    theirs = "skipped" if sqlite is None else "never"
    if sqlite is not None and sqlite.to_durable_s:
        theirs = f"{sqlite.to_durable_s:.1f} s"
    ours = f"{prod.to_durable_s:.1f} s" if prod.to_durable_s else "never"
    return (f"burst: {prod.verified}/{prod.parts} parts verified, {prod.completions} completion"
            f"{'' if prod.completions == 1 else 's'}, durable in {ours} (sqlite server: {theirs})")


# --- measuring ----------------------------------------------------------------------------------
def proc_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its waited-for children (flow runs an agent reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


CPU_ROLES = ("server", "agents", "database")
PSS_ROLES = ("agent", "fork server", "part process", "resource tracker")


def children(pid: int) -> list[int]:
    """The live children of ``pid``, whichever of its threads started them (the agent starts its
    zygote from its main thread, Prefect's runner its flow runs from others, and /proc lists a
    child under the thread that forked it)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return out


def descendants(pid: int) -> list[int]:
    """The live processes under ``pid`` (its fork server, part processes, flow runs)."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings of ``proc_cpu`` over sets of processes. A process
    gone by the second reading counts -before: its whole CPU is then in its reaper's children's
    time (the fork server's for a part's process, the postmaster's for a database backend), which
    is in the second reading; a process new in the second counts in full."""
    return sum(after.get(pid, 0.0) - before.get(pid, 0.0) for pid in set(before) | set(after))


def role_pss(pid: int) -> dict[str, float]:
    """MB of PSS of an agent's processes by role: the agent, its fork server (the zygote, forked
    from the agent at its start; a resource tracker, if one runs, apart) and the part and
    checkpoint-run processes (forked from the zygote)."""
    def pss(p: int) -> float:
        try:
            return sum(int(line.split()[1]) for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
                       if line.startswith("Pss:")) * 1024 / 1e6  # kB -> MB
        except OSError:
            return 0.0

    out = {"agent": pss(pid)}
    for child in children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_text()
        except OSError:
            continue
        if "resource_tracker" in cmd:
            out["resource tracker"] = out.get("resource tracker", 0.0) + pss(child)
        else:
            out["fork server"] = out.get("fork server", 0.0) + pss(child)
            forked = descendants(child)
            out["part process"] = out.get("part process", 0.0) + sum(pss(w) for w in forked)
    return out


def postmaster(backends: list[int]) -> list[int]:
    """PostgreSQL's postmaster (the parent of a backend): its children's time holds the CPU of
    the backends that exited during the burst (each flow run's connections)."""
    for pid in backends:
        try:
            return [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])]
        except OSError:
            continue
    return []


def redis_pids() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == "redis-server":
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def proc_rss(pid: int) -> float:
    """Memory of ``pid`` and its live children (the agent's fork server and the part processes
    forked from it, its flow runs): the sum of their PSS, each page they share divided among
    the processes mapping it (RSS added up would count the agent's pages three times: the fork
    server and the part processes share them copy-on-write); VmRSS where smaps_rollup is missing."""
    total = 0.0
    try:
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            key = "Pss:"
        except OSError:
            lines, key = Path(f"/proc/{pid}/status").read_text().splitlines(), "VmRSS:"
        for line in lines:
            if line.startswith(key):
                total += int(line.split()[1]) * 1024
        for child in children(pid):
            total += proc_rss(child)
    except OSError:
        pass
    return total


def mem_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0.0


def pg_backends(admin_dsn: str, databases: list[str]) -> list[int]:
    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s)",
                                           (databases,))]


def byte_copy_cpu(settings, manifest, prefix: str, scratch: str, rounds: int = 3) -> float:
    """CPU seconds of one part's byte work done directly: verify on Tier 0, copy to Tier 1
    (read back inside), and when Tier 2 is on, copy to Tier 2. The least of ``rounds`` (each to
    fresh copies): a round that shared the cores with the agents settling costs more, and
    counting that as byte work would understate what the burst spends outside it (one round
    per phase read 0.08 and 0.28 CPU s for the same 16 MB part in one run)."""
    t0 = open_store(settings.tier0_url, 0, settings)
    spent = []
    for r in range(rounds):
        c0 = cpu_seconds()
        verify_part(t0, prefix, manifest)
        root = Path(scratch) / f"tier1-{r}"
        root.mkdir(parents=True, exist_ok=True)  # the scratch "mount": a store never creates its root
        t1 = open_store(str(root), 1, settings)
        copy_part(t0, prefix, t1, prefix, manifest)
        if settings.tier2_url:
            t2 = open_store(settings.tier2_url.rstrip("/") + f"-bytecopy-{r}", 2, settings)
            copy_part(t1, prefix, t2, prefix, manifest)
        spent.append(cpu_seconds() - c0)
    return min(spent)


def api_counts(api: str, t0: float, t_end: float) -> tuple[int, int, int, float]:
    """(events, promote+archive flow runs, task runs, seconds from t0 to the last flow run's end)."""
    import httpx

    since = _iso(t0 - 1)
    until = _iso(t_end + 1)
    ev = httpx.post(f"{api}/events/filter", json={"filter": {"occurred": {"since": since, "until": until}},
                                                   "limit": 1}, timeout=60).json()
    flows = {"flows": {"name": {"any_": [names.PROMOTE_FLOW, names.ARCHIVE_DEPLOYMENT.split("/")[0]]}},
             "flow_runs": {"expected_start_time": {"after_": since}}}
    runs = httpx.post(f"{api}/flow_runs/filter", json={**flows, "limit": 200}, timeout=60).json()
    tasks = httpx.post(f"{api}/task_runs/count",
                       json={"task_runs": {"start_time": {"after_": since}}}, timeout=60).json()
    ends = [datetime_ts(r["end_time"]) for r in runs if r.get("end_time")]
    return int(ev.get("total", 0)), len(runs), int(tasks), (max(ends) - t0) if ends else 0.0


def _iso(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).isoformat()


def datetime_ts(s: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(s).timestamp()


# --- one burst against one server ---------------------------------------------------------------
@dataclass
class Setup:
    work: Path
    pg_admin: str          # libpq DSN of the PostgreSQL server (catalog databases)
    s3_url: str
    bucket: str
    nodes: int
    part_mb: float
    mem_fraction: float
    timeout: float
    agents: int | None = None  # decided by the first phase, kept for the second
    rest_s: float = 0.0        # --rest: seconds to watch each phase's stack at rest before its burst
    warm_bursts: int = 0       # --warm-bursts: checkpoints burst and made durable before the one measured
    most_agents: int | None = None  # --agents: a cap on the agent count
    fit: int | None = None  # how many agents fitted in memory (the first phase's figure)


def run_phase(name: str, api: str, server_pids: list[int], server_dbs: list[str], setup: Setup,
              env_extra: dict[str, str] | None = None) -> Phase:
    import httpx
    import numpy as np

    tag = uuid.uuid4().hex[:6]
    run = f"{RUN}-{tag}"  # the events' ids derive from run/step/part: a second phase on one server is not a duplicate
    root = setup.work / name
    catalog_db = f"ckpt_burst_{os.getpid()}_{tag}"
    create_database(setup.pg_admin, catalog_db)
    catalog_url = pg_url(setup.pg_admin, catalog_db, "psycopg")
    procs: list = []
    try:
        upgrade(catalog_url)
        env = stack_env(root / "data", api_url=api, s3_url=setup.s3_url, bucket=setup.bucket,
                        catalog_url=catalog_url)
        env.update(CKPT_RECONCILE_INTERVAL_SECONDS="3600",      # the burst is about events
                   CKPT_PART_SCAN_SECONDS="60",  # checkpoint runs: parts are committed a while before the burst
                   CKPT_TIER2_URL=f"s3://{setup.bucket}/{name}-{tag}")
        env.pop("PREFECT_RUNNER_POLL_FREQUENCY")  # the agents' own defaults, not the local stack's fast poll
        env.update(env_extra or {})
        node = [f"b{tag}-n{i:02d}" for i in range(setup.nodes)]
        first = start_agent(env, root / "logs" / f"agent-{node[0]}.log", node=node[0])
        procs.append(first)
        wait_deployments(api, [names.promote_deployment(node[0]), names.ARCHIVE_DEPLOYMENT], timeout=300,
                         procs=procs)
        agent_rss = proc_rss(first.pid)
        agent_roles = role_pss(first.pid)
        if setup.agents is None:
            setup.fit = agents_that_fit(setup.nodes, agent_rss, mem_available(), setup.mem_fraction)
            setup.agents = min(setup.fit, setup.most_agents or setup.fit)
        k = setup.agents
        phase = Phase(name, setup.nodes, k, agent_rss_mb=agent_rss / 1e6, agent_pss_by_role=agent_roles)
        limit = None if k == setup.nodes else 1
        if k < setup.nodes:
            fit = setup.fit or k
            phase.notes.append(f"{setup.nodes} agents, each running a promotion, would need ~"
                               f"{setup.nodes * BUSY_GROWTH * agent_rss / 1e9:.1f} GB; {fit} fit in "
                               f"{setup.mem_fraction:.0%} of the available memory"
                               + (f" (--agents: {k})" if k < fit else "") + f": {k} agents, "
                               f"~{math.ceil(setup.nodes / k)} parts each, "
                               "one flow run at a time")
        if limit:  # the first agent was started unlimited: restart it like the others
            stop_process(first)
            procs.clear()

        def start(i: int):
            return start_agent(env, root / "logs" / f"agent-{node[i]}.log", node=node[i], node_only=i > 0,
                               limit=limit)

        procs.extend(start(i) for i in range(len(procs), k))
        serve_all(api, node[:k], procs, start, phase, root / "logs")
        owner = [node[p % k] for p in range(setup.nodes)]

        rng = np.random.default_rng(0)
        size = max(1, int(setup.part_mb * 1e6 / 4))

        def commit(step: int):
            """Every part of ``step`` committed on its node's Tier 0, nothing announced yet."""
            first_saved = None
            for p in range(setup.nodes):
                s = Settings(**{key[5:].lower(): v for key, v in env.items() if key.startswith("CKPT_")},
                             node=owner[p])
                with CheckpointStager(run, settings=s, part=p, parts=setup.nodes, announce=False,
                                      shard_bytes=4 << 20) as st:
                    saved = st.save(step, {"w": rng.standard_normal(size, dtype=np.float32)}, milestone=True)
                first_saved = first_saved or (s, saved)
            return first_saved

        def burst(step: int) -> float:
            body = [events.build_event(events.COMPLETED, run, step, part=p, parts=setup.nodes, node=owner[p],
                                       payload={"kind": "milestone"}) for p in range(setup.nodes)]
            t = time.time()
            httpx.post(f"{api}/events", json=body, timeout=60).raise_for_status()
            return t

        for w in range(setup.warm_bursts):  # earlier checkpoints, not measured: the agents as they run for days
            step = STEP - setup.warm_bursts + w
            commit(step)
            t = burst(step)
            wait_for(f"warm-up checkpoint {step} durable", lambda st=step: _durable(catalog_url, run, st)
                     and _all_finished(api), timeout=setup.timeout)
            phase.notes.append(f"checkpoint {step}, before the one measured, durable in {time.time() - t:.1f} s")
        admin = setup.pg_admin

        def cpu_now() -> dict[str, dict[int, float]]:
            """Every process that works for the burst, by role, with its CPU so far (children's
            time included: the part processes a fork server reaped, the backends the postmaster
            reaped)."""
            agents = [q for proc in procs for q in (proc.pid, *descendants(proc.pid))]
            backends = pg_backends(admin, [*server_dbs, catalog_db])
            db = backends + postmaster(backends) + redis_pids()
            return {"server": {q: proc_cpu(q) for q in server_pids},
                    "agents": {q: proc_cpu(q) for q in agents}, "database": {q: proc_cpu(q) for q in db}}

        if k > 1:  # every agent but the first serves its node only (63 of 64): at rest, just before the burst
            phase.node_agent_pss_by_role = role_pss(procs[1].pid)
            # and the first, the cluster's, at the same moment: the libraries' pages it maps are
            # shared by every agent now, as in the node's figure (the first figure is its alone)
            phase.cluster_agent_pss_by_role = role_pss(procs[0].pid)
        if setup.rest_s:  # the same processes, nothing to do: what the stack costs per second at rest
            rest0, r0 = cpu_now(), time.monotonic()
            time.sleep(setup.rest_s)
            rest1, phase.rest_s = cpu_now(), time.monotonic() - r0
            phase.rest_cores_by_role = {role: cpu_between(rest0[role], rest1[role]) / phase.rest_s
                                        for role in CPU_ROLES}
        s0, saved0 = commit(STEP)  # right before it is announced, as a job does (the agents' Tier 0 scan waits 60 s)
        cpu0 = cpu_now()
        t0 = burst(STEP)

        cat = Catalog(catalog_url)
        try:
            deadline = time.monotonic() + setup.timeout
            while time.monotonic() < deadline:
                phase.peak_rss_mb = max(phase.peak_rss_mb, sum(proc_rss(p.pid) for p in procs) / 1e6)
                try:
                    ck = cat.get_checkpoint(run, STEP)
                    phase.verified = sum(r.state == "verified" for r in cat.replicas(ck.id, tier=1))
                    done = [h.to_state for h in cat.history(run, STEP) if h.action == "complete"]
                except Exception:  # noqa: BLE001 - not registered yet
                    ck, done = None, []
                now = time.time() - t0
                if phase.verified == setup.nodes and phase.to_verified_s is None:
                    phase.to_verified_s = now
                if "tier2" in done and phase.to_durable_s is None:
                    phase.to_durable_s = now
                if phase.to_durable_s is not None and _all_finished(api):
                    break
                time.sleep(0.5)
            phase.completions, phase.archives = done.count("tier1"), done.count("tier2")
        finally:
            cat.close()
        t_end = time.time()
        cpu1 = cpu_now()
        phase.window_s = t_end - t0
        phase.cpu_by_role = {role: cpu_between(cpu0[role], cpu1[role]) for role in CPU_ROLES}
        phase.cpu_s = sum(phase.cpu_by_role.values())
        phase.copy_cpu_per_part_s = byte_copy_cpu(s0, saved0.manifest, f"{run}/step-{STEP:08d}",
                                                  str(root / "bytecopy"))
        time.sleep(3)  # the event persister writes in batches
        phase.events, phase.flow_runs, phase.task_runs, phase.span_s = api_counts(api, t0, t_end)
        return phase
    finally:
        for p in procs:  # all at once, then one by one (each gets its grace period from now)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            stop_process(p)
        drop_database(setup.pg_admin, catalog_db)


def serve_all(api: str, nodes: list[str], procs: list, start, phase: Phase, logs: Path, restarts: int = 3) -> None:
    """Until every node's promote deployment (and the archive) is served. An agent that exits
    first is started again, as a service manager would (compose: ``restart: unless-stopped``),
    and the phase notes it with the end of its log (a SQLite server answering "database is
    locked" to many agents registering at once is one cause)."""
    wanted = [names.promote_deployment(n) for n in nodes] + [names.ARCHIVE_DEPLOYMENT]
    for attempt in range(restarts + 1):
        try:
            wait_deployments(api, wanted, timeout=120 + 15 * len(nodes), procs=procs)
            return
        except ConfigError:
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if not dead or attempt == restarts:
                raise
            for i in dead:
                log = (logs / f"agent-{nodes[i]}.log").read_text(errors="replace").strip().splitlines()
                phase.notes.append(f"agent {nodes[i]} exited with {procs[i].returncode} while starting "
                                   f"({log[-1][:200] if log else 'no log'}); restarted")
                procs[i] = start(i)


def _durable(catalog_url: str, run: str, step: int) -> bool:
    cat = Catalog(catalog_url)
    try:
        return "tier2" in [h.to_state for h in cat.history(run, step) if h.action == "complete"]
    except Exception:  # noqa: BLE001 - not registered yet
        return False
    finally:
        cat.close()


def wait_for(what: str, pred, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.5)


def _all_finished(api: str) -> bool:
    import httpx

    r = httpx.post(f"{api}/flow_runs/count", json={"flow_runs": {"state": {"type": {"any_": [
        "SCHEDULED", "PENDING", "RUNNING"]}}, "name": {"like_": RUN}}}, timeout=30)
    return r.status_code == 200 and r.json() == 0


def guarded(name: str, setup: Setup, run) -> Phase:
    """``run()``'s phase, printed at once; a phase that raised is a failed phase that says why
    (the other server's figures still print)."""
    try:
        phase = run()
    except Exception as exc:  # noqa: BLE001 - reported as the phase's failure
        phase = Phase(name, setup.nodes, setup.agents or 0, notes=[f"FAILED: {type(exc).__name__}: {exc}"])
    print(report([phase]), flush=True)
    return phase


# --- main ---------------------------------------------------------------------------------------
def main() -> int:
    ap = bench_parser(__doc__, rounds=1, s3_endpoint=True)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--part-mb", type=float, default=16.0)
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="share of the available memory the agents and their flow runs may use")
    ap.add_argument("--agents", type=int, default=None,
                    help="at most this many agent processes (a comparison at the count a baseline fitted)")
    ap.add_argument("--pg-url", default=os.environ.get("CKPT_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    ap.add_argument("--no-sqlite", action="store_true", help="skip the SQLite server baseline")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                    help="also run the same burst on the same stack with this setting in the agents' environment "
                         "(repeatable: one phase each), e.g. PREFECT_RUNNER_POLL_FREQUENCY=5")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting in the agents' environment in every phase (repeatable), e.g. "
                         "CKPT_TIER1_DIRECT_IO=true")
    ap.add_argument("--rest", type=float, default=0.0, metavar="SECONDS",
                    help="first watch the served stack at rest this long: its CPU per second (runner polls, event "
                         "subscriptions, the server's loops) and the burst's CPU per part above it")
    ap.add_argument("--warm-bursts", type=int, default=0, metavar="N",
                    help="first make N earlier checkpoints durable the same way, not measured: the burst then "
                         "measures agents that have promoted before (a long-running agent's steady state), "
                         "and the memory at rest of a node's agent is read after them")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a burst may take")
    ap.add_argument("--json", default=None, help="also write the figures here (ckpt plan --burst-report)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = parse(ap, SMOKE)
    if args.agents is not None and args.agents < 1:
        ap.error("--agents must be 1 or more")

    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="ckpt-burst-", dir=args.dir))
    common = dict(setting.partition("=")[::2] for setting in args.env)
    phases: list[Phase] = []
    cold: list[Phase] = []  # --baseline-env: printed after the others, never the exit status
    load0 = os.getloadavg()[0]
    try:
        with s3_bucket(args.s3_endpoint, work / "moto.log") as (s3_url, bucket):
            setup = Setup(work, args.pg_url, s3_url, bucket, args.nodes, args.part_mb, args.mem_fraction,
                          args.timeout, rest_s=args.rest, warm_bursts=args.warm_bursts, most_agents=args.agents)
            prefect_db = f"ckpt_prefect_{os.getpid()}_{uuid.uuid4().hex[:6]}"
            with ProductionStack(work / "prefect-prod", pg_server_url=args.pg_url, redis_url=args.redis_url,
                                 prefect_database=prefect_db, catalog_database=None, port=None, ui=False,
                                 fresh=True) as stack:
                print(f"production stack up in {stack.start_seconds:.1f} s: {stack.describe()}", flush=True)
                phases.append(guarded("postgres+redis", setup, lambda: run_phase(
                    "postgres+redis", stack.api_url, [p.pid for p in stack.procs], [prefect_db], setup,
                    env_extra=common)))
                for setting in args.baseline_env:  # the same burst, same stack and agent count, one setting changed
                    key, _, value = setting.partition("=")
                    cold.append(guarded(f"pg+redis, {setting}", setup, lambda k=key, v=value: run_phase(
                        f"pg+redis, {k}={v}", stack.api_url, [p.pid for p in stack.procs], [prefect_db], setup,
                        env_extra={**common, k: v})))
            if not args.no_sqlite:
                t = time.monotonic()
                proc, url = start_prefect_server(work / "prefect-sqlite", port=None, ui=False)
                try:
                    print(f"sqlite server up in {time.monotonic() - t:.1f} s", flush=True)
                    phases.append(guarded("sqlite", setup, lambda: run_phase("sqlite", url, [proc.pid], [], setup,
                                                                             env_extra=common)))
                finally:
                    stop_process(proc, grace=20.0)
    finally:
        if any(p.failures() for p in phases + cold):  # keep the logs, not the checkpoints
            for data in work.glob("*/data"):
                shutil.rmtree(data, ignore_errors=True)
            print(f"logs kept under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    if common:
        print("every phase: " + " ".join(f"{k}={v}" for k, v in common.items()))
    print(f"{args.nodes} parts of {args.part_mb:g} MB, one milestone checkpoint; load average at start {load0:.1f}, "
          f"now {os.getloadavg()[0]:.1f} (2 cores shared: figures are noisy, compare the columns)")
    for p in phases + cold:
        for note in p.notes:
            print(f"{p.server}: {note}")
    print(report(phases + cold))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) | {
            "events_per_s": p.rate(p.events), "flow_runs_per_s": p.rate(p.flow_runs),
            "task_runs_per_s": p.rate(p.task_runs),
            "cpu_outside_copy_per_part_s": p.cpu_outside_copy_per_part_s} for p in phases + cold], indent=1))
    # the exit status is the production shape's; the SQLite server is the baseline beside it, whose
    # losses under a burst are a finding of the run (the reason for the production shape), not a failure
    problems = phases[0].failures() if phases else ["no phase ran"]
    for f in problems:
        print(f"FAILED: {f}")
    for p in phases[1:] + cold:
        for f in p.failures():
            print(f"baseline {p.server}: {f}")
    print(last_line(phases[0], phases[1] if len(phases) > 1 else None))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
