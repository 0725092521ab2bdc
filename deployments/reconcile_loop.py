"""Reconcile's schedule: a pass every ``reconcile_interval_seconds`` in the node's own process
(``ckpt agent``'s, or ``ckpt reconcile --every``), not a scheduled deployment. A scheduled run
costs the orchestrator a flow run per node per interval and fills the Runs page with passes that
found nothing; here a pass is plain code (``flows.reconcile.reconcile_pass``) and leaves a flow
run only when it acted, or failed otherwise than the last run showed (``flows.reconcile.decide``).

Each pass runs in a child forked from the agent's zygote, as a part's promotion does
(``deployments.processes.run_child``): one whose storage stops answering (a hung mount) is killed
once no byte moved for ``copy_stall_seconds`` and the next interval runs the next pass, and what a
pass holds (the catalog's connection, buffers, every page it touched) ends with its process: the
agent's memory at rest stays what it was. One pass at a time (this loop waits for each), beside
the parts' promotions (their own worker and children). What the last run showed of the passes'
failures (``flows.reconcile.Shown``, as plain values) is kept here, handed to each pass and
returned by it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import copy_context
from typing import Any

from core.settings import Settings
from deployments.processes import ChildContext, agent_context, child_context, run_child

log = logging.getLogger("ckpt.reconcile")


def reconcile_every(settings: Settings, stop: threading.Event, *, events: bool = True, cluster: bool = True) -> None:
    """A pass now, then one every ``reconcile_interval_seconds`` until ``stop`` is set, each in a
    child (``one_pass``). A pass that fails, stalls or dies is logged and the next one tries again:
    the safety net never stops for good. ``events``: this node's agent promotes parts on their
    events (``ckpt agent``; not ``ckpt reconcile --every``), so a part just committed is theirs.
    Without ``cluster`` (a node's agent, ``--node-only``) the passes leave the cluster's share to
    the cluster agent's (``flows.reconcile.reconcile_once``)."""
    context = child_context()
    shown: dict[str, Any] = {}
    while not stop.is_set():
        try:
            shown = one_pass(settings, context, shown, events=events, cluster=cluster)
        except Exception as exc:  # noqa: BLE001 - the next pass tries again (see above)
            log.warning("reconcile pass on %s not run: %s: %s", settings.node, type(exc).__name__, exc)
        stop.wait(settings.reconcile_interval_seconds)


def one_pass(settings: Settings, context: ChildContext, shown: dict[str, Any], *,
             events: bool = True, cluster: bool = True) -> dict[str, Any]:
    """One pass in a child, watched for stalls (``run_child``); what it hands back to keep (the
    fields of ``flows.reconcile.Shown``; {} at first), or ``shown`` again when it handed back
    nothing (killed, died)."""
    _, kept = run_child(run_pass_process, (settings, context, shown, events, cluster),
                        stall_s=settings.copy_stall_seconds, what=f"reconcile pass on {settings.node}",
                        again=f"the next pass runs in {settings.reconcile_interval_seconds:g} s")
    return kept if isinstance(kept, dict) else shown


def run_pass_process(settings: Settings, context: ChildContext, shown: dict[str, Any], events: bool,
                     cluster: bool, beat: Any) -> dict[str, Any]:
    """A pass in a child (``flows.reconcile.reconcile_pass``); returns what to keep."""
    from dataclasses import asdict

    from flows.reconcile import Shown, reconcile_pass  # deferred: start-up — Prefect, SQLAlchemy (preloaded)

    with agent_context(context, beat, settings.log_level):
        report, kept = reconcile_pass(settings, Shown(**shown), events=events, cluster=cluster)
        if report.acted():
            log.info("reconcile on %s: %s", settings.node,
                     ", ".join(f"{len(v)} {k}" for k, v in vars(report).items() if v and k != "promotions"))
    return asdict(kept)


@contextmanager
def reconciling(settings: Settings, *, cluster: bool = True) -> Iterator[threading.Event]:
    """``reconcile_every`` on a daemon thread for the block (in the caller's context: the Prefect
    settings in force there are the passes'); stopped on the way out, without waiting for a pass
    under way (the process is ending; a pass is safe to interrupt, as any step is). ``cluster``:
    as for ``reconcile_every``."""
    stop = threading.Event()
    thread = threading.Thread(target=copy_context().run, args=(reconcile_every, settings, stop),
                              kwargs={"cluster": cluster}, name=f"reconcile-{settings.node}", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
