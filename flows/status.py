"""The per-run status artifact: one markdown page per run (key ``run-<name>``), republished
each time one of its checkpoints becomes durable, so the Prefect UI's Artifacts tab answers
"where is this run?" at a glance: the newest verified step on each tier, how long checkpoints take to become durable
(commit -> every part verified on Tier 1), the run's measured ΔMFU (the sizing model with its
own writer stalls and save interval from the catalog, over its newest ``STALL_WINDOW`` saves)
the lineage chain of its newest checkpoint, and its newest recovery drills (cluster RTO, nodes,
bound). What it reads does not grow with the run.

``gather`` reads the catalog; ``status_markdown`` is a plain function of what it read
(tested without Prefect); ``publish_run_status`` publishes it from inside a flow run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from statistics import median

from core import sizing
from core.tiers import ALL_TIERS, Tier
from db.catalog import Catalog
from db.entities import DrillResult, LineageEdge
from flows.artifacts import artifact_key, post_artifact

TIERS = ALL_TIERS
RECENT = 20  # checkpoints looked at for the time to durable
STALL_WINDOW = 1000  # the newest saves with a recorded stall that the measured ΔMFU covers
DRILLS = 6  # the newest recovery drills shown


@dataclass(frozen=True)
class TierNewest:
    tier: int
    step: int | None
    verified_at: datetime | None = None


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


def gather(cat: Catalog, run: str, *, now: datetime | None = None) -> RunStatus:
    """Everything the page shows, read from the catalog in a bounded number of queries, each
    reading a bounded number of rows, however many checkpoints the run holds (it runs each time
    a checkpoint becomes durable): the count, the newest ``RECENT`` checkpoints, their time to
    durable in one query, and the stall figure over the newest ``STALL_WINDOW`` saves."""
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
    return RunStatus(run, newest, ttd, figure, head, lineage, cat.count_checkpoints(run), now,
                     stalls_windowed=len(stalls) > STALL_WINDOW, drills=cat.drills(run, DRILLS),
                     metrics=recent[-1].metrics if recent else {})


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else ""


def status_markdown(s: RunStatus) -> str:
    """The artifact's markdown (plain function of ``s``)."""
    out = [f"# Run `{s.run}`", ""]
    if s.generated_at:
        out += [f"_{s.checkpoints} checkpoint(s); updated {_when(s.generated_at)} UTC after a promotion._", ""]
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
    return "\n".join(out) + "\n"


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


def publish_run_status(catalog_url: str, run: str) -> None:
    """Publish (a new version of) the run's status artifact from the current flow run (with the
    open ``artifact_batch``, at its end); nothing outside a flow run. Key: ``run-<name>`` made a
    valid artifact key. Best effort, like every artifact."""
    def post() -> None:
        from prefect.artifacts import create_markdown_artifact

        cat = Catalog(catalog_url)
        try:
            md = status_markdown(gather(cat, run, now=datetime.now(UTC)))
        finally:
            cat.close()
        create_markdown_artifact(md, key=artifact_key("run", run), description=f"status of run {run}")

    post_artifact(artifact_key("run", run), post)
