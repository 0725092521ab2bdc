"""``ckpt tiers``: what every tier holds and costs (the storage matrix); ``ckpt tiers init``:
mark each configured tier root and record its identity in the catalog."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from core.errors import BadArgument
from core.sizing import fmt_bytes, fmt_percent
from core.tier_figures import WINDOW_SECONDS, fmt_bandwidth, fmt_latency, fmt_spread

if TYPE_CHECKING:
    from tasks.tier_matrix import TierRow
from core.tiers import ALL_TIERS


def register(app: typer.Typer) -> None:
    tiers_app = typer.Typer()  # its help: the matrix's docstring

    @tiers_app.callback(invoke_without_command=True)
    def matrix_cmd(ctx: typer.Context,
                   run: str = typer.Option(None, "--run", help="only this run's checkpoints and hops"),
                   as_json: bool = typer.Option(False, "--json", help="one JSON object: the window and a row per tier")
                   ) -> None:
        """What every tier holds and costs (and, with init, mark the tier roots).

        The storage matrix from this cluster's records, one row per tier: its URL, whether its
        root proves its identity now, checkpoints and bytes held (logical, stored, dedup ratio),
        budget and use, write and read bandwidth and first-byte latency of the last day's hops
        (median and p95), and the monthly cost at the tier's price per GB-month. A tier whose
        mount is missing is shown unavailable; its figures are the catalog's."""
        if ctx.invoked_subcommand is not None:
            return
        from core.settings import load_settings  # deferred: start-up — pydantic-settings
        from tasks.tier_matrix import tier_matrix  # deferred: start-up — SQLAlchemy, the stores

        rows = tier_matrix(load_settings(), run=run)
        if as_json:
            typer.echo(json.dumps({"run": run, "window_seconds": WINDOW_SECONDS,
                                   "tiers": [r.as_json() for r in rows]}, indent=1))
            return
        print_matrix(rows, title="Tiers" + (f" of run {run}" if run else "") + ": their roots now")

    @tiers_app.command("init")
    def init_cmd(replace: bool = typer.Option(
            False, "--replace",
            help="record the marker the root shows now (writing one if none) in place of the recorded one: "
                 "only when the storage behind a tier was replaced on purpose"),
            tier: list[int] = typer.Option(None, "--tier", help="only this tier (repeat for more; "
                                           "default 0 1 2), e.g. --tier 0 on a replaced node")) -> None:
        """Mark this node's tier roots (Tier 0 here, Tiers 1 and 2) and record them; idempotent.

        A root must exist (it is never created). A recorded root that shows another marker, or
        none, is reported unavailable and left as it is: mount it, or pass --replace when the
        storage was replaced."""
        from core.settings import load_settings  # deferred: start-up — pydantic-settings
        from tasks.tier_roots import UNAVAILABLE, init_tiers  # deferred: start-up — SQLAlchemy

        tiers = tuple(tier) if tier else ALL_TIERS
        if not set(tiers) <= set(ALL_TIERS):
            raise BadArgument(f"--tier must be 0, 1 or 2, not {list(tiers)}")
        states = init_tiers(load_settings(), actor="cli", replace=replace, tiers=tiers)
        for state in states:
            typer.echo(state.line())
        if any(s.state == UNAVAILABLE for s in states):
            raise typer.Exit(1)

    app.add_typer(tiers_app, name="tiers")


ROOTS = ("tier", "url", "identity", "detail")
HELD = ("tier", "checkpoints", "logical", "stored", "dedup", "budget", "use", "$/GB-mo", "$/month")
MEASURED = ("tier", "write", "read", "first byte")


def print_matrix(rows: list[TierRow], *, title: str) -> None:
    """The matrix as three tables (``ckpt.tables``), each read whole on an 80-column terminal:
    the roots and their identity now, what each tier holds and costs, what its hops measured
    (``median / p95 (hops)``); '—' where nothing was measured or set."""
    from rich.console import Console  # deferred: start-up — rich, only to print

    from ckpt.tables import table  # deferred: start-up — rich, only to print

    roots = table(*ROOTS, title=title)
    held = table(*HELD, title="What each holds and costs", right=HELD[1:])
    measured = table(*MEASURED, title="Measured over the last day's hops: median / p95 (hops)",
                     right=MEASURED[1:])
    notes: list[str] = []
    for r in rows:
        roots.add_row(str(r.tier), r.url or "—", r.identity, r.detail or "")
        budget = fmt_bytes(r.budget_bytes) if r.budget_bytes else "—"
        use = fmt_percent(r.budget_used or 0.0).replace(" ", "") if r.budget_bytes else "—"
        held.add_row(str(r.tier), str(r.checkpoints), fmt_bytes(r.logical_bytes), fmt_bytes(r.stored_bytes),
                     f"{r.dedup_ratio:.2f}×" if r.dedup_ratio is not None else "—", budget, use,
                     f"{r.price_gb_month:g}", f"{r.monthly_cost:,.2f}")
        if r.budget_node:
            notes.append(f"Tier {r.tier}'s budget is each node's; its use is the fullest node's, {r.budget_node}.")
        measured.add_row(str(r.tier), fmt_spread(r.write, fmt_bandwidth), fmt_spread(r.read, fmt_bandwidth),
                         fmt_spread(r.first_byte, fmt_latency))
    con = Console()
    for t in (roots, held, measured):
        con.print(t)
        if t is held and notes:
            con.print("\n".join(notes), highlight=False)
