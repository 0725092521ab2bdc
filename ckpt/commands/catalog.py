"""Catalog query commands: ``ckpt ls``, ``show``, ``locate``, ``latest``, ``lineage``, ``pin``,
``unpin``, ``audit``. Each takes ``--json`` (stable field names, dates in ISO-8601 UTC); errors of the
project print as one line (see ``ckpt.cli.main``). Settings are read once per command.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import typer
from rich.console import Console
from rich.tree import Tree

from ckpt.args import count_arg, step_arg, tier_arg
from ckpt.tables import FitTable, actor_role, table as fit_table
from core.errors import BadArgument, NotFound, quoted
from core.sizing import fmt_bytes, fmt_metrics
from db.entities import TIER_NAMES, AuditEntry, LineageEdge, ReplicaInfo

JSON_OPT = typer.Option(False, "--json", help="print JSON (stable field names) instead of a table")
STEP = typer.Argument(..., parser=step_arg, help="checkpoint step")
out = Console()


def register(app: typer.Typer) -> None:
    for name, fn in (("ls", ls_cmd), ("show", show_cmd), ("locate", locate_cmd), ("latest", latest_cmd),
                     ("lineage", lineage_cmd), ("pin", pin_cmd), ("unpin", unpin_cmd), ("audit", audit_cmd)):
        app.command(name)(fn)


@contextmanager
def _catalog():
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from db.catalog import Catalog  # deferred: start-up — SQLAlchemy, Alembic

    cat = Catalog(load_settings().catalog_url)
    try:
        yield cat
    finally:
        cat.close()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # "nan", "inf", "-inf": JSON has no token for them (as the catalog stores them)
    return value


def _emit_json(value: Any) -> None:
    typer.echo(json.dumps(_plain(value), indent=1, sort_keys=True))


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _size(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def _tiers(tiers: Iterable[int]) -> str:
    return ", ".join(f"{t}:{TIER_NAMES[t]}" for t in tiers) or "-"


def ls_cmd(run: str = typer.Option(None, "--run", help="only this run"), as_json: bool = JSON_OPT) -> None:
    """List checkpoints with their state and the tiers that hold a verified copy."""
    with _catalog() as cat:
        ckpts = cat.list_checkpoints(run)
        tiers = cat.checkpoint_tiers(run)
    if as_json:
        _emit_json([dict(_plain(c), verified_tiers=list(tiers.get((c.run, c.step), ()))) for c in ckpts])
        return
    table = fit_table("run", "step", "kind", "state", "parts", "size", "verified on", "committed",
                       right=("step", "parts", "size"))
    for c in ckpts:
        table.add_row(c.run, str(c.step), c.kind, c.state, f"{c.parts_registered}/{c.parts}", _size(c.total_bytes),
                      _tiers(tiers.get((c.run, c.step), ())), _when(c.committed_at))
    out.print(table if ckpts else "no checkpoints recorded")


def show_cmd(run: str, step: int = STEP, as_json: bool = JSON_OPT) -> None:
    """One checkpoint: its record, replicas, pins, aliases, parents and history (every state
    change with its actor and reason, oldest first)."""
    with _catalog() as cat:
        ck = cat.get_checkpoint(run, step)
        reps = cat.replicas(ck.id)
        pinned = cat.is_pinned(run, step)
        names = sorted(a for a, s in cat.aliases(run).items() if s == step)
        parents = list(cat.ancestors(run, step, max_depth=1))
        history = cat.history(run, step)
    if as_json:
        _emit_json({"checkpoint": ck, "replicas": reps, "pinned": pinned, "aliases": names, "parents": parents,
                    "history": history})
        return
    out.print(f"[bold]{run}[/bold] step {step}: {ck.kind}, {ck.state}, {ck.parts_registered}/{ck.parts} part(s), "
              f"{ck.file_count} files, {_size(ck.total_bytes)}, format {ck.format}")
    out.print(f"created {_when(ck.created_at)}, committed {_when(ck.committed_at)}, writer stall "
              f"{'-' if ck.writer_stall_seconds is None else f'{ck.writer_stall_seconds:.3f} s'}")
    if ck.metrics:
        out.print("metrics: " + fmt_metrics(ck.metrics))
    if pinned or names:
        out.print("kept by: " + ", ".join((["pin"] if pinned else []) + [f"alias {a}" for a in names]))
    for e in parents:
        out.print(f"{e.relation} {e.parent_run}/{e.parent_step}")
    out.print(_replica_table(reps))
    out.print(_audit_table(history, title="history"))


def audit_cmd(run: str = typer.Option(None, "--run", help="only this run"),
              since: str = typer.Option(None, "--since", help="only entries this recent: 30m, 2h, 7d or ISO-8601"),
              limit: int = typer.Option(100, "--limit", parser=count_arg("limit", 1, 1_000_000),
                                        help="at most this many entries"),
              expire: bool = typer.Option(False, "--expire", help="export the entries older than "
                                          "CKPT_AUDIT_RETAIN_DAYS to CKPT_AUDIT_EXPORT_DIR, then delete them"),
              as_json: bool = JSON_OPT) -> None:
    """Recent catalog events (state changes, registrations, prunes), rejections first."""
    if expire:
        _expire_audit(as_json)
        return
    cutoff = parse_since(since) if since else None
    with _catalog() as cat:
        entries = rejections_first(cat.audit_log(run=run, limit=limit, since=cutoff))
    if as_json:
        _emit_json(entries)
        return
    out.print(_audit_table(entries, title="audit") if entries else "no catalog events recorded")


def _expire_audit(as_json: bool) -> None:
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.audit import expire_audit  # deferred: start-up — Prefect, SQLAlchemy

    done = expire_audit(load_settings(), actor="cli")
    if as_json:
        _emit_json(done)
    elif done.before is None:
        out.print("audit retention is off (CKPT_AUDIT_RETAIN_DAYS=0): nothing expired")
    elif done.exported:
        out.print(f"exported {done.exported} audit entries older than {_when(done.before)} to {done.file}; "
                  f"deleted {done.deleted} from the catalog")
    else:
        out.print(f"no audit entries older than {_when(done.before)}")


def rejections_first(entries: list) -> list:
    """Rejections ahead of everything else, each group newest first (the order given)."""
    return sorted(entries, key=lambda e: e.action != "reject")


def parse_since(text: str) -> datetime:
    """``30s``, ``30m``, ``2h``, ``7d`` ago, or an ISO-8601 time (UTC when it names no zone)."""
    import re
    from datetime import UTC, timedelta

    m = re.fullmatch(r"(\d+)\s*([smhd])", text.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return datetime.now(UTC) - timedelta(**{unit: int(m.group(1))})
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise BadArgument(f"--since {quoted(text)}: use 30m, 2h, 7d or an ISO-8601 time") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _audit_table(entries: Iterable[AuditEntry], *, title: str) -> FitTable:
    table = fit_table("at", "actor", "subject", "action", "change", "reason", title=title)
    for e in entries:
        change = f"{e.from_state or ''} -> {e.to_state}" if e.from_state else (e.to_state or "")
        table.add_row(_when(e.at), actor_role(e.actor), e.subject, e.action, change, e.reason or "",
                      style="red" if e.action == "reject" else None)
    return table


def _replica_table(reps: Iterable[ReplicaInfo]) -> FitTable:
    table = fit_table("tier", "part", "state", "url", "verified", "bytes", "node", right=("part", "bytes"))
    for r in reps:
        table.add_row(_tiers([r.tier]), str(r.part), r.state, r.url, _when(r.verified_at), _size(r.bytes),
                      r.node or "-")
    return table


def locate_cmd(run: str, step: int = STEP, as_json: bool = JSON_OPT) -> None:
    """Where every replica of a checkpoint is, and in what state."""
    with _catalog() as cat:
        reps = cat.replicas(cat.get_checkpoint(run, step).id)
    if as_json:
        _emit_json([{"tier": r.tier, "tier_name": TIER_NAMES[r.tier], "part": r.part, "url": r.url,
                     "state": r.state, "verified_at": r.verified_at, "bytes": r.bytes, "node": r.node}
                    for r in reps])
        return
    out.print(_replica_table(reps) if reps else f"{run}/{step} has no replicas yet")


def latest_cmd(run: str, tier: int = typer.Option(None, "--tier", parser=tier_arg,
                                                  help="only copies on this tier"),
               durable: bool = typer.Option(False, "--durable", help="only copies on tier 1 or 2"),
               follow_resumed: bool = typer.Option(False, "--follow-resumed",
                                                   help="look into the run this one resumed from"),
               as_json: bool = JSON_OPT) -> None:
    """The newest verified checkpoint of a run and where its copies are."""
    with _catalog() as cat:
        ck = cat.newest_verified(run, tier=tier, durable_only=durable, follow_resumed=follow_resumed)
        if ck is None:
            raise NotFound(f"run {run!r} has no verified checkpoint" + (f" on tier {tier}" if tier is not None else ""))
        locs = cat.locations(ck.run, ck.step)
    if as_json:
        _emit_json({"checkpoint": ck, "locations": locs})
        return
    out.print(f"[bold]{ck.run}[/bold] step {ck.step} ({ck.kind}), {_size(ck.total_bytes)}")
    for loc in locs:
        out.print(f"  {_tiers([loc.tier])}  verified {_when(loc.verified_at)}  {', '.join(loc.urls)}")


def lineage_cmd(run: str, step: int = STEP,
                descendants: bool = typer.Option(False, "--descendants", help="walk down instead of up"),
                depth: int = typer.Option(1000, "--depth", parser=count_arg("depth", 1, 1_000_000),
                                          help="how many edges deep"),
                as_json: bool = JSON_OPT) -> None:
    """Where a checkpoint came from (or, with --descendants, what came from it), as a tree. A
    run's origin the catalog does not know yet is shown pending."""
    with _catalog() as cat:
        cat.get_checkpoint(run, step)
        walk = cat.descendants if descendants else cat.ancestors
        edges = walk(run, step, max_depth=depth)
        states = cat.checkpoint_states([(run, step)] + [(e.child_run, e.child_step) for e in edges]
                                       + [(e.parent_run, e.parent_step) for e in edges])
        info = cat.get_run(run)
    if as_json:
        _emit_json(edges)
        return
    tree = lineage_tree(run, step, edges, descendants=descendants, states=states)
    origin = (info.parent_run, info.parent_step)
    if not descendants and info.parent_run and origin not in {(e.parent_run, e.parent_step) for e in edges}:
        tree.add(f"{origin[0]}/{origin[1]} [dim]({info.parent_relation})[/dim] [yellow](pending: not in the "
                 f"catalog yet)[/yellow]")
    out.print(tree)


def lineage_tree(run: str, step: int, edges: Sequence[LineageEdge], *, descendants: bool,
                 states: Mapping[tuple[str, int], str] | None = None) -> Tree:
    """A rich tree rooted at (run, step). A run's own ``follows`` chain stays at one level (a
    100-step run is a list, not 100 indents); a relation to another run (``resumed_from``,
    ``fine_tuned_from``, ``branched_from``) opens a branch, labelled with the relation. A
    checkpoint that is not ``committed`` (``states``: retired, corrupt, ...) says so; its edges stay."""
    def mark(at: tuple[str, int]) -> str:
        state = (states or {}).get(at, "committed")
        return "" if state == "committed" else f" [red]({state})[/red]"

    links: dict[tuple[str, int], list] = {}
    for e in edges:
        child, parent = (e.child_run, e.child_step), (e.parent_run, e.parent_step)
        src, dst = (parent, child) if descendants else (child, parent)
        links.setdefault(src, []).append((dst, e.relation))
    root = Tree(f"[bold]{run}/{step}[/bold]{mark((run, step))}")
    node_of, level_of = {(run, step): root}, {(run, step): root}
    queue = [(run, step)]
    while queue:
        src = queue.pop(0)
        for dst, rel in links.get(src, []):
            if dst in node_of:
                continue
            level = level_of[src] if rel == "follows" else node_of[src]
            node_of[dst] = level.add(f"{dst[0]}/{dst[1]} [dim]({rel})[/dim]{mark(dst)}")
            level_of[dst] = level if rel == "follows" else node_of[dst]
            queue.append(dst)
    return root


def pin_cmd(run: str, step: int = STEP, reason: str = typer.Option(None, "--reason", help="why it must be kept"),
            as_json: bool = JSON_OPT) -> None:
    """Keep a checkpoint on every tier, whatever retention says."""
    with _catalog() as cat:
        cat.pin(run, step, reason=reason, actor="cli")
    _done(run, step, True, as_json)


def unpin_cmd(run: str, step: int = STEP, as_json: bool = JSON_OPT) -> None:
    """Let retention decide about this checkpoint again."""
    with _catalog() as cat:
        cat.unpin(run, step, actor="cli")
    _done(run, step, False, as_json)


def _done(run: str, step: int, pinned: bool, as_json: bool) -> None:
    if as_json:
        _emit_json({"run": run, "step": step, "pinned": pinned})
    else:
        out.print(f"{run}/{step} {'pinned' if pinned else 'unpinned'}")
