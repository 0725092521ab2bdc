"""Operating commands: ``ckpt plan`` (sizing), ``ckpt agent`` (serve the deployments),
``ckpt watch`` (announce checkpoints a job wrote), ``ckpt up`` (the local stack) and
``ckpt run register``. Heavy imports happen inside the commands, never at import time."""

from __future__ import annotations

import json
from pathlib import Path

import typer


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
    params: str = typer.Option(None, "--params", help="model parameters, e.g. 70B (checkpoint = 14 bytes each)"),
    size: str = typer.Option(None, "--size", help="checkpoint size instead of --params, e.g. 980GB"),
    interval: str = typer.Option("30m", "--interval", help="time between checkpoints, e.g. 30m"),
    bandwidth: list[str] = typer.Option(["2GB/s"], "--bandwidth", help="write bandwidth; repeat to compare"),
    runs: bool = typer.Option(True, "--runs/--no-runs", help="also show each run's measured ΔMFU from the catalog"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The sizing model: checkpoint size, save time and compute lost (ΔMFU), per bandwidth,
    plus each run's measured ΔMFU from the writer stall times in the catalog."""
    from ckpt import sizing
    from ckpt.errors import BadInput

    if (params is None) == (size is None):
        raise BadInput("give exactly one of --params (e.g. 70B) or --size (e.g. 980GB)")
    volume = sizing.parse_size(size) if size else sizing.BYTES_PER_PARAM * sizing.parse_params(params)
    secs = sizing.parse_duration(interval)
    plans = [sizing.Plan(volume, secs, sizing.parse_bandwidth(b)) for b in bandwidth]
    figures = _measured_runs() if runs else []
    if as_json:
        typer.echo(json.dumps({
            "model": [{"checkpoint_bytes": p.checkpoint_bytes, "interval_seconds": p.interval_seconds,
                       "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s, "save_seconds": p.save_seconds,
                       "delta_mfu": p.delta_mfu} for p in plans],
            "runs": [f.__dict__ for f in figures],
        }, indent=1))
        return
    _print_plan(plans, figures)


def _measured_runs():
    """Each run's figure from the catalog; an unreachable catalog gives none (with a note)."""
    from ckpt import sizing
    from ckpt.settings import load_settings

    try:
        from db.catalog import Catalog

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


def _print_plan(plans, figures) -> None:
    from rich.console import Console
    from rich.table import Table

    from ckpt.sizing import fmt_bytes, fmt_percent, fmt_seconds

    con = Console()
    t = Table(title="Sizing model: ΔMFU = T_save / (T_interval + T_save), T_save = V / B")
    for col in ("checkpoint", "interval", "bandwidth", "T_save", "ΔMFU"):
        t.add_column(col, justify="right")
    for p in plans:
        t.add_row(fmt_bytes(p.checkpoint_bytes), fmt_seconds(p.interval_seconds),
                  fmt_bytes(p.bandwidth_bytes_per_s) + "/s", fmt_seconds(p.save_seconds),
                  fmt_percent(p.delta_mfu))
    con.print(t)
    if not figures:
        return
    m = Table(title="Measured per run (writer stall from the catalog)")
    for col in ("run", "checkpoints", "median stall", "median interval", "ΔMFU"):
        m.add_column(col, justify="right")
    for f in figures:
        m.add_row(f.run, str(f.checkpoints), fmt_seconds(f.median_stall_seconds),
                  fmt_seconds(f.median_interval_seconds) if f.median_interval_seconds else "-",
                  fmt_percent(f.delta_mfu) if f.delta_mfu is not None else "-")
    con.print(m)


# --- placeholders filled below -------------------------------------------------------------
def agent_cmd() -> None:
    """Serve the deployments on this node (not yet wired)."""
    raise typer.Exit(1)


def watch_cmd(
    directory: Path = typer.Argument(..., help="the folder the job writes its checkpoint folders into"),
    run: str = typer.Option(..., "--run", help="the run these checkpoints belong to"),
    marker: str = typer.Option("COMMITTED", "--marker", help="file the job writes when a folder is complete"),
    interval: float = typer.Option(2.0, "--interval", help="seconds between scans"),
    once: bool = typer.Option(False, "--once", help="scan once and exit"),
    part: int = typer.Option(0, "--part"),
    parts: int = typer.Option(1, "--parts"),
) -> None:
    """Commit and announce each complete checkpoint folder (DCP .metadata, HF index with all
    shards, or a marker file) once, for jobs that cannot use the client."""
    import logging

    from ckpt.paths import safe_run_name
    from ckpt.settings import load_settings
    from ckpt.watch import watch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    settings = load_settings()
    safe_run_name(run)

    def show(saved) -> None:
        typer.echo(f"committed {saved.run} step {saved.step} -> {saved.path}")

    n = watch(directory, run, settings, marker=marker, interval=interval, once=once, part=part, parts=parts,
              on_commit=show)
    typer.echo(f"{n} checkpoint(s) committed")


def up_cmd() -> None:
    raise typer.Exit(1)


def run_register_cmd() -> None:
    raise typer.Exit(1)
