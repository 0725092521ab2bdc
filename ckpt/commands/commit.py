"""``ckpt commit DIR --run R --step S``: commit and announce a folder a job wrote (see
``ckpt/commit.py``). Heavy imports happen inside the command."""

from __future__ import annotations

from pathlib import Path

import typer

from ckpt.args import checkpoint_ref, part_arg, parts_arg, step_arg
from ckpt.commands.ops import origin_options


def register(app: typer.Typer) -> None:
    app.command("commit")(commit_cmd)


def commit_cmd(
    directory: Path = typer.Argument(..., help="the checkpoint folder the job wrote"),
    run: str = typer.Option(..., "--run", help="the run it belongs to"),
    step: int = typer.Option(..., "--step", parser=step_arg, help="its training step"),
    milestone: bool = typer.Option(False, "--milestone", help="tag it a milestone (archived to Tier 2)"),
    epoch_end: bool = typer.Option(False, "--epoch-end", help="it closes an epoch"),
    resumed_from: str = typer.Option(None, "--resumed-from", "--parent", help="RUN/STEP the run resumed from"),
    fine_tuned_from: str = typer.Option(None, "--fine-tuned-from", help="RUN/STEP the run fine-tunes"),
    branched_from: str = typer.Option(None, "--branched-from", help="RUN/STEP the run branched from"),
    part: int = typer.Option(0, "--part", parser=part_arg, help="this node's part (multi-node checkpoints)"),
    parts: int = typer.Option(1, "--parts", parser=parts_arg, help="how many parts the checkpoint has"),
    attempt: str = typer.Option(None, "--attempt", help="the job's attempt (default: CKPT_ATTEMPT, torchrun's or "
                                "Slurm's ids, else the unnamed one)"),
    announce: bool = typer.Option(True, "--announce/--no-announce",
                                  help="emit ckpt.checkpoint.completed (--no-announce: commit only, e.g. "
                                       "to POST the event yourself)"),
) -> None:
    """Check the folder's format, write its manifest (CRC32C, and the run's origin if given),
    commit it under <tier0>/<run>/step-XXXXXXXX/ and announce it. Exit 1 when the event did not arrive (the
    checkpoint stays committed; reconcile promotes it)."""
    from ckpt.announce import prefect_api_url, undelivered  # deferred: start-up — pydantic-settings (core.settings)
    from ckpt.commit import commit_folder  # deferred: start-up — pydantic-settings (core.settings)
    from core.settings import load_settings  # deferred: start-up — pydantic-settings

    checkpoint_ref(step, part, parts)
    origin = origin_options(resumed_from, fine_tuned_from, branched_from)
    settings = load_settings()
    done = commit_folder(directory, run, step, settings, milestone=milestone, epoch_end=epoch_end,
                         origin=origin, part=part, parts=parts, announce=announce, attempt=attempt)
    m = done.saved.manifest
    typer.echo(f"committed {m.run} step {m.step} part {m.part}/{m.parts} ({m.format}, {m.kind}, "
               f"{len(m.files)} files) -> {done.saved.path / m.name}")
    if done.announced is False:
        typer.echo(undelivered(settings, m.run, m.step, m.part, prefect_api_url(settings)), err=True)
        raise typer.Exit(1)
    if done.announced:
        typer.echo("announced ckpt.checkpoint.completed")
