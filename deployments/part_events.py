"""How a checkpoint is promoted: the node's agent promotes its parts itself, on their events, and
only the part that completes a checkpoint starts a promote flow run, which takes the
checkpoint's follow-ups. The one way: no deployment trigger makes a run per part.

Why: a Prefect flow run costs ~0.45-0.5 CPU s of orchestration (the run record, its states,
events and logs, the engine around it: docs/design/burst.md, "What a flow run per part costs"),
so a run per part cost a checkpoint of N parts N of them, whatever the parts' own work. Here a
part's ``ckpt.checkpoint.completed`` event reaches its node's agent over Prefect's event stream,
and the agent runs the part's hop as plain functions (``flows.promote.promote_in_agent``): the
same steps, claims, catalog records, retry policy, copy priority and announced events as a
promote run, with no run around them. The part whose hop records the checkpoint complete on
Tier 1 (one per checkpoint) has the agent start the checkpoint's one run of its node's promote
deployment, at once (``processes.start_checkpoint_run``, an idempotency key per checkpoint:
``flows.promote.followups_key``); that run finds the part on Tier 1, takes the follow-ups
(archive, ``ckpt.checkpoint.durable``, status page, retention), shows every part's hop (its hop
table, with each part's copy attempts) and is the checkpoint's run in the UI.

What covers a gap: Prefect's subscriber replays the last minute of matching events when it
(re)connects (duplicates are no-ops: a part already verified on Tier 1 is skipped); an event
missed for longer (the agent down) is found by the node's reconcile pass, which promotes any
committed part of its Tier 0 that is not on Tier 1 and runs the follow-ups of any complete
checkpoint whose follow-ups are not done. The event stream is best effort, so the agent also
lists its Tier 0 every ``Settings.part_scan_seconds`` and promotes a committed part no event
brought, once two scans in a row found it (``PartEvents.scan``).

One promotion at a time per agent, in the order the events arrive, each in a child process
(deployments/processes.py) that exits when its part is done, at the copy priority
(``copy_nice``, ``copy_io_class``); a checkpoint's run in a child of its own, so the next part
does not wait for the follow-ups. A malformed event is a rejection in the catalog and one line
in the agent's log; a part that fails after its retries is one line too
(``ckpt.checkpoint.corrupt`` when its bytes were bad), and reconcile tries it again; neither
stops the next event. Nor does a part whose storage stopped answering: a child that moved no
byte for ``copy_stall_seconds`` is killed (``processes.watch_stall``); its claim, no longer
renewed, lapses and reconcile tries the part again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

from core import events
from core.events import Announcer
from core.layout import parse_number
from core.settings import Settings
from deployments.processes import (
    FOLLOWUPS,
    ChildContext,
    child_context,
    crash_checkpoint_run,
    promote_part,
    run_checkpoint_process,
    run_child,
    run_part_process,
    start_checkpoint_run,
    start_fork_server,
    what,
)

log = logging.getLogger("ckpt.agent.parts")

RESUBSCRIBE_SECONDS = 5.0


def completed_filter(node: str) -> Any:
    """The completed events of ``node``'s parts (the label the training job sets, ``ckpt.node``)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.schemas.events import ResourceSpecification

    return EventFilter(event=EventNameFilter(name=[events.COMPLETED]),
                       resource=EventResourceFilter(labels=ResourceSpecification({"ckpt.node": node})))


class LoopThread:
    """``main()``, a coroutine, on an event loop of its own on a daemon thread that sees the
    starting thread's context (Prefect's settings live in a contextvar: a bare thread would fall
    back to the settings read at import time); ``stop`` cancels it and waits for the thread."""

    def __init__(self, main: Callable[[], Any], *, name: str) -> None:
        self._main_fn, self.name = main, name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=ctx.run, args=(self._run,), name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._main = self._loop.create_task(self._main_fn())
            with suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._main)
        finally:
            self._loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._main is not None:
            with suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._main.cancel)
        if self._thread is not None:
            self._thread.join(timeout)


class PartEvents:
    """The subscription to the node's completed events and the worker that promotes each part.

    Each part is promoted in a child process (deployments/processes.py), one at a time, which
    exits when the part is done: the agent's own memory stays what it was at rest (the catalog's
    connection and statements, the copy's buffers and every page the promotion touched end with
    the child). ``fork=False`` (tests): the worker thread runs it itself."""

    def __init__(self, settings: Settings, *, announcer: Announcer | None = None, fork: bool = True) -> None:
        self.settings = settings
        self.node = settings.node
        self.announcer = announcer  # how the hops' facts are announced: Prefect events (``emit``) unless given
        self.fork = fork
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-part")
        self._runs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-checkpoint-run")
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._listener: LoopThread | None = None
        self._context: ChildContext | None = None  # what a forked promotion must see (``start``)
        self._known: set[tuple[str, int, int, str]] = set()  # parts submitted, or on Tier 0 when the agent started
        self._pending: set[tuple[str, int, int, str]] = set()  # found by the last scan, not submitted yet
        self._scans = 0
        self.done: list[Future] = []  # the last promotions' futures (tests; bounded)

    def start(self) -> None:
        self._context = child_context()
        if self.fork:
            start_fork_server(self.settings)
        self._listener = LoopThread(self._listen, name="ckpt-part-events")
        self._listener.start()
        try:
            self.scan()  # what is on Tier 0 now is reconcile's
        except Exception as exc:  # noqa: BLE001 - the agent serves events without it; the next scan marks it
            log.warning("scan of Tier 0 failed: %s: %s", type(exc).__name__, exc)
        scanner = threading.Thread(target=contextvars.copy_context().run, args=(self._scan_forever,),
                                   name="ckpt-part-scan", daemon=True)
        scanner.start()

    def stop(self) -> None:
        """Stop listening; a promotion under way finishes (a kill mid-copy is a crash reconcile
        finishes), the queued ones are dropped (their events are replayed, or reconcile finds
        their parts)."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._runs.shutdown(wait=False, cancel_futures=True)

    # --- the subscription ------------------------------------------------------------------
    async def _listen(self) -> None:
        from prefect.events.clients import get_events_subscriber

        while not self._stopping.is_set():
            try:
                async with get_events_subscriber(filter=completed_filter(self.node)) as subscriber:
                    log.info("listening for the completed events of %s's parts", self.node)
                    async for event in subscriber:
                        self.submit(event.payload)
            except Exception as exc:  # noqa: BLE001 - reconcile covers the gap
                log.warning("event subscription lost (%s: %s); parts committed meanwhile are promoted by the "
                            "Tier 0 scan until it is back", type(exc).__name__, exc)
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    # --- the scan of Tier 0: events the stream did not deliver -------------------------------
    def _scan_forever(self) -> None:
        while not self._stopping.wait(self.settings.part_scan_seconds):
            try:
                self.scan()
            except Exception as exc:  # noqa: BLE001 - the next scan, or reconcile
                log.warning("scan of Tier 0 failed: %s: %s", type(exc).__name__, exc)

    def scan(self) -> list[tuple[str, int, int, str]]:
        """List the committed parts on this node's Tier 0 (names only: no catalog, no server) and
        submit those that no event brought, once two scans in a row found them (the job commits a
        part a moment before it announces it: the event is the fast way in). The event stream is
        best effort: in a 64-node burst on PostgreSQL + Redis, 18 of 64 completed events, all
        stored by the server, never reached their agents' subscriptions, which were alive and
        took the next event at once. The first scan marks what is there as known: parts committed
        while the agent was away are reconcile's. Returns the parts it submitted."""
        from core.errors import TierUnavailable  # deferred: start-up — storage backends
        from core.storage.identity import read_marker  # deferred: start-up — storage backends
        from core.storage.registry import open_store  # deferred: start-up — storage backends
        from core.transfer import find_committed  # deferred: start-up — the transfer engine

        # names only, in this process: what a scan submits, its promotion proves (the catalog's
        # record of the tier's identity, in the child). A root without a Tier 0 marker (not
        # mounted: an empty folder) is unavailable, not empty: what the scans knew is kept.
        with open_store(self.settings.tier0_url, 0, self.settings) as tier0:
            marker = read_marker(tier0)
            if marker is None or marker.tier != 0:
                raise TierUnavailable(0, tier0.root_url, "its root shows no Tier 0 identity marker (not mounted?)")
            found = {(run, step, part, attempt): parts
                     for run, step, part, parts, attempt in find_committed(tier0)}
        first, self._scans = self._scans == 0, self._scans + 1
        with self._lock:
            self._known &= found.keys()  # what left Tier 0 is forgotten: the set stays the size of the tier
            if first:
                self._known |= found.keys()
            new = [key for key in found if key not in self._known]
            due = [key for key in new if key in self._pending]
            self._pending = {key for key in new if key not in self._pending}
        for run, step, part, attempt in due:
            log.warning("%s step %s part %s: committed, no event came; promoting it", run, step, part)
            self.submit({"run": run, "step": step, "part": part, "parts": found[(run, step, part, attempt)],
                         "attempt": attempt})
        return due

    def submit(self, payload: Mapping[str, Any]) -> Future:
        """Queue the promotion of the part ``payload`` (a completed event's) names."""
        with suppress(Exception), self._lock:  # a malformed payload is promote's to reject
            self._known.add((str(payload["run"]), parse_number(payload["step"]),
                             parse_number(payload.get("part", 0), "part"), str(payload.get("attempt") or "")))
        ctx = contextvars.copy_context()
        future = self._executor.submit(ctx.run, self.promote, dict(payload))
        self.done = [*self.done[-63:], future]
        return future

    # --- one part ------------------------------------------------------------------------
    def promote(self, payload: dict[str, Any]) -> Any:
        """Promote one part: in a child process (its exit code: 0 promoted, 1 refused or failed,
        logged there, ``FOLLOWUPS`` promoted and its checkpoint's run to start), else here (the
        ``PromoteResult``, None when it failed)."""
        if not self.fork:
            from tasks.prefect_events import emit  # deferred: start-up — Prefect

            return promote_part(self.settings, payload, self.announcer or emit, self.request_followups)
        code, _ = run_child(run_part_process, (self.settings, payload, self._context),
                            stall_s=self.settings.copy_stall_seconds, what=f"promotion of {what(payload)}")
        if code == FOLLOWUPS:
            self.request_followups(str(payload["run"]), parse_number(payload["step"]),
                                   parse_number(payload.get("part", 0), "part"),
                                   parse_number(payload.get("parts") or 1, "parts"), str(payload.get("attempt") or ""))
        return code

    def request_followups(self, run: str, step: int, part: int, parts: int, attempt: str = "") -> None:
        """Start the checkpoint's promote run (``start_checkpoint_run``) beside the parts' queue:
        in a child of its own, or here (``fork=False``)."""
        if not self.fork:
            start_checkpoint_run(self.node, run, step, part, parts, attempt)
            return
        self._runs.submit(contextvars.copy_context().run, self._checkpoint_run, run, step, part, parts, attempt)

    def _checkpoint_run(self, run: str, step: int, part: int, parts: int, attempt: str) -> int | None:
        """The checkpoint's run in a child, watched; a child that ended before its run did
        (killed, out of memory) leaves the run ``Crashed`` (``crash_checkpoint_run``)."""
        params = {"run": run, "step": step, "part": part, "parts": parts, "attempt": attempt}
        code, _ = run_child(run_checkpoint_process, (self.settings, params, self._context),
                            stall_s=self.settings.copy_stall_seconds, what=f"promote run of {run!r} step {step}")
        if code is not None and code not in (0, 1):  # None: left behind, not ended (logged by run_child)
            crash_checkpoint_run(self.node, run, step, attempt, f"its process exited with code {code} before the "
                                 "run finished (killed when it stalled, or out of memory); reconcile finishes it")
        return code


@contextmanager
def part_events(settings: Settings) -> Iterator[PartEvents]:
    """The agent's promotions of its node's parts for the duration of the block (around ``serve``)."""
    listener = PartEvents(settings)
    listener.start()
    try:
        yield listener
    finally:
        listener.stop()
