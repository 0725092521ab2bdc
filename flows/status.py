"""The per-run status artifact: one markdown page per run (key ``run-<name>``), republished
each time one of its checkpoints becomes durable, so the Prefect UI's Artifacts tab answers
"where is this run?" at a glance. First what a platform engineer asks: the newest durable
checkpoint (every part verified on Tier 1), what is late past the RPO (committed longer than
``rpo_seconds`` ago and still not on Tier 1), which promote runs failed and whether something
repaired them since (which run, when), and each tier's bytes; then the newest verified step on
each tier, how long checkpoints take to become durable (commit -> every part verified on
Tier 1), the run's measured ΔMFU (the sizing model with its own writer stalls and save interval
from the catalog, over its newest ``STALL_WINDOW`` saves), the lineage chain of its newest
checkpoint, its newest recovery drills (cluster RTO, nodes, bound), and what each tier holds of
it, what its hops measured over the last day and what its copies cost a month
(``tasks.tier_matrix``, as ``ckpt tiers --run`` shows it). What it reads does not grow with the run.

``gather`` reads the catalog (and takes the failed promote runs, which only the orchestrator
knows: ``failed_promotions``); ``status_markdown`` is a plain function of what it read (tested
without Prefect); ``publish_run_status`` publishes it from inside a flow run.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from statistics import median

from core import sizing
from core.settings import Settings
from core.tier_figures import fmt_bandwidth, fmt_latency, fmt_spread
from core.tiers import ALL_TIERS, Tier
from db.catalog import Catalog
from db.entities import AuditEntry, DrillResult, LineageEdge
from flows.artifacts import artifact_key, post_artifact
from tasks.tier_matrix import TierRow, tier_rows

TIERS = ALL_TIERS
RECENT = 20  # checkpoints looked at for the time to durable
STALL_WINDOW = 1000  # the newest saves with a recorded stall that the measured ΔMFU covers
DRILLS = 6  # the newest recovery drills shown
FAILURES = 10  # the newest failed promote runs shown
LATE = 20  # the oldest checkpoints late past the RPO shown
PROMOTE_FLOW = "promote-checkpoint"  # flows.promote's flow (which imports this module)


@dataclass(frozen=True)
class TierNewest:
    tier: int
    step: int | None
    verified_at: datetime | None = None


@dataclass(frozen=True)
class FailedRun:
    """A promote run of this training run that ended failed (or crashed), as the orchestrator
    recorded it."""
    name: str  # promote/<run>/step-<n>[/part-i-of-n]
    step: int
    at: datetime  # when it failed
    message: str = ""
    flow_run_id: str = ""


@dataclass(frozen=True)
class Failure:
    """A failed promote run and what became of its checkpoint: ``repaired_by`` the actor that
    later recorded every part on Tier 1 (a reconcile pass, a retry, a later event's run) and
    when; ``None`` while it is not durable."""
    run: FailedRun
    repaired_by: str | None = None
    repaired_at: datetime | None = None
    # whether a whole verified copy is on Tier 1 or 2 now (None: not asked, or the checkpoint
    # left by retention's decision): a repair that a later loss undid must not read as safe
    durable_now: bool | None = None


@dataclass(frozen=True)
class RunStatus:
    run: str
    newest: list[TierNewest]
    # (step, seconds from commit to every part verified on Tier 1), newest last
    time_to_durable: list[tuple[int, float]] = field(default_factory=list)
    figure: sizing.RunFigure | None = None
    newest_step: int | None = None  # the lineage chain starts here
    lineage: list[LineageEdge] = field(default_factory=list)
    checkpoints: int = 0
    generated_at: datetime | None = None
    stalls_windowed: bool = False  # the figure covers the newest saves only (the run recorded more)
    drills: list[DrillResult] = field(default_factory=list)  # newest first
    metrics: dict[str, float] = field(default_factory=dict)  # the newest checkpoint's (``newest_step``)
    durable_step: int | None = None  # the newest checkpoint with every part verified on Tier 1
    durable_at: datetime | None = None
    rpo_seconds: float | None = None  # None: the RPO section is left out
    late: list[tuple[int, datetime]] = field(default_factory=list)  # (step, committed at), oldest first
    tier_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)  # tier -> (checkpoints, bytes) verified
    failures: list[Failure] | None = None  # newest first; None: the orchestrator could not be asked
    storage: list[TierRow] = field(default_factory=list)  # per tier: held, measured, cost (this run's)


def gather(cat: Catalog, run: str, *, now: datetime | None = None, rpo_seconds: float | None = None,
           failed: list[FailedRun] | None = None, settings: Settings | None = None) -> RunStatus:
    """Everything the page shows, read from the catalog in a bounded number of queries, each
    reading a bounded number of rows, however many checkpoints the run holds (it runs each time
    a checkpoint becomes durable): the count, the newest ``RECENT`` checkpoints, their time to
    durable in one query, and the stall figure over the newest ``STALL_WINDOW`` saves; the
checkpoints late past ``rpo_seconds`` (at most ``LATE``), each tier's verified bytes (one
grouped read) and, for each of the ``failed`` promote runs given, its checkpoint's audit trail;
with ``settings``, the run's storage per tier (its URLs, budgets and prices are the settings')."""
    newest = []
    for tier in TIERS:
        c = cat.newest_verified(run, tier=tier)
        loc = next((x for x in cat.locations(run, c.step) if x.tier == tier), None) if c else None
        newest.append(TierNewest(tier, c.step if c else None, loc.verified_at if loc else None))
    recent = cat.newest_checkpoints(run, RECENT)[::-1]
    durable = cat.complete_at([c.id for c in recent], 1)
    ttd = [(c.step, max(0.0, (durable[c.id] - start).total_seconds())) for c in recent
           if c.id in durable and (start := c.committed_at or c.created_at) is not None]
    stalls = cat.recorded_stalls(run, STALL_WINDOW + 1)
    figure = sizing.measured(run, stalls[:STALL_WINDOW])
    head = recent[-1].step if recent else None
    lineage = cat.ancestors(run, head, max_depth=500) if head is not None else []
    durable_ck = cat.newest_verified(run, tier=1)
    durable_at = cat.complete_at([durable_ck.id], 1).get(durable_ck.id) if durable_ck else None
    late = cat.unpromoted(older_than_seconds=rpo_seconds, run=run, limit=LATE) if rpo_seconds is not None else []
    return RunStatus(run, newest, ttd, figure, head, lineage, cat.count_checkpoints(run), now,
                     stalls_windowed=len(stalls) > STALL_WINDOW, drills=cat.drills(run, DRILLS),
                     metrics=recent[-1].metrics if recent else {},
                     durable_step=durable_ck.step if durable_ck else None, durable_at=durable_at,
                     rpo_seconds=rpo_seconds,
                     late=[(c.step, t) for c in late if (t := c.committed_at or c.created_at) is not None],
                     tier_bytes={u.tier: (u.checkpoints, u.bytes) for u in cat.usage(run)},
                     failures=None if failed is None else failures_of(cat, run, failed),
                     storage=tier_rows(settings, cat, run=run) if settings is not None else [])


def repair_of(failed: FailedRun, history: list[AuditEntry], durable: bool | None = None) -> Failure:
    """What became of ``failed``'s checkpoint, from its audit trail: repaired by whoever recorded
    it complete on Tier 1 at or after the failure (every part verified there); a completion before
    the failure (a duplicate run that failed on a checkpoint already durable) counts too, since the
    checkpoint was safe either way. ``durable``: whether it is held whole on Tier 1 or 2 now
    (``Catalog.durable_now``)."""
    done = next((e for e in history if e.action == "complete" and e.to_state == "tier1"), None)
    return Failure(failed, done.actor, done.at, durable) if done else Failure(failed, durable_now=durable)


def failures_of(cat: Catalog, run: str, failed: list[FailedRun]) -> list[Failure]:
    """Each failed promote run with what became of its checkpoint (``repair_of``): one audit trail
    read per run, and one read for whether each is held on a durable tier now."""
    now = cat.durable_now(run, {f.step for f in failed})
    return [repair_of(f, cat.history(run, f.step), now.get(f.step)) for f in failed]


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else ""


def status_markdown(s: RunStatus) -> str:
    """The artifact's markdown (plain function of ``s``)."""
    out = [f"# Run `{s.run}`", ""]
    if s.generated_at:
        out += [f"_{s.checkpoints} checkpoint(s); updated {_when(s.generated_at)} UTC after a promotion._", ""]
    out += at_a_glance(s)
    out += ["## Newest verified checkpoint per tier", "", "| tier | step | verified at |", "|---|---:|---|"]
    out += [f"| {Tier(n.tier).display} | {n.step if n.step is not None else '—'} | {_when(n.verified_at) or '—'} |"
            for n in s.newest]
    if s.metrics:
        out += ["", f"Metrics of the newest checkpoint (step {s.newest_step}): {sizing.fmt_metrics(s.metrics)}"]
    out += ["", "## Time to durable (commit → every part verified on Tier 1)", ""]
    if s.time_to_durable:
        secs = [t for _, t in s.time_to_durable]
        step, last = s.time_to_durable[-1]
        out += [f"- newest durable, step {step}: **{sizing.fmt_seconds(last)}**",
                (f"- median of the last {len(secs)}: {sizing.fmt_seconds(median(secs))}, "
                 f"worst: {sizing.fmt_seconds(max(secs))}")]
    else:
        out += ["- no checkpoint of this run is durable yet"]
    out += ["", "## Measured cost of checkpointing (ΔMFU = T_save / (T_interval + T_save))", ""]
    f = s.figure
    if f is None:
        out += ["- no writer stall recorded for this run"]
    else:
        over = f"the last {f.checkpoints} saves" if s.stalls_windowed else f"{f.checkpoints} save(s)"
        out += [f"- writer stall: median {sizing.fmt_seconds(f.median_stall_seconds)} over {over}"]
        if f.median_interval_seconds is not None and f.delta_mfu is not None:
            out += [f"- save interval: median {sizing.fmt_seconds(f.median_interval_seconds)}",
                    f"- **ΔMFU: {sizing.fmt_percent(f.delta_mfu)}** of compute spent stalled on checkpoints"]
        else:
            out += ["- ΔMFU: needs two saves (no interval yet)"]
    out += ["", "## Lineage (newest first)", ""]
    out += [lineage_line(s.run, s.newest_step, s.lineage)]
    out += ["", "## Recovery drills (RTO: first start → last part loaded)", ""]
    out += drill_lines(s.drills)
    if s.storage:
        out += ["", "## Storage per tier (this run's copies; hops over the last day)", ""]
        out += storage_lines(s.storage)
    return "\n".join(out) + "\n"


def storage_lines(rows: list[TierRow]) -> list[str]:
    """The run's storage matrix: what each tier holds of it, its hops' figures (median / p95
    (hops)), and what its copies there cost a month."""
    out = ["| tier | checkpoints | logical | stored | dedup | write | read | first byte | $/month |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        dedup = f"{r.dedup_ratio:.2f}×" if r.dedup_ratio is not None else "—"
        out.append(f"| {Tier(r.tier).display} | {r.checkpoints} | {sizing.fmt_bytes(r.logical_bytes)} | "
                   f"{sizing.fmt_bytes(r.stored_bytes)} | {dedup} | {fmt_spread(r.write, fmt_bandwidth)} | "
                   f"{fmt_spread(r.read, fmt_bandwidth)} | {fmt_spread(r.first_byte, fmt_latency)} | "
                   f"{r.monthly_cost:,.2f} |")
    return out


def at_a_glance(s: RunStatus) -> list[str]:
    """The answers first: newest durable checkpoint, late past the RPO, failed promotions and
    whether they were repaired, bytes per tier."""
    durable = (f"step **{s.durable_step}**" + (f", durable since {_when(s.durable_at)} UTC" if s.durable_at else "")
               if s.durable_step is not None else "none yet")
    out = ["## At a glance", "", f"- **Newest durable checkpoint** (every part verified on Tier 1): {durable}"]
    if s.rpo_seconds is not None:
        rpo = sizing.fmt_seconds(s.rpo_seconds)
        if s.late:
            steps = ", ".join(f"step {step} (committed {_when(at)} UTC)" for step, at in s.late)
            out.append(f"- **Late past the RPO** ({rpo}): {len(s.late)} checkpoint(s) not on Tier 1: {steps}")
        else:
            out.append(f"- **Late past the RPO** ({rpo}): none")
    out += ["", "### Failed promote runs", "", *failure_lines(s.failures)]
    out += ["", "### Bytes per tier (verified copies)", "", "| tier | checkpoints | bytes |", "|---|---:|---:|"]
    for tier in TIERS:
        n, size = s.tier_bytes.get(tier, (0, 0))
        out.append(f"| {Tier(tier).display} | {n} | {sizing.fmt_bytes(size)} |")
    return [*out, ""]


def failure_lines(failures: list[Failure] | None) -> list[str]:
    """One row per failed promote run: when, why, and ``repaired by <actor> at <time>`` or
    **not repaired**."""
    if failures is None:
        return ["- not known: the orchestrator did not answer"]
    if not failures:
        return ["- none"]
    out = ["| flow run | step | failed at | error | now |", "|---|---:|---|---|---|"]
    for f in failures:
        now = (f"failed, repaired by `{f.repaired_by}` at {_when(f.repaired_at)} UTC" if f.repaired_by
               else "**failed, not repaired**")
        if f.repaired_by and f.durable_now is False:
            now += "; **lost since: no whole copy on Tier 1 or 2 now**"
        why = re.sub(r"\s+", " ", f.run.message).replace("|", "/")[:160]
        out.append(f"| `{f.run.name}` | {f.run.step} | {_when(f.run.at)} UTC | {why} | {now} |")
    return out


def drill_lines(drills: list[DrillResult]) -> list[str]:
    """The newest drills as a table: tier, step, nodes, outcome, RTO and the tier's bound."""
    if not drills:
        return ["- no drill recorded for this run (`ckpt drill --run RUN`)"]
    out = ["| at | tier | step | nodes | ok | RTO | bound | bytes from the tier |",
           "|---|---:|---:|---:|---|---:|---:|---:|"]
    for d in drills:
        bound = sizing.fmt_seconds(d.bound_seconds) if d.bound_seconds is not None else "—"
        out.append(f"| {_when(d.at)} | {d.tier} | {d.step} | {d.nodes} | {'ok' if d.ok else '**FAILED**'} | "
                   f"{sizing.fmt_seconds(d.seconds)} | {bound} | {sizing.fmt_bytes(d.bytes)} |")
    return out


def lineage_line(run: str, head: int | None, edges: list[LineageEdge]) -> str:
    """The ancestors of ``run``/``head`` as one line, consecutive checkpoints of one run
    (``follows`` edges) folded into a range: ``run-b steps 300..500 (3) ← resumed from run-a
    steps 100..200 (2)``."""
    if head is None:
        return "- no checkpoint"
    segs: list[dict] = [{"run": run, "new": head, "old": head, "n": 1, "how": ""}]
    for e in sorted(edges, key=lambda e: e.depth):
        seg = segs[-1]
        if e.relation == "follows" and e.parent_run == seg["run"]:
            seg["old"], seg["n"] = e.parent_step, seg["n"] + 1
        else:
            segs.append({"run": e.parent_run, "new": e.parent_step, "old": e.parent_step, "n": 1,
                         "how": e.relation.replace("_", " ")})
    parts = []
    for g in segs:
        where = f"step {g['new']}" if g["n"] == 1 else f"steps {g['old']}..{g['new']} ({g['n']})"
        parts.append((f"*{g['how']}* " if g["how"] else "") + f"`{g['run']}` {where}")
    return " ← ".join(parts)


def failed_promotions(run: str, limit: int = FAILURES) -> list[FailedRun] | None:
    """The newest ``limit`` promote runs of ``run`` that failed or crashed, from the Prefect API
    (the flow runs named ``promote/<run>/step-<n>``); None when it cannot be asked."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    named = re.compile(rf"promote/{re.escape(run)}/step-(\d+)(/part-\d+-of-\d+)?")
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[PROMOTE_FLOW])),
                flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(like_=f"promote/{run}/step-"),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.FAILED, StateType.CRASHED]))),
                sort=FlowRunSort.END_TIME_DESC, limit=limit)
    except Exception:  # noqa: BLE001 - best effort, as the page itself: it says "not known"
        return None
    return [FailedRun(r.name, int(m.group(1)), r.state.timestamp if r.state else r.created or datetime.now(UTC),
                      (r.state.message or "") if r.state else "", str(r.id))
            for r in runs if (m := named.fullmatch(r.name))]


def publish_run_status(settings: Settings, run: str, *, durable_steps: Collection[int] = ()) -> None:
    """Publish (a new version of) the run's status artifact from the current flow run (with the
    open ``artifact_batch``, at its end); nothing outside a flow run. Key: ``run-<name>`` made a
    valid artifact key. ``settings``: the catalog, the RPO, and each tier's URL, budget and price.
    ``durable_steps``: the checkpoints the current run just made durable; each failed promote run
    of theirs gets a note in its own Artifacts tab (``mark_repaired``). Best effort, like every
    artifact."""
    def post() -> None:
        from prefect.artifacts import create_markdown_artifact

        failed = failed_promotions(run)
        cat = Catalog(settings.catalog_url)
        try:
            page = gather(cat, run, now=datetime.now(UTC), rpo_seconds=settings.rpo_seconds, failed=failed,
                          settings=settings)
        finally:
            cat.close()
        create_markdown_artifact(status_markdown(page), key=artifact_key("run", run),
                                 description=f"status of run {run}")
        mark_repaired(run, [f for f in page.failures or [] if f.run.step in durable_steps])

    post_artifact(artifact_key("run", run), post)


def repaired_markdown(run: str, f: Failure, by_run: str) -> str:
    """The note a repaired failed promote run carries (plain function of its values)."""
    return (f"# Repaired\n\nThis promote run failed at {_when(f.run.at)} UTC. Checkpoint `{run}` step "
            f"{f.run.step} was repaired since: every part verified on Tier 1, recorded by `{f.repaired_by}` at "
            f"{_when(f.repaired_at)} UTC, in flow run `{by_run}`.\n\nThe run's status: artifact "
            f"`{artifact_key('run', run)}`.\n")


def mark_repaired(run: str, repaired: list[Failure]) -> None:
    """A markdown artifact ``repaired-<run>-<step>`` in each failed promote run whose checkpoint
    the current flow run made durable: Prefect keeps a run's final state (it stays red), so the
    note on the run itself says it was repaired, by which run and when (Prefect's public API: an
    artifact created for another flow run by its id)."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.context import FlowRunContext

    if not repaired:
        return
    ctx = FlowRunContext.get()
    by_run = ctx.flow_run.name if ctx is not None and ctx.flow_run is not None else "?"
    with get_client(sync_client=True) as client:
        for f in repaired:
            if f.repaired_by and f.run.flow_run_id:
                client.create_artifact(ArtifactCreate(
                    key=artifact_key("repaired", run, f.run.step), type="markdown",
                    data=repaired_markdown(run, f, by_run), description=f"repaired: {run} step {f.run.step}",
                    flow_run_id=UUID(f.run.flow_run_id)))
