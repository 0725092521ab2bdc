"""``ckpt tiers init``: mark each configured tier root and record its identity in the catalog."""

from __future__ import annotations

import typer

from core.errors import BadArgument
from core.tiers import ALL_TIERS


def register(app: typer.Typer) -> None:
    tiers_app = typer.Typer(help="Tier roots and their identity markers.", no_args_is_help=True)

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
