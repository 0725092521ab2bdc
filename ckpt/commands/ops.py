"""Operating commands: ``ckpt plan`` (sizing), ``ckpt agent`` (serve the deployments),
``ckpt watch`` (announce checkpoints a job wrote), ``ckpt up`` (the local stack) and
``ckpt run register``. Heavy imports happen inside the commands, never at import time."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

from ckpt.args import count_arg, part_arg, parts_arg, step_arg
from ckpt.production_stack import DEFAULT_PG_URL, DEFAULT_REDIS_URL, ProductionStack
from ckpt.tables import table as fit_table
from core import sizing
from core.errors import BadArgument, BadInput, quoted
from core.paths import safe_run_name
from core.sizing import OrchestrationLoad, Plan, RecoveryModel, RunFigure, fmt_bytes, fmt_percent, fmt_seconds
from core.tier_figures import Spread
from deployments.names import NODE_POLL_S

if TYPE_CHECKING:
    from ckpt.client import OriginKeywords, SavedCheckpoint

_D = TypeVar("_D")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
    app.command("agent")(agent_cmd)
    app.command("watch")(watch_cmd)
    app.command("up")(up_cmd)
    run_app = typer.Typer(help="Training runs in the catalog.", no_args_is_help=True)
    run_app.command("register")(run_register_cmd)
    app.add_typer(run_app, name="run")


# --- ckpt plan -------------------------------------------------------------------------------
def plan_cmd(
    params: str | None = typer.Option(None, "--params", help="model parameters, e.g. 70B (checkpoint = 14 bytes each)"),
    size: str | None = typer.Option(None, "--size", help="checkpoint size instead of --params, e.g. 980GB"),
    interval: str = typer.Option("30m", "--interval", help="time between checkpoints, e.g. 30m"),
    bandwidth: list[str] = typer.Option([], "--bandwidth", help="write bandwidth; repeat to compare [the median "
                                        "of the last day's checkpoints copied into Tier 1, all parts together, in "
                                        "the catalog, else 2GB/s]"),
    runs: bool = typer.Option(True, "--runs/--no-runs", help="also show each run's measured ΔMFU from the catalog"),
    nodes: int | None = typer.Option(None, "--nodes", parser=count_arg("nodes", 1, 1_000_000),
                                     help="cluster size: add the orchestration load of one "
                              "checkpoint burst of this many nodes on one Prefect server"),
    burst_report: Path | None = typer.Option(None, "--burst-report", help="server capacity from a "
                                      "`benchmarks/burst.py --json` report instead of the built-in measurement"),
    poll_seconds: float | None = typer.Option(None, "--poll-seconds", min=0.1, help="how often each agent's "
                                       "runner polls the server [PREFECT_RUNNER_POLL_FREQUENCY, else a node "
                                       "agent's 30]"),
    server_cores: float = typer.Option(1.0, "--server-cores", min=0.1, help="cores of the Prefect server's "
                                       "processes (API workers)"),
    mtbf: str | None = typer.Option(None, "--mtbf", help="mean time between failures of the whole job, e.g. 3h: "
                             "add the work lost per failure, the total overhead and the best interval"),
    tier0_read: str | None = typer.Option(None, "--tier0-read", help="a node's NVMe read bandwidth [7GB/s]"),
    tier1_read: str | None = typer.Option(None, "--tier1-read", help="the shared file system's aggregate read "
                                   "bandwidth [the median of the last day's restore drills from Tier 1 in the "
                                   "catalog, else the --bandwidth of each row]"),
    s3_streams: int = typer.Option(16, "--s3-streams", parser=count_arg("s3-streams", 1, 4096),
                                   help="parallel S3 GET connections per node"),
    s3_stream: str | None = typer.Option(None, "--s3-stream", help="one S3 connection's bandwidth [90MB/s]"),
    node_link: str | None = typer.Option(None, "--node-link", help="a node's network link [12.5GB/s, 100 Gb/s]"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The sizing model: checkpoint size, save time and compute lost (ΔMFU), per bandwidth,
    plus each run's measured ΔMFU from the writer stall times in the catalog; the recovery
    time per tier (one node, and every node of --nodes at once); with --mtbf the work lost per
    failure, the total overhead and the interval that minimises it. With --nodes, the
    orchestration load of a cluster that size on one Prefect server (PostgreSQL + Redis) and
    the cluster size that saturates it. A bandwidth not given is the one this cluster measured
    (the last day's hops in the catalog, as ckpt tiers shows them) where it has one, else
    the model's default; the output says which."""
    if params is not None and size is not None:
        raise BadArgument("give one of --params (e.g. 70B) or --size (e.g. 980GB), not both")
    if params is None and size is None and nodes is None:
        raise BadArgument("give --params (e.g. 70B), --size (e.g. 980GB) or --nodes (e.g. 64)")
    secs = sizing.parse_duration(interval)
    plans: list[sizing.Plan] = []
    volume = (sizing.parse_size(size) if size is not None
              else sizing.BYTES_PER_PARAM * sizing.parse_params(params) if params is not None else None)
    sources: list[BandwidthSource] = []
    tier1_measured: float | None = None
    if volume is not None:
        measured = _measured_bandwidths() if not bandwidth or tier1_read is None else {}
        writes = [sizing.parse_bandwidth(b) for b in bandwidth]
        if not writes:
            write = measured.get((1, "write"))
            writes = [write.median if write is not None else DEFAULT_WRITE]
            sources.append(_source("write", write, DEFAULT_WRITE, "checkpoints copied into Tier 1 (all parts)"))
        plans = [sizing.Plan(volume, secs, b) for b in writes]
        if tier1_read is None and (read := measured.get((1, "read"))) is not None:
            sources.append(_source("Tier 1 read", read, None, "restore drills from Tier 1"))
            tier1_measured = read.median
        elif tier1_read is None:
            sources.append(BandwidthSource("Tier 1 read", None, "default", 0, "the write bandwidth of each row (no "
                                           "restore drill from Tier 1 recorded over the last day)"))
    load = _load(nodes, secs, burst_report, poll_seconds, server_cores) if nodes is not None else None
    model = _recovery_model(tier0_read, tier1_read, s3_streams, s3_stream, node_link, tier1_measured)
    failures_every = sizing.parse_duration(mtbf, "MTBF") if mtbf is not None else None
    recovery = [_recovery(p, nodes or 1, model, failures_every) for p in plans]
    figures = _measured_runs() if runs and plans else []
    if as_json:
        out: dict = {"model": [{"checkpoint_bytes": p.checkpoint_bytes, "interval_seconds": p.interval_seconds,
                                "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s, "save_seconds": p.save_seconds,
                                "delta_mfu": p.delta_mfu} for p in plans],
                     "runs": [f.__dict__ for f in figures], "recovery": recovery,
                     "bandwidths": [s.__dict__ for s in sources]}
        if load is not None:
            out["orchestration"] = {"nodes": load.nodes, "interval_seconds": load.interval_seconds,
                                    "flow_runs_per_burst": load.flow_runs_per_burst,
                                    "task_runs_per_burst": load.task_runs_per_burst,
                                    "poll_seconds": load.poll_seconds, "server_cores": load.server_cores,
                                    "rest_cores": load.rest_cores, "cpu_seconds": _finite(load.cpu_seconds),
                                    "drain_seconds": _finite(load.drain_seconds),
                                    "utilisation": _finite(load.utilisation),
                                    "saturation_nodes": load.saturation_nodes,
                                    "capacity": load.capacity.__dict__,
                                    "rest": load.rest.__dict__ if load.rest is not None else None}
        typer.echo(json.dumps(out, indent=1))
        return
    for src in sources:
        typer.echo(src.line())
    if plans:
        _print_plan(plans, figures)
        _print_recovery(recovery)
    if load is not None:
        _print_load(load)


DEFAULT_WRITE = 2e9  # the model's write bandwidth where neither --bandwidth nor a measured hop gives one


@dataclass(frozen=True)
class BandwidthSource:
    """Where a bandwidth of the plan came from: ``measured`` (the median of ``hops`` over the
    last day), or the model's ``default``."""

    what: str
    bytes_per_s: float | None  # None: a default that is another figure (``detail``)
    source: str  # 'measured' | 'default'
    hops: int
    detail: str

    def line(self) -> str:
        shown = f"{fmt_bytes(self.bytes_per_s)}/s, " if self.bytes_per_s is not None else ""
        said = "measured" if self.source == "measured" else "the model's default"
        return f"{self.what} bandwidth: {shown}{said}: {self.detail}"


def _source(what: str, spread: Spread | None, default: float | None, hops: str) -> BandwidthSource:
    if spread is not None:
        return BandwidthSource(what, spread.median, "measured", spread.count,
                               f"the median of {spread.count} {hops} over the last day (p95 {fmt_bytes(spread.p95)}/s)")
    assert default is not None
    return BandwidthSource(what, default, "default", 0, f"no {hops} recorded over the last day")


def _measured_bandwidths() -> dict[tuple[int, str], Spread]:
    """The last day's bandwidths per tier from the catalog; an unreachable catalog gives none
    (with a note: the model stands on its defaults)."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings

    try:
        from tasks.tier_matrix import measured_bandwidths  # deferred: start-up — SQLAlchemy, the stores

        return measured_bandwidths(load_settings())
    except Exception as exc:  # noqa: BLE001 - the model's defaults stand without the catalog
        typer.echo(f"(no measured bandwidths: catalog not readable: {type(exc).__name__}: {exc})", err=True)
        return {}


def _finite(x: float | None) -> float | None:
    """``x`` for JSON: None where it is infinite (a server its idle agents saturate never drains)."""
    return x if x is not None and math.isfinite(x) else None


def _load(nodes: int, secs: float, burst_report: Path | None, poll_seconds: float | None,
          server_cores: float) -> OrchestrationLoad:
    """The orchestration load of ``nodes`` under the runners' poll of this environment, with the
    built-in measurement or a burst report's."""
    rest: sizing.RestLoad | None = sizing.MEASURED_REST
    if burst_report is not None:
        report = json.loads(burst_report.read_text())
        capacity, rest = sizing.capacity_from_report(report), sizing.rest_from_report(report)
    else:
        capacity = sizing.measured_capacity()
    if poll_seconds is None:
        poll = os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY", str(NODE_POLL_S))
        try:
            poll_seconds = float(poll)
        except ValueError:
            raise BadInput(f"PREFECT_RUNNER_POLL_FREQUENCY={poll!r}: not a number of seconds") from None
    return sizing.OrchestrationLoad(nodes, secs, capacity, rest=rest, poll_seconds=poll_seconds,
                                    server_cores=server_cores)


def _print_load(load: OrchestrationLoad) -> None:
    c, r = load.capacity, load.rest
    typer.echo(f"Orchestration load: {load.nodes} nodes, one checkpoint every {fmt_seconds(load.interval_seconds)}")
    typer.echo(f"  per burst: {load.flow_runs_per_burst:.0f} flow runs, {load.task_runs_per_burst:.0f} task runs "
               f"({c.flow_runs_per_part:.3g} flow and {c.task_runs_per_part:.3g} task runs per part, "
               f"{c.flow_runs_per_checkpoint:.3g} and {c.task_runs_per_checkpoint:.3g} per checkpoint)")
    typer.echo(f"  one server sustains {c.flow_runs_per_s:g} flow runs/s, {c.task_runs_per_s:g} task runs/s "
               f"[{c.source}]")
    if r is None:
        typer.echo("  at rest: not modelled (the burst report did not watch the stack at rest: burst.py --rest)")
    else:
        typer.echo(f"  at rest, {load.nodes} agents polling every {fmt_seconds(load.poll_seconds)} take "
                   f"{load.rest_cores:.2f} of the server's {load.server_cores:g} core(s) "
                   f"({r.base_cores:.3f} cores of its own, {r.cpu_per_poll * 1000:.1f} ms a poll, "
                   f"{r.cores_per_agent * 1000:.2f} millicores an agent besides [{r.source}])")
    if load.cpu_seconds is not None:
        per_part = f"{c.cpu_per_part:.3f} CPU s per part" if c.cpu_per_part is not None else "no CPU left"
        typer.echo(f"  its processes' CPU for a burst ({per_part}) takes "
                   f"{fmt_seconds(load.cpu_seconds) if math.isfinite(load.cpu_seconds) else 'forever'} "
                   f"on what the idle agents leave")
    if math.isfinite(load.drain_seconds):
        typer.echo(f"  it drains a burst in {fmt_seconds(load.drain_seconds)}: {fmt_percent(load.utilisation)} "
                   "of the interval")
    else:
        typer.echo("  it never drains a burst: its idle agents take every core it has")
    n = load.saturation_nodes
    typer.echo(f"  one server on PostgreSQL + Redis is saturated at {n} nodes (a burst then takes the whole interval)"
               if n is not None else f"  one server on PostgreSQL + Redis is not saturated below "
               f"{sizing.SATURATION_LIMIT:,} nodes")


def _recovery_model(tier0_read: str | None, tier1_read: str | None, s3_streams: int, s3_stream: str | None,
                    node_link: str | None, tier1_measured: float | None = None) -> RecoveryModel:
    def bw(text: str | None, default: _D) -> float | _D:
        return sizing.parse_bandwidth(text) if text is not None else default

    return sizing.RecoveryModel(bw(tier0_read, sizing.NVME_READ), bw(tier1_read, tier1_measured),
                                bw(s3_stream, sizing.S3_STREAM), s3_streams, bw(node_link, sizing.NODE_LINK))


RECOVERY_TIER = 1  # a failed node is replaced: its Tier 0 is gone, the shared file system is the nearest copy


def _recovery(p: Plan, nodes: int, model: RecoveryModel, mtbf: float | None) -> dict:
    """One plan's recovery figures as plain values (the JSON and the printed tables)."""
    tiers = []
    for r in sizing.recovery_times(p.checkpoint_bytes, nodes, p.bandwidth_bytes_per_s, model):
        row = {"tier": r.tier, "node_seconds": r.node_seconds, "cluster_seconds": r.cluster_seconds,
               "whole_checkpoint_per_node_seconds": r.whole_seconds}
        if mtbf is not None:
            cost = sizing.FailureCost(p.save_seconds, p.interval_seconds, mtbf, r.cluster_seconds)
            row |= {"lost_per_failure_seconds": cost.lost_per_failure_seconds, "overhead": cost.overhead}
        tiers.append(row)
    out: dict = {"checkpoint_bytes": p.checkpoint_bytes, "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s,
                 "nodes": nodes, "tiers": tiers}
    if mtbf is not None:
        rto = tiers[RECOVERY_TIER]["cluster_seconds"]
        best = sizing.best_interval(p.save_seconds, mtbf)
        out["failures"] = {"mtbf_seconds": mtbf, "recovery_tier": RECOVERY_TIER,
                           "young_daly_seconds": sizing.young_daly_interval(p.save_seconds, mtbf),
                           "best_interval_seconds": best,
                           "overhead_at_interval": sizing.overhead(p.save_seconds, p.interval_seconds, mtbf, rto),
                           "overhead_at_best": sizing.overhead(p.save_seconds, best, mtbf, rto)}
    return out


def _print_recovery(recovery: list[dict]) -> None:
    from rich.console import Console

    con = Console()
    failures = "failures" in recovery[0]
    cols = ("bandwidth", "tier", "RTO one node", "RTO cluster", "whole ckpt per node",
            *(("lost per failure", "overhead") if failures else ()))
    t = fit_table(*cols, title=f"Recovery: RTO per tier, {recovery[0]['nodes']} node(s) each fetching its part",
                  right=cols)
    for rec in recovery:
        for r in rec["tiers"]:
            cells = [fmt_bytes(rec["bandwidth_bytes_per_s"]) + "/s", str(r["tier"]), fmt_seconds(r["node_seconds"]),
                     fmt_seconds(r["cluster_seconds"]), fmt_seconds(r["whole_checkpoint_per_node_seconds"])]
            if failures:
                cells += [fmt_seconds(r["lost_per_failure_seconds"]), fmt_percent(r["overhead"])]
            t.add_row(*cells)
    con.print(t)
    for rec in recovery if failures else []:
        f = rec["failures"]
        con.print(f"{fmt_bytes(rec['bandwidth_bytes_per_s'])}/s, MTBF {fmt_seconds(f['mtbf_seconds'])}, recovering "
                  f"from Tier {f['recovery_tier']}: overhead {fmt_percent(f['overhead_at_interval'])} at this "
                  f"interval; Young/Daly √(2·T_save·MTBF) = {fmt_seconds(f['young_daly_seconds'])}, the minimum "
                  f"{fmt_percent(f['overhead_at_best'])} at interval {fmt_seconds(f['best_interval_seconds'])} "
                  "(√(2·T_save·MTBF) - T_save: ΔMFU counts the save apart)", highlight=False, soft_wrap=True)


def _measured_runs() -> list[RunFigure]:
    """Each run's figure from the catalog; an unreachable catalog gives none (with a note)."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings

    try:
        from db.catalog import Catalog  # deferred: start-up — SQLAlchemy, Alembic

        cat = Catalog(load_settings().catalog_url)
        try:
            by_run: dict[str, list] = {}
            for c in cat.list_checkpoints():
                by_run.setdefault(c.run, []).append((c.created_at, c.writer_stall_seconds))
        finally:
            cat.close()
    except Exception as exc:  # noqa: BLE001 - the model's figures stand without the catalog
        typer.echo(f"(no measured figures: catalog not readable: {type(exc).__name__}: {exc})", err=True)
        return []
    return [f for run, saves in sorted(by_run.items()) if (f := sizing.measured(run, saves))]


def _print_plan(plans: list[Plan], figures: list[RunFigure]) -> None:
    from rich.console import Console

    con = Console()
    cols = ("checkpoint", "interval", "bandwidth", "T_save", "ΔMFU")
    t = fit_table(*cols, title="Sizing model: ΔMFU = T_save / (T_interval + T_save), T_save = V / B", right=cols)
    for p in plans:
        t.add_row(fmt_bytes(p.checkpoint_bytes), fmt_seconds(p.interval_seconds),
                  fmt_bytes(p.bandwidth_bytes_per_s) + "/s", fmt_seconds(p.save_seconds),
                  fmt_percent(p.delta_mfu))
    con.print(t)
    for p in plans:  # the arithmetic behind each row, one more digit: 19.6 / 1819.6 = 1.077 %
        con.print(f"ΔMFU = {fmt_seconds(p.save_seconds)} / ({fmt_seconds(p.interval_seconds)} + "
                  f"{fmt_seconds(p.save_seconds)}) = {p.delta_mfu * 100:.3f} %", highlight=False)
    if not figures:
        return
    cols = ("run", "checkpoints", "median stall", "median interval", "ΔMFU")
    m = fit_table(*cols, title="Measured per run (writer stall from the catalog)", right=cols[1:])
    for f in figures:
        m.add_row(f.run, str(f.checkpoints), fmt_seconds(f.median_stall_seconds),
                  fmt_seconds(f.median_interval_seconds) if f.median_interval_seconds else "-",
                  fmt_percent(f.delta_mfu) if f.delta_mfu is not None else "-")
    con.print(m)


# --- ckpt agent, ckpt watch, ckpt up, ckpt run register ---------------------------------------
def agent_cmd(
    node: str = typer.Option(None, "--node", help="this node's label (default: settings / hostname)"),
    node_only: bool = typer.Option(False, "--node-only", help="serve only this node's deployments, not the "
                                   "cluster-wide archive, retention, scrub and drill, and leave "
                                   "reconcile's cluster share (Tier 2, backlogs) to the cluster's agent"),
    limit: int = typer.Option(None, "--limit", parser=count_arg("limit", 1, 100_000),
                              help="most flow runs at once on this agent"),
    archive_trigger: bool = typer.Option(True, "--archive-trigger/--no-archive-trigger",
                                         help="run archive on ckpt.checkpoint.durable (promote also archives inline)"),
) -> None:
    """Promote this node's checkpoint parts on their events (one promote run per checkpoint) and
    serve the deployments on this node until interrupted: promote (started by the agent), and
    unless --node-only archive (on its event), retention, scrub and the restore drill (cron);
    reconcile runs in a child of it every reconcile_interval_seconds and leaves a flow run only
    when it acted or its failures changed (one an hour while they last, one when they clear)."""
    from core.settings import display_url, load_settings  # deferred: start-up — pydantic-settings
    from deployments.agent import serve_agent  # deferred: start-up — pydantic-settings; Prefect
    from deployments.processes import agent_logging  # deferred: start-up — the agent alone needs it

    settings = load_settings(**({"node": node} if node else {}))
    agent_logging(settings.log_level)
    t0, t1, t2 = (display_url(settings.tier_url(t) or "(off)") for t in (0, 1, 2))
    typer.echo(f"agent for node {settings.node}: Tier 0 {t0}, Tier 1 {t1}, Tier 2 {t2}"
               + (" [node only]" if node_only else ""))
    serve_agent(settings, node_only=node_only, limit=limit, archive_trigger=archive_trigger)


def watch_cmd(
    directory: Path = typer.Argument(..., help="the folder the job writes its checkpoint folders into"),
    run: str = typer.Option(..., "--run", help="the run these checkpoints belong to"),
    marker: str = typer.Option("COMMITTED", "--marker", help="file the job writes when a folder is complete"),
    interval: float = typer.Option(2.0, "--interval", help="seconds between scans"),
    once: bool = typer.Option(False, "--once", help="scan once and exit"),
    part: int = typer.Option(0, "--part", parser=part_arg),
    parts: int = typer.Option(1, "--parts", parser=parts_arg),
    milestone_every: int = typer.Option(None, "--milestone-every", parser=count_arg("milestone-every", 1, 10**15),
                                        help="tag every step that is a multiple of N a milestone (Tier 2)"),
    milestone_marker: str = typer.Option("MILESTONE", "--milestone-marker",
                                         help="a folder holding this file is tagged a milestone"),
    resumed_from: str = typer.Option(None, "--resumed-from", help="RUN/STEP this run resumed from"),
    fine_tuned_from: str = typer.Option(None, "--fine-tuned-from", help="RUN/STEP this run fine-tunes"),
    branched_from: str = typer.Option(None, "--branched-from", help="RUN/STEP this run branched from"),
) -> None:
    """Commit and announce each complete checkpoint folder (DCP .metadata, HF index with all
    shards, or a marker file) once, for jobs that cannot use the client. Milestones: every N
    steps (--milestone-every) or folders holding the milestone marker file. The run's origin
    (--resumed-from, --fine-tuned-from or --branched-from) goes into every manifest."""
    import logging

    from ckpt.watch import watch  # deferred: start-up — pydantic-settings (core.settings)
    from core.settings import load_settings  # deferred: start-up — pydantic-settings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    settings = load_settings()
    safe_run_name(run)
    origin = origin_options(resumed_from, fine_tuned_from, branched_from)

    def show(saved: SavedCheckpoint) -> None:
        typer.echo(f"committed {saved.run} step {saved.step} ({saved.manifest.kind}) -> {saved.path}")

    n = watch(directory, run, settings, marker=marker, interval=interval, once=once, part=part, parts=parts,
              on_commit=show, milestone_every=milestone_every, milestone_marker=milestone_marker, origin=origin)
    typer.echo(f"{n} checkpoint(s) committed")


def up_cmd(
    root: Path = typer.Option(Path(".ckpt-stack"), "--dir", help="where the stack keeps its data and logs"),
    port: int = typer.Option(None, "--port", parser=count_arg("port", 1, 65534),
                             help="Prefect server port P, the S3 server on P + 1; a taken one is an error (the "
                             "jobs' exports name them) [default: 4200 and 4201, or free ones if taken]"),
    nodes: int = typer.Option(1, "--nodes", parser=count_arg("nodes", 1, 16),
                              help="simulated training nodes (one agent each)"),
    tier2: bool = typer.Option(True, "--tier2/--no-tier2", help="moto's S3 server as Tier 2"),
    auth: bool = typer.Option(True, "--auth/--no-auth",
                              help="Prefect API auth: a secret (PREFECT_SERVER_API_AUTH_STRING if set, else the one "
                                   "kept in --dir, made on first use) that every API call must carry; printed as "
                                   "PREFECT_API_AUTH_STRING"),
    production: bool = typer.Option(False, "--production", help="Prefect's production shape: the API server "
                                    "and its services in processes of their own, on PostgreSQL + Redis; "
                                    "catalog on PostgreSQL"),
    pg_url: str = typer.Option(None, "--pg-url", help="PostgreSQL server for --production (databases "
                               "'prefect' and 'ckpt_catalog' are created there) "
                               "[postgresql://postgres@127.0.0.1:5432/postgres]"),
    redis_url: str = typer.Option(None, "--redis-url", help="Redis for --production; redis://HOST:PORT/N uses "
                                  "database N, without /N the first free of 1-15 [redis://127.0.0.1:6379]"),
    api_workers: int = typer.Option(1, "--api-workers", parser=count_arg("api-workers", 1, 256),
                                    help="API server worker processes (--production)"),
) -> None:
    """The local stack on loopback: Prefect server (SQLite; with --production on PostgreSQL +
    Redis, services in their own process), moto's S3 server with its bucket, and the agents;
    runs until Ctrl-C, then stops everything cleanly. An agent that exits is started again
    (after 1 s, 2 s, 4 s, ... at most 60 s), the servers staying up. API auth is on unless
    --no-auth: loopback is shared by every user of a login node."""
    import os
    import signal
    import time

    from ckpt.local_stack import (  # deferred: start-up — SQLAlchemy, pydantic-settings
        LocalStack,
        exports_text,
        stack_auth_string,
    )

    if not production and (pg_url or redis_url or api_workers > 1):
        raise BadInput("--pg-url, --redis-url and --api-workers go with --production")
    secret = (os.environ.get("PREFECT_SERVER_API_AUTH_STRING") or stack_auth_string(root)) if auth else None
    prod = None
    if production:
        prod = ProductionStack(root.absolute() / "prefect", pg_server_url=pg_url or DEFAULT_PG_URL,
                               redis_url=redis_url or DEFAULT_REDIS_URL, port=port or 4200,
                               port_required=port is not None, workers=api_workers)
    stack = LocalStack(root, nodes=tuple(f"node-{i}" for i in range(nodes)), port=port or 4200,
                       port_required=port is not None, tier2=tier2, auth_string=secret, production=prod)
    typer.echo("starting the Prefect server" + (" (PostgreSQL + Redis, services apart)" if prod else "")
               + ", the S3 server and the agents ...")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the stack as cleanly as Ctrl-C
    with stack:
        typer.echo(f"Prefect UI   {stack.ui_url}")
        typer.echo(f"S3 endpoint  {stack.s3_url or '(off)'}")
        if prod is not None:
            typer.echo(f"Prefect on   {prod.describe()}")
        typer.echo("API auth     " + ("on: the UI asks for PREFECT_API_AUTH_STRING below" if secret else "off"))
        for line in exports_text(stack.exports()):
            typer.echo(line)
        typer.echo("Ctrl-C stops the stack")
        try:
            while stack.servers_alive():
                for line in stack.supervise():  # a dead agent is started again; the rest stays up
                    typer.echo(line, err=True)
                time.sleep(1)
            typer.echo("a server of the stack (Prefect or S3) exited; stopping; see the logs under "
                       + str(root / "logs"), err=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            typer.echo("stopping ...")
    typer.echo("stopped")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_register_cmd(
    run: str = typer.Argument(..., help="run name"),
    project: str = typer.Option(None, "--project"),
    resumed_from: str = typer.Option(None, "--resumed-from", help="RUN/STEP this run resumes from"),
    fine_tuned_from: str = typer.Option(None, "--fine-tuned-from", help="RUN/STEP this run fine-tunes"),
    branched_from: str = typer.Option(None, "--branched-from", help="RUN/STEP this run branched from"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Register a run (idempotent), with the checkpoint it started from (recorded pending when
    the catalog does not know that checkpoint yet; it is protected from retirement either way)."""
    from ckpt.client import run_origin  # deferred: start-up — pydantic-settings
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from db.catalog import Catalog  # deferred: start-up — SQLAlchemy, Alembic

    o = run_origin(**origin_options(resumed_from, fine_tuned_from, branched_from))
    cat = Catalog(load_settings().catalog_url)
    try:
        info = cat.ensure_run(safe_run_name(run), project=project, parent=(o.run, o.step) if o else None,
                              parent_relation=o.relation if o else "resumed_from", actor="cli")
    finally:
        cat.close()
    if as_json:
        typer.echo(json.dumps({"run": info.name, "project": info.project, "parent_run": info.parent_run,
                               "parent_step": info.parent_step, "parent_relation": info.parent_relation}))
    else:
        origin_txt = f" ({info.parent_relation} {info.parent_run}:{info.parent_step})" if info.parent_run else ""
        typer.echo(f"run {info.name}{origin_txt}")


def _run_step(text: str) -> tuple[str, int]:
    """``RUN/STEP`` (or ``RUN:STEP``: neither character is allowed in a run name)."""
    run, sep, step = text.replace(":", "/").rpartition("/")
    if not sep:
        raise BadArgument(f"expected RUN/STEP, got {quoted(text)}")
    return safe_run_name(run), step_arg(step)


def origin_options(resumed_from: str | None, fine_tuned_from: str | None,
                   branched_from: str | None) -> OriginKeywords:
    """The stager's origin keyword from ``--resumed-from`` / ``--fine-tuned-from`` /
    ``--branched-from RUN/STEP`` (at most one), for ``ckpt watch`` and ``ckpt commit``."""
    given: OriginKeywords = {}
    if resumed_from:
        given["resumed_from"] = _run_step(resumed_from)
    if fine_tuned_from:
        given["fine_tuned_from"] = _run_step(fine_tuned_from)
    if branched_from:
        given["branched_from"] = _run_step(branched_from)
    if len(given) > 1:
        raise BadArgument("give one of --resumed-from, --fine-tuned-from, --branched-from")
    return given
