"""One flow run per checkpoint (``Settings.promote_runs`` = ``checkpoint``): the node's agent
promotes its parts itself, on their events, and only the part that completes a checkpoint starts
a promote flow run, which takes the checkpoint's follow-ups.

Why: a Prefect flow run costs ~0.45-0.5 CPU s of orchestration (the run record, its states,
events and logs, the engine around it: docs/design/burst.md, "What a flow run per part costs"),
so a checkpoint of N parts cost N of them, whatever the parts' own work. Here a part's
``ckpt.checkpoint.completed`` event reaches its node's agent over Prefect's event stream (the
same websocket the fast path listens on), and the agent runs the part's hop as plain functions
(``flows.promote.promote_in_agent``): the same steps, claims, catalog records, retry policy,
copy priority and announced events as a promote run, with no run around them. The part whose
hop records the checkpoint complete on Tier 1 (one per checkpoint) asks the server for one run
of its node's promote deployment with an idempotency key per checkpoint
(``flows.promote.followups_key``); that run finds the part on Tier 1, takes the follow-ups
(archive, ``ckpt.checkpoint.durable``, status page, retention) and is the checkpoint's run in
the UI. The promote deployment has no trigger in this mode: an event is never also a run.

What covers a gap, as for a promote run that never ran: Prefect's subscriber replays the last
minute of matching events when it (re)connects (duplicates are no-ops: a part already verified on
Tier 1 is skipped); an event missed for longer (the agent down) is found by the node's
reconcile pass, which promotes any committed part of its Tier 0 that is not on Tier 1 and runs
the follow-ups of any complete checkpoint whose follow-ups are not done.

The event stream is best effort (a run per part had the runner's poll behind it), so the agent
also lists its Tier 0 every ``Settings.part_scan_seconds`` (10) and promotes a committed part no
event brought, once two scans in a row found it (``PartEvents.scan``).

One promotion at a time per agent, in the order the events arrive, each in a process forked
from the agent's fork server (as the fast path's warm processes are), which exits when its part
is done, at the copy priority (``copy_nice``, ``copy_io_class``). A malformed event
is a rejection in the catalog and one line in the agent's log; a part that fails after its
retries is one line too (``ckpt.checkpoint.corrupt`` when its bytes were bad), and reconcile
tries it again; neither stops the next event. Nor does a part whose storage stopped answering:
its process tells the agent each time it moves bytes (``core.progress.share``), and one that
moved none for ``copy_stall_seconds`` is killed (``fast_path.watch_stall``); its claim, no longer renewed,
lapses and reconcile tries the part again.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

from core import events, progress
from core.errors import BadEvent
from core.events import Announcer, announcing
from core.layout import parse_number
from core.settings import Settings
from deployments import names
from deployments.fast_path import LoopThread, process_context, watch_stall

log = logging.getLogger("ckpt.agent.parts")

RESUBSCRIBE_SECONDS = 5.0
REQUEST_ATTEMPTS = 4  # asking for a checkpoint's run: 1 + 2 + 4 s between them, then reconcile's backlog


def completed_filter(node: str) -> Any:
    """The completed events of ``node``'s parts (the label the training job sets, ``ckpt.node``)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.schemas.events import ResourceSpecification

    return EventFilter(event=EventNameFilter(name=[events.COMPLETED]),
                       resource=EventResourceFilter(labels=ResourceSpecification({"ckpt.node": node})))


def forks_available() -> bool:
    """Whether the agent's fork server runs (``fast_path.start_fork_server``): then each part is
    promoted in a process forked from it, else in the agent's worker thread."""
    return process_context().get_start_method() == "forkserver"


class PartEvents:
    """The subscription to the node's completed events and the worker that promotes each part.

    Each part is promoted in a process forked from the agent's fork server, one at a time, which
    exits when the part is done: the agent's own memory stays what it was at rest (the same
    promotion run in the agent's thread left a node's agent at 172 MB instead of 146 after one
    checkpoint, ``benchmarks/burst.py --warm-bursts 1``: the catalog's connection and statements,
    the copy's buffers and every shared page the promotion touched stay the agent's). Without a
    fork server (``fork=False``, tests) the worker thread runs it itself."""

    def __init__(self, settings: Settings, *, announcer: Announcer | None = None, fork: bool | None = None) -> None:
        self.settings = settings
        self.node = settings.node
        self.announcer = announcer  # how the hops' facts are announced: Prefect events (``emit``) unless given
        self.fork = forks_available() if fork is None else fork
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-part")
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._listener: LoopThread | None = None
        self._env: dict[str, str] = {}
        self._known: set[tuple[str, int, int, str]] = set()  # parts submitted, or on Tier 0 when the agent started
        self._pending: set[tuple[str, int, int, str]] = set()  # found by the last scan, not submitted yet
        self._scans = 0
        self.done: list[Future] = []  # the last promotions' futures (tests; bounded)

    def start(self) -> None:
        from prefect.settings import get_current_settings

        # what a forked promotion must see: Prefect's settings in force here, over the environment
        self._env = {**get_current_settings().to_environment_variables(exclude_unset=True), **os.environ}
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
        from core.transfer import find_committed  # deferred: start-up — the transfer engine
        from tasks.base import open_tier  # deferred: start-up — storage backends

        with open_tier(self.settings, 0) as tier0:
            found = {(run, step, part, attempt): parts for run, step, part, parts, attempt in find_committed(tier0)}
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
        """Promote one part: in a forked process (its exit code: 0 promoted, 1 refused or
        failed, logged there), else here (the ``PromoteResult``, None when it failed)."""
        if not self.fork:
            from tasks.prefect_events import emit  # deferred: start-up — Prefect

            return promote_part(self.settings, payload, self.announcer or emit, self.request_followups)
        ctx = process_context()
        beat = ctx.Value("d", time.monotonic(), lock=False)  # when the part's process last moved a byte
        process = ctx.Process(target=run_part_process, args=(self.settings, payload, self._env, beat),
                              name="ckpt-part", daemon=True)
        process.start()
        stalled = watch_stall(process, beat, self.settings.copy_stall_seconds, f"promotion of {_what(payload)}")
        process.join(0 if stalled else None)  # ended (or killed): reaped; one the kill could not end is left behind
        code = process.exitcode
        if code not in (0, 1):  # killed, out of memory, stalled: nothing was logged there
            log.error("promotion of %s: its process (pid %s) exited with code %s (reconcile tries it again)",
                      _what(payload), process.pid, code)
        return code

    def request_followups(self, run: str, step: int, part: int, parts: int, attempt: str = "") -> None:
        request_followups(self.node, run, step, part, parts, attempt)


def _what(payload: Mapping[str, Any]) -> str:
    return f"{payload.get('run')!r} step {payload.get('step')!r} part {payload.get('part', 0)!r}"


def promote_part(settings: Settings, payload: Mapping[str, Any], announcer: Announcer,
                 request: Any) -> Any:
    """Promote one part (``promote_in_agent``); every failure is one line of the log, never
    raised: the next event must still be served. The ``PromoteResult``, or None."""
    from flows.promote import promote_in_agent  # deferred: start-up — Prefect, SQLAlchemy

    try:
        with announcing(announcer):
            result = promote_in_agent(settings, payload, request_followups=request)
    except BadEvent as exc:
        log.error("rejected event: %s", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - see above
        first = (str(exc).splitlines() or [""])[0]
        log.error("promotion of %s failed: %s: %s (reconcile tries it again)", _what(payload), type(exc).__name__,
                  first)
        return None
    log.info("promoted %s on %s in pid %d", _what(payload), settings.node, os.getpid())
    return result


def run_part_process(settings: Settings, payload: dict[str, Any], env: dict[str, str], beat: Any = None) -> None:
    """A part's promotion in a process forked from the agent's fork server: Prefect's settings
    as the agent's (``fast_path.run_settings``: the agent's own, built before the fork, when the
    environment still says the same), the part's events posted to the API in one request when it
    is done (``EventBatch``: a process that exits leaves nothing queued, as Prefect's websocket
    worker could), exit code 1 when it failed. ``beat``: where its byte movement is told to the
    agent (``fast_path.watch_stall``)."""
    if beat is not None:
        progress.share(beat)
    os.environ.update(env)
    from prefect.context import SettingsContext, get_settings_context

    from deployments.fast_path import run_settings  # deferred: start-up — Prefect
    from tasks.prefect_events import emit  # deferred: start-up — Prefect

    prefect_settings = run_settings()
    api = prefect_settings.api.url
    batch = EventBatch()
    with SettingsContext(profile=get_settings_context().profile, settings=prefect_settings):
        try:
            result = promote_part(settings, payload, batch if api else emit,
                                  functools.partial(request_followups, settings.node))
        finally:
            if api:
                batch.send(api)
    if result is None:
        sys.exit(1)


class EventBatch:
    """An announcer (``emit``'s signature) that keeps the part's events and sends them in one
    ``POST /events`` (``send``) when the part is done: a part's Tier 0 verify and its Tier 1 copy
    are one read, so its events come within moments of each other anyway, and one request is
    one request less for the server per part. ``send`` retries as ``emit`` does; events it
    cannot deliver are logged and left (the catalog holds the facts; reconcile acts on those)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, name: str, run: str, step: int, *, part: int = 0, parts: int = 1, node: str = "",
                 payload: dict[str, Any] | None = None, extra_id: str = "", labels: dict[str, Any] | None = None,
                 **_: Any) -> bool:
        self.events.append(events.build_event(name, run, step, part=part, parts=parts, node=node, payload=payload,
                                              extra_id=extra_id, labels=labels))
        return True

    def send(self, api_url: str, *, attempts: int = 3) -> bool:
        from tasks.prefect_events import auth_headers  # deferred: start-up — Prefect's profile

        for attempt in range(attempts if self.events else 0):
            try:
                events.post_events(api_url, self.events, headers=auth_headers())
                self.events = []
                return True
            except Exception as exc:  # noqa: BLE001 - see above
                if attempt + 1 == attempts:
                    log.warning("%d event(s) not delivered to %s: %s: %s", len(self.events), api_url,
                                type(exc).__name__, exc)
                    return False
                time.sleep(0.5 * 2 ** attempt)
        return not self.events


def request_followups(node: str, run: str, step: int, part: int, parts: int, attempt: str = "") -> None:
    """Ask for the checkpoint's one promote run on ``node``'s deployment (its fast path starts
    it at once); the same request again is the same run (``followups_key``). Retried; when the
    server cannot be reached, reconcile's follow-ups backlog runs them."""
    from prefect.client.orchestration import get_client

    from flows.promote import followups_key  # deferred: start-up — Prefect, SQLAlchemy

    params = {"run": run, "step": step, "part": part, "parts": parts, "node": node, "attempt": attempt}
    for tried in range(REQUEST_ATTEMPTS):
        try:
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name(names.promote_deployment(node))
                flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=params,
                                                                  idempotency_key=followups_key(run, step, attempt))
            log.info("checkpoint %s step %s complete on Tier 1: its promote run is %s", run, step, flow_run.id)
            return
        except Exception as exc:  # noqa: BLE001 - retried, then reconcile's follow-ups backlog
            if tried + 1 == REQUEST_ATTEMPTS:
                log.error("checkpoint %s step %s complete on Tier 1, its promote run not created (%s: %s): "
                          "reconcile runs its follow-ups", run, step, type(exc).__name__, exc)
                return
            time.sleep(2 ** tried)


@contextmanager
def part_events(settings: Settings) -> Iterator[PartEvents]:
    """The agent's promotions of its node's parts for the duration of the block (around ``serve``)."""
    listener = PartEvents(settings)
    listener.start()
    try:
        yield listener
    finally:
        listener.stop()
