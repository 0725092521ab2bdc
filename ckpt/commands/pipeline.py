"""``ckpt promote``, ``ckpt retention`` and ``ckpt reconcile``: the pipeline by hand.

``promote --here`` runs the promotion in this process (this machine must hold the part's
Tier 0); without it the node's promote deployment runs it (``--wait`` waits for the end).
``retention`` and ``reconcile`` run in this process. In-process work runs as a Prefect flow
run (recorded, with events and artifacts) when a Prefect API is configured, and as the same
steps called as plain functions when none is (Prefect would otherwise start a temporary
server, slow to start). Heavy imports happen inside the commands, never at import time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, cast

import typer

from ckpt.args import checkpoint_ref, part_arg, parts_arg, step_arg
from ckpt.tables import table as fit_table
from core.errors import CkptError
from core.progress import observe
from deployments.names import promote_deployment

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


def register(app: typer.Typer) -> None:
    app.command("promote")(promote_cmd)
    app.command("retention")(retention_cmd)
    app.command("reconcile")(reconcile_cmd)


@contextmanager
def prefect_api(settings: Any) -> Iterator[None]:
    """Point Prefect at ``Settings.prefect_api_url`` when it is set (else Prefect's own)."""
    if not settings.prefect_api_url:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: settings.prefect_api_url}):
        yield


def prefect_configured(settings: Any) -> bool:
    """Whether a Prefect API is set (``Settings.prefect_api_url``, PREFECT_API_URL, a profile)."""
    from prefect.settings import get_current_settings

    return bool(settings.prefect_api_url or get_current_settings().api.url)


def promote_cmd(
    run: str = typer.Option(..., "--run", help="training run"),
    step: int = typer.Option(..., "--step", parser=step_arg, help="checkpoint step"),
    part: int = typer.Option(0, "--part", parser=part_arg, help="this node's part (0-based)"),
    parts: int = typer.Option(1, "--parts", parser=parts_arg, help="how many parts the checkpoint has"),
    node: str = typer.Option(None, "--node", help="node holding the part's Tier 0 (default: settings)"),
    attempt: str = typer.Option("", "--attempt", help="the attempt that saved it (its folder's @ATTEMPT)"),
    here: bool = typer.Option(False, "--here", help="run the flow in this process"),
    wait: bool = typer.Option(False, "--wait", help="without --here: wait for the deployment's run to end"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Promote a checkpoint part: verify on Tier 0, copy to Tier 1, then archive and prune."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings

    checkpoint_ref(step, part, parts)
    settings = load_settings(**({"node": node} if node else {}))
    if here and not prefect_configured(settings):
        from flows.common import plain_steps  # deferred: start-up — Prefect, SQLAlchemy
        from flows.promote import promote  # deferred: start-up — Prefect, SQLAlchemy

        with _progress_bar(as_json):
            result = promote(settings, run, step, part, parts, steps=plain_steps(), node=settings.node,
                             attempt=attempt).summary()
        _print_promotion(result, as_json)
        return
    with prefect_api(settings):
        if here:
            from flows.promote import promote_checkpoint  # deferred: start-up — Prefect, SQLAlchemy

            with _progress_bar(as_json):
                result = promote_checkpoint(run, step, part, parts, node=settings.node, attempt=attempt)
            _print_promotion(result, as_json)
            return
        _run_deployment(run, step, part, parts, settings.node, wait=wait, attempt=attempt)


@contextmanager
def _progress_bar(off: bool) -> Iterator[None]:
    """A rich progress bar (on stderr) fed by every copy this command runs."""
    if off:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def update(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        with observe(update):
            yield


def _run_deployment(run: str, step: int, part: int, parts: int, node: str, *, wait: bool, attempt: str = "") -> None:
    from prefect.deployments import run_deployment

    name = promote_deployment(node)
    # sync_compatible: called outside an event loop it returns the FlowRun, not a coroutine
    params = {"run": run, "step": step, "part": part, "parts": parts, "node": node, "attempt": attempt}
    fr = cast("FlowRun", run_deployment(name, parameters=params,
                                        timeout=None if wait else 0, as_subflow=False))
    typer.echo(f"flow run {fr.name} ({fr.id}) of {name}: {fr.state.name if fr.state else 'scheduled'}")
    if wait and fr.state is not None and not fr.state.is_completed():
        raise CkptError(f"promotion {fr.name} ended {fr.state.name}: {fr.state.message or ''}".strip())


def _print_promotion(result: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    from rich.console import Console

    hops = result["hops"] + ((result.get("archive") or {}).get("hops") or [])
    table = fit_table("hop", "files", "bytes", "seconds", "MB/s", "skipped",
                       title=f"{result['run']} step {result['step']} part {result['part'] + 1}/{result['parts']}",
                       right=("files", "bytes", "seconds", "MB/s"))
    for h in hops:
        table.add_row(h["hop"], str(h["files"]), f"{h['bytes']:,}", f"{h['seconds']:.3f}", f"{h['MB/s']:.1f}",
                      "yes" if h["skipped"] else "")
    out = Console()
    out.print(table)
    if result["durable"]:
        out.print("checkpoint complete on Tier 1 (durable)")
    if result.get("retention") is not None:
        _print_retention(result["retention"], out=out, title="retention")


def retention_cmd(
    run: str = typer.Option(None, "--run", help="only this run (default: every run)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, delete nothing"),
    explain: bool = typer.Option(False, "--explain", help="also list every kept copy and the rule that keeps it"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON (field `reason`: the rule)"),
) -> None:
    """Apply each tier's retention policy: demote copies through the guarded prune and retire
    checkpoints no tier keeps (or, with --dry-run, show the plan and the rule behind each line)."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from flows.common import plain_steps  # deferred: start-up — Prefect, SQLAlchemy
    from flows.retention import enforce_retention, run_retention  # deferred: start-up — Prefect, SQLAlchemy

    settings = load_settings()
    if prefect_configured(settings):
        with prefect_api(settings):
            rows = enforce_retention(run=run, dry_run=dry_run, node=settings.node, explain=explain)
    else:
        rows = [a.row() for a in run_retention(settings, run=run, dry_run=dry_run, steps=plain_steps(),
                                           explain=explain)]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
    else:
        _print_retention(rows, title="retention plan (dry run)" if dry_run else "retention")


def _print_retention(rows: list[dict], *, out: Any = None, title: str) -> None:
    """The plan as a table: each copy, what the rule decided and why, and what became of it; a
    tier over its budget as a line of its own (``the tier``: over budget, the rules holding it)."""
    from rich.console import Console

    out = out or Console()
    if not rows:
        out.print(f"{title}: nothing to demote or retire")
        return
    table = fit_table("tier", "checkpoint", "action", "reason", "outcome", title=title)
    for r in rows:
        what = f"{r['run']}/{r['step']}" + (f" part {r['part']}" if r["part"] else "") if r["run"] else "the tier"
        what += f" on {r['node']}" if r["tier"] == 0 and r["node"] else ""
        outcome = r["outcome"] + (f": {r['detail']}" if r["detail"] and r["detail"] != r["reason"] else "")
        table.add_row(str(r["tier"]), what, r["action"], r["reason"], outcome)
    out.print(table)


def reconcile_cmd(
    node: str = typer.Option(None, "--node", help="this node's label (default: settings)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    every: bool = typer.Option(False, "--every", help="run until interrupted, a pass every reconcile_interval_seconds "
                               "(a node with a Prefect worker instead of `ckpt agent`); a pass leaves a flow run only "
                               "when it acted or its failures changed"),
) -> None:
    """Promote what events missed, mark vanished copies missing, archive pending milestones,
    prune this node's Tier 0 by retention."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from flows.common import plain_steps  # deferred: start-up — Prefect, SQLAlchemy
    from flows.reconcile import reconcile, reconcile_once  # deferred: start-up — Prefect, SQLAlchemy

    settings = load_settings(**({"node": node} if node else {}))
    if every:
        import threading

        from deployments.reconcile_loop import reconcile_every  # deferred: start-up — Prefect, SQLAlchemy

        with prefect_api(settings), suppress(KeyboardInterrupt):
            reconcile_every(settings, threading.Event(), events=False)
        return
    if prefect_configured(settings):
        with prefect_api(settings):
            report = reconcile(node=settings.node)
    else:
        done = reconcile_once(settings, steps=plain_steps(), grace_seconds=settings.reconcile_interval_seconds)
        report = {k: list(v) for k, v in vars(done).items()}
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    for action, items in report.items():
        if action == "promotions":  # the promoted ones again, as rows (the artifact's, --json's)
            continue
        for item in items:
            typer.echo(f"{action:9s} {item}")
    if not any(report.values()):
        typer.echo("nothing to reconcile")
