"""``ckpt resume``: the resume point of a run on this node, for scripts that cannot import it."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ckpt.args import part_arg, parts_arg
from core import events
from core.errors import BadArgument, quoted


def register(app: typer.Typer) -> None:
    app.command("resume")(resume_cmd)


def resume_cmd(
    run: str = typer.Argument(..., help="training run"),
    part: int = typer.Option(None, "--part", parser=part_arg, help="this node's part (default: every part)"),
    parts: int = typer.Option(None, "--parts", parser=parts_arg, help="how many parts the job has"),
    to: Path = typer.Option(None, "--to", help="fetch into this folder (absent or empty) instead of Tier 0"),
    verify: str = typer.Option("size", "--verify", help="size (default) or full: read every byte back"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    attempt: str = typer.Option(None, "--attempt", help="this launch's attempt (default: CKPT_ATTEMPT, "
                                "torchrun's or Slurm's ids, else the unnamed one); recorded as resuming here"),
) -> None:
    """The newest checkpoint of RUN with a good copy of this node's part, and a local folder to load it
    from (printed alone on stdout; nothing there when the run has no checkpoint yet). The launch's
    attempt is recorded as resuming from it: older attempts' later checkpoints are superseded."""
    from ckpt.announce import to_prefect_api  # deferred: start-up — the events' sink, only for this command
    from core.attempt import launch_attempt  # deferred: start-up
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.resume import resume  # deferred: start-up — SQLAlchemy, Alembic

    if verify not in ("size", "full"):
        raise BadArgument(f"--verify must be size or full, not {quoted(verify)}")
    settings = load_settings()
    with events.announcing(to_prefect_api(settings)):
        point = resume(settings, run, part=part, parts=parts, to=to, verify=verify,  # type: ignore[arg-type]
                       actor="cli", attempt=launch_attempt(attempt))
    if point is None:  # stdout stays empty without --json: `DIR=$(ckpt resume RUN)` is then "" (a fresh start)
        if as_json:
            typer.echo(json.dumps({"run": run, "step": None}))
        else:
            typer.echo(f"{run}: no checkpoint yet", err=True)
        return
    if as_json:
        typer.echo(json.dumps(point.to_json(), indent=1))
        return
    if point.note:
        typer.echo(f"note: {point.note}", err=True)
    typer.echo(point.path)
