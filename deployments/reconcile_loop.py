"""Reconcile's schedule: a pass every ``reconcile_interval_seconds`` in the node's own process
(``ckpt agent``'s, or ``ckpt reconcile --every``), not a scheduled deployment. A scheduled run
costs the orchestrator a flow run per node per interval and fills the Runs page with passes that
found nothing; here a pass is plain code (``flows.reconcile.reconcile_pass``) and leaves a flow
run only when it acted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import copy_context

from core.settings import Settings

log = logging.getLogger("ckpt.reconcile")


def reconcile_every(settings: Settings, stop: threading.Event) -> None:
    """A pass now, then one every ``reconcile_interval_seconds`` until ``stop`` is set. A pass
    that raises (a catalog down) is logged and the next one tries again: the safety net never
    stops for good."""
    from flows.reconcile import reconcile_pass  # deferred: start-up — Prefect, SQLAlchemy

    while not stop.is_set():
        try:
            report = reconcile_pass(settings)
            if report.acted():
                log.info("reconcile on %s: %s", settings.node,
                         ", ".join(f"{len(v)} {k}" for k, v in vars(report).items() if v and k != "promotions"))
        except Exception as exc:  # the next pass tries again (see above)
            log.warning("reconcile on %s failed: %s: %s", settings.node, type(exc).__name__, exc, exc_info=True)
        stop.wait(settings.reconcile_interval_seconds)


@contextmanager
def reconciling(settings: Settings) -> Iterator[threading.Event]:
    """``reconcile_every`` on a daemon thread for the block (in the caller's context: the Prefect
    settings in force there are the passes'); stopped on the way out, without waiting for a pass
    under way (the process is ending; a pass is safe to interrupt, as any step is)."""
    stop = threading.Event()
    thread = threading.Thread(target=copy_context().run, args=(reconcile_every, settings, stop),
                              name=f"reconcile-{settings.node}", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
