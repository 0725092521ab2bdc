"""``ckpt restore``, ``ckpt scrub``, ``ckpt drill`` and ``ckpt drills``: getting checkpoints
back, and proving that they can be. The commands run the plain functions in this process (no
Prefect server needed); the scheduled flows run the same functions. Heavy imports happen
inside the commands, never at import time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ckpt.args import count_arg, durable_tier_arg, step_arg, tier_arg
from ckpt.tables import table as fit_table
from core.errors import BadInput

if TYPE_CHECKING:
    from db.entities import DrillResult


def register(app: typer.Typer) -> None:
    app.command("restore")(restore_cmd)
    app.command("scrub")(scrub_cmd)
    app.command("drill")(drill_cmd)
    app.command("drills")(drills_cmd)


# --- ckpt restore ----------------------------------------------------------------------------
def restore_cmd(
    run: str = typer.Argument(..., help="training run"),
    to: Path = typer.Option(..., "--to", help="destination folder (absent or empty); filled atomically"),
    step: int = typer.Option(None, "--step", parser=step_arg, help="restore this step (default: the newest verified)"),
    tier: list[int] = typer.Option(None, "--tier", parser=tier_arg,
                                   help="only these tiers, in this order (default 0 1 2)"),
    fallback: bool = typer.Option(None, "--fallback/--no-fallback",
                                  help="fall back to an older checkpoint when none of this one's copies is good "
                                       "(default: yes without --step, no with it)"),
    attempt: str = typer.Option(None, "--attempt", help="with --step: the attempt that saved it (a superseded "
                                "checkpoint is restored only when named so)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON (no progress bar)"),
) -> None:
    """Restore a checkpoint from the nearest tier holding a verified copy, checking every file."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.replicas import DEFAULT_PREFERENCE  # deferred: start-up — SQLAlchemy, Alembic
    from tasks.restore import restore_checkpoint  # deferred: start-up — Prefect, SQLAlchemy

    settings = load_settings()
    preference = tuple(tier) if tier else DEFAULT_PREFERENCE
    err = Console(stderr=True)
    if as_json:
        report = restore_checkpoint(settings, run, to, step=step, preference=preference, fallback=fallback,
                                    attempt=attempt)
    else:
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task("restoring", total=None)

            def progress(done: int, total: int, label: str) -> None:
                bar.update(task, completed=done, total=total, description=label)

            report = restore_checkpoint(settings, run, to, step=step, preference=preference,
                                        fallback=fallback, progress=progress, attempt=attempt)
    if as_json:
        typer.echo(json.dumps({
            "run": report.run, "step": report.step, "dest": report.dest, "tiers": report.tiers,
            "tier": report.tier, "bytes": report.bytes, "files": report.files,
            "seconds": round(report.seconds, 3), "mb_per_s": round(report.mb_per_s, 1),
            "fell_back_from": report.fell_back_from, "notes": report.notes,
            "bad": [b.__dict__ for b in report.bad],
        }, indent=1))
        return
    for note in report.notes:
        err.print(f"[yellow]note:[/yellow] {note}")
    out = Console()
    out.print(f"restored [bold]{report.run}[/bold] step {report.step} into {report.dest}")
    out.print(f"  tier used : {', '.join(str(t) for t in sorted(set(report.tiers)))}")
    out.print(f"  bytes     : {report.bytes:,} in {report.files} files")
    out.print(f"  seconds   : {report.seconds:.2f}")
    out.print(f"  throughput: {report.mb_per_s:,.1f} MB/s")


# --- ckpt scrub ------------------------------------------------------------------------------
def scrub_cmd(
    all_: bool = typer.Option(False, "--all", help="read back every stored copy, not a share"),
    fraction: float = typer.Option(None, "--fraction", help="share of the copies to read (default: settings)"),
    repair: bool = typer.Option(True, "--repair/--no-repair", help="repair bad and under-replicated copies"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Read stored copies back, mark the bad ones, repair them from a good copy."""
    from rich.console import Console

    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.scrub import scrub  # deferred: start-up — Prefect, SQLAlchemy

    report = scrub(load_settings(), fraction=1.0 if all_ else fraction, repair=repair)
    if as_json:
        typer.echo(json.dumps({
            "eligible": report.eligible, "checked": report.checked, "bytes_read": report.bytes_read,
            "seconds": round(report.seconds, 3), "bad": [b.__dict__ for b in report.bad],
            "repairs": [r.row() for r in report.repairs], "skipped": report.skipped,
        }, indent=1))
    else:
        out = Console()
        for b in report.bad:
            out.print(f"[red]{b.state}[/red] {b.run}/step-{b.step} part {b.part} tier {b.tier}: {b.reason}")
        for r in report.repairs:
            mark = "[green]repaired[/green]" if r.ok else "[red]NOT repaired[/red]"
            out.print(f"{mark} {r.run}/step-{r.step} part {r.part} tier {r.tier}: {r.detail}")
        for s in report.skipped:
            out.print(f"[yellow]skipped[/yellow] {s}")
        out.print(report.summary())
    if not report.ok:
        raise typer.Exit(1)


# --- ckpt drill / drills -----------------------------------------------------------------------
def drill_cmd(
    run: str = typer.Option(None, "--run", help="drill this run (default: the run of the newest milestone)"),
    nodes: int = typer.Option(None, "--nodes", parser=count_arg("nodes", 1, 1_000_000),
                              help="nodes resuming at once, one per part "
                              "(default: the checkpoint's parts; must equal them)"),
    tier: list[int] = typer.Option(None, "--tier", parser=durable_tier_arg,
                                   help="drill this tier only (1 or 2; repeat for both) "
                                   "[1 and 2]"),
    scratch: Path = typer.Option(None, "--scratch", help="scratch folder (default: <data_dir>/drills)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run a recovery drill now: for each tier, the run's newest checkpoint held whole there is
    resumed by one process per part at once, cold (no Tier 0 of their own), each part loaded
    with its format's loader and checked against the manifest; records the cluster RTO (first
    start to last part loaded), each node's time, bytes read per tier and the bound (the same
    bytes read raw from the tier by the same processes, all at once)."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.drill import DRILL_TIERS, cluster_drill, require_drilled  # deferred: start-up — Prefect, SQLAlchemy

    tiers = tuple(tier) if tier else DRILL_TIERS
    if any(t not in DRILL_TIERS for t in tiers):
        raise BadInput(f"--tier must be 1 or 2 (a drill sets this node's Tier 0 aside), not {list(tiers)}")
    drills, skipped = cluster_drill(load_settings(), run=run, nodes=nodes, tiers=tiers, scratch=scratch)
    if as_json:
        typer.echo(json.dumps([d.row() for d in drills], indent=1))
    else:
        for s in skipped:
            typer.echo(s)
        if drills:
            _print_drills([d.result for d in drills])
    require_drilled(drills, skipped)
    if not all(d.result.ok for d in drills):
        raise typer.Exit(1)


def drills_cmd(
    run: str = typer.Option(None, "--run", help="only this run"),
    limit: int = typer.Option(50, "--limit", parser=count_arg("limit", 1, 1_000_000), help="newest N drills"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The history of restoration drills: recovery time per tier."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.base import open_catalog  # deferred: start-up — SQLAlchemy, Alembic
    from tasks.drill import cluster_row  # deferred: start-up — Prefect, SQLAlchemy

    with open_catalog(load_settings().catalog_url) as cat:
        results = cat.drills(run, limit)
    if as_json:
        typer.echo(json.dumps([cluster_row(r) for r in results], indent=1))
        return
    _print_drills(results)


def _print_drills(results: list[DrillResult]) -> None:
    from rich.console import Console

    from tasks.drill import cluster_row  # deferred: start-up — Prefect, SQLAlchemy

    table = fit_table("at", "run", "step", "tier", "nodes", "ok", "RTO s", "bound s", "MB/s", "detail",
                       title="restoration drills (RTO: first start to last part loaded)",
                       right=("step", "tier", "nodes", "RTO s", "bound s", "MB/s"))
    for r in results:
        row = cluster_row(r)
        bound = row["bound_seconds"]
        at = row["at"][:19].replace("T", " ")  # date and time wrap apart
        table.add_row(at, row["run"], str(row["step"]), str(row["tier"]), str(row["nodes"]),
                      "[green]ok[/green]" if row["ok"] else "[red]FAILED[/red]", f"{row['seconds']:.2f}",
                      "-" if bound is None else f"{bound:.2f}", f"{row['MB/s']:.0f}", row["detail"])
    Console().print(table if results else "no drills recorded yet")
