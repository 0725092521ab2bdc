"""The promote fast path: a scheduled promote run starts at once, in a process that is already
warm, instead of at the runner's next poll in a freshly spawned interpreter.

Where the time went (``benchmarks/event_latency.py --path trigger``): the deployment trigger
creates the run 0.1-0.4 s after the event, then the served runner finds it at its next poll
(``PREFECT_RUNNER_POLL_FREQUENCY``) and spawns a Python process that imports Prefect and the
pipeline before the flow body starts: seconds, most of the total. The agent therefore

1. subscribes (Prefect's events websocket, ``get_events_subscriber``) to the
   ``prefect.flow-run.Scheduled`` events of its node's promote deployment: the run that the
   deployment trigger (or ``ckpt promote``) has just created;
2. runs each promote run in a *warm* process: forked from a fork server the agent forked from
   itself once Prefect and the flow were imported (``start_fork_server``), so the imported pages
   are shared copy-on-write instead of each interpreter importing its own copy (spawned where
   that cannot be). The process is forked when the run comes (~0.07 s to ready: the fork and
   the catalog's first connection) or, with ``spare`` (``CKPT_WARM_SPARE``), ahead of it and
   kept waiting, at ~30 MB more per agent at rest;
3. on the event, claims the run by proposing ``Pending``, a transition Prefect grants once
   (``PreventPendingTransitions``): the runner, which polls the same deployment, and this path
   never both start a run. The warm process runs it with Prefect's own engine (``run_flow``:
   states, task runs, logs and artifacts as in any served run) and exits. Nothing waits for a
   spare: a run that comes while the spare is still warming up (the second run of a burst) goes
   at once to a process forked for it, which runs it as soon as it is warm;
4. supervises it: a process that exits before its run is final (killed, out of memory) leaves
   the run ``Crashed``, as Prefect's runner does for the processes it starts; a run cancelled
   from the UI has its process stopped and ends ``Cancelled``; a run that moved no byte for
   ``copy_stall_seconds`` (its storage stopped answering) has its process killed
   (``watch_stall``, whichever path started it) and ends ``Crashed`` with that reason.

Nothing here creates flow runs: the deployment trigger stays the one source of runs, so a
duplicate event is still one run and the UI shows the same runs as before. The runner stays the
fallback: a run this path does not take (the subscription down, a run scheduled for later)
starts at the runner's next poll, as without it, and a run it claimed but could not start (no
process could be forked, the agent stopping) is handed back, ``Scheduled`` and due, to that poll;
whichever proposes ``Pending`` first starts it.

The warm process runs without Prefect's flow-run heartbeats. Its liveness is watched by the
agent that spawned it (4.), whereas a self-hosted Prefect server acts on heartbeats only through
a "zombie" automation, which this stack does not create; and the sync engine joins the heartbeat
thread, which sleeps in 1 s steps, at the end of every run: up to a second per promotion. With
``CKPT_PREFECT_REUSE`` (on) it also leaves out Prefect's per-run round trips that a promote run
never needs (``run_settings``, ``csrf_off_env``, ``lean_promote_flow``, ``skip_suspension_watch``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any
from uuid import UUID

from core import progress
from core.errors import NotFound
from deployments import names
from deployments.tls import SharedVerifiedContexts, share_verified_contexts

log = logging.getLogger("ckpt.agent.fast_path")

SCHEDULED = "prefect.flow-run.Scheduled"
CANCELLING = "prefect.flow-run.Cancelling"
READY = "ready"
DUE_WITHIN = timedelta(seconds=1)  # a run scheduled later than this (on purpose) is the runner's
RESUBSCRIBE_SECONDS = 5.0
STALL_POLL_S = 5.0  # how often a watched process's beat is looked at (``watch_stall``)
KILL_WAIT_S = 10.0  # how long a stalled process is given to end once killed


def watch_stall(process: Any, beat: Any, stall_s: float, what: str, *,
                clock: Callable[[], float] = time.monotonic, kill_wait_s: float = KILL_WAIT_S,
                on_stall: Callable[[str], object] | None = None) -> str | None:
    """Wait until ``process`` (a ``multiprocessing`` process: only its sentinel is waited on, so
    whoever else joins it still gets its exit code) ends. Once its ``beat`` (``core.progress.share``:
    when it last moved a byte) is older than ``stall_s`` it is stalled on a storage that stopped
    answering, and killed: nothing queues behind it for ever, and its claims, no longer renewed,
    lapse for reconcile. A process the kill cannot end within ``kill_wait_s`` (stuck inside the
    kernel on a hung mount) is left behind, logged. Returns why it was killed, or None;
    ``on_stall(why)`` hears it before the kill (whoever joins the process then knows why)."""
    from multiprocessing.connection import wait

    while not wait([process.sentinel], min(STALL_POLL_S, stall_s / 4)):
        idle = clock() - beat.value
        if idle > stall_s:
            break
    else:
        return None
    why = f"stalled, no byte moved for {idle:.0f} s (copy_stall_seconds {stall_s:g}): its storage does not answer"
    log.error("%s: %s; stopping its process (pid %s); reconcile tries the part again", what, why, process.pid)
    if on_stall is not None:
        on_stall(why)
    process.kill()
    if not wait([process.sentinel], kill_wait_s):
        log.error("%s: its process (pid %s) did not end (stuck in the kernel on the hung storage); left behind, "
                  "the next run goes on", what, process.pid)
    return why


def claim_message(node: str) -> str:
    """The message of the ``Pending`` state by which the fast path takes a run (UI, tests)."""
    return f"started at once by the fast path of the agent on {node}"


# What a warm process imports (run_warm, warm_up): the agent imports them too before it forks the
# server its warm processes are forked from, so one copy of these pages serves all three.
WARM_IMPORTS = ("prefect.client.schemas.objects", "prefect.context", "prefect.flow_engine", "prefect.settings",
                "flows.common", "flows.promote", "fastapi.encoders", "tasks.hop", "tasks.prune", "tasks.record",
                "tasks.register", "tasks.retention", "tasks.verify")
_fork_server: dict[str, int] = {}


def start_fork_server(*, prebuild: bool = True) -> bool:
    """Start multiprocessing's fork server as a fork of this process (not a fresh interpreter),
    after importing what a warm process needs: each warm process is then forked from it and
    shares those pages copy-on-write with the agent and the server, instead of importing
    Prefect, SQLAlchemy and the flow again (~120 MB each). Only a process with one thread may
    fork (a lock held by another thread would stay held in the child forever): with more, or
    when multiprocessing's fork server is already running, nothing is started and False says
    the warm processes are spawned as before. Call it before anything starts a thread.
    ``prebuild``: build before the fork what each warm process would build after it (``_prebuild``)."""
    import gc
    import importlib
    from multiprocessing import connection, forkserver, resource_tracker

    server: Any = forkserver._forkserver  # a private singleton: typeshed does not declare it
    if threading.active_count() > 1 or server._forkserver_pid is not None:
        return False
    for module in WARM_IMPORTS:
        importlib.import_module(module)
    from db.catalog import preload  # deferred: start-up — SQLAlchemy, Alembic

    preload()  # no connection is opened before the fork: each process opens its own
    if prebuild:
        _prebuild()  # what every warm process would otherwise build again after the fork
    _tracker_sink(resource_tracker)
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server exits when the agent (the write end) is gone
        gc.freeze()  # no collector (ours, the children's) writes to the shared objects' pages again
        pid = os.fork()
        if pid == 0:  # the server: serves fork requests until the agent exits, never returns
            code = 0
            try:
                os.close(alive_w)
                _fresh_signal_handlers()  # the warm processes handle signals as spawned ones did
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:
                pass
            except BaseException:  # reported; the server is gone and ensure_running starts a spawned one
                code = 1
                log.exception("fast path: fork server failed")
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    _fork_server["pid"] = pid
    log.info("fast path: warm processes fork from pid %s", pid)
    return True


def _tracker_sink(resource_tracker: Any) -> None:
    """multiprocessing's resource tracker, which each fork request hands to the new process, is
    a fresh interpreter of its own (~7 MB PSS per agent) that unlinks the named semaphores and
    shared memory blocks a process leaked. The agent's processes create none (they use
    ``Pipe`` and ``Process`` only: no ``Lock``, ``Queue`` or ``shared_memory``), so its requests
    go to ``/dev/null`` instead of a process that would never have anything to do. Set before
    anything starts the tracker; one already running is kept."""
    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        if tracker._fd is None:
            tracker._fd = os.open(os.devnull, os.O_WRONLY)  # _check_alive's probe succeeds: "running"


# Prefect's settings of a promote run, built by the agent before the fork for the environment it
# had then (run_warm uses them when its environment is still that one, else builds its own).
_prebuilt: dict[str, Any] = {}


def run_settings(*, lean: bool = True) -> Any:
    """Prefect's settings as a promote run in a warm process uses them: read from this
    environment (and Prefect's profile and files), heartbeats off (the fast path supervises the
    process itself) and, ``lean`` (``CKPT_PREFECT_REUSE``), no check of the server's API version
    per client (two round trips per run: the agent checked it as it registered its deployments,
    and the warm process talks to the same server). ~35 ms of CPU to build: a fork of the fork
    server reuses the agent's when its Prefect environment (``PREFECT_*``, all Prefect's settings
    read from it) says nothing else: every variable the same as at the fork, or added since with
    the value those settings already hold (Prefect sets a few of its own in the agent after the fork)."""
    from prefect.settings import (
        PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        Settings,
    )

    if lean and "settings" in _prebuilt:
        at_fork, held = _prebuilt["env"], _prebuilt["held"]
        now = {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")}
        if at_fork.keys() <= now.keys() and all(at_fork.get(k, held.get(k)) == v for k, v in now.items()):
            return _prebuilt["settings"]
    updates: dict[Any, Any] = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    if lean:
        updates[PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED] = False
    return Settings().copy_with_update(updates=updates)


def csrf_off_env(api_url: str | None) -> dict[str, str]:
    """``PREFECT_CLIENT_CSRF_SUPPORT_ENABLED=false`` when the Prefect server at ``api_url`` says
    its CSRF protection is off (Prefect's default), else nothing. Each Prefect client otherwise
    asks the server for a token once, is told CSRF is off and stops asking: two round trips per
    promote run (its API client and its log client), asked here once by the agent instead. A
    server with CSRF protection on, or one that cannot be asked now, keeps Prefect's default."""
    if not api_url:
        return {}
    import httpx

    from tasks.prefect_events import auth_headers  # deferred: start-up — the agent asks once, at start

    try:
        r = httpx.get(f"{api_url.rstrip('/')}/csrf-token", params={"client": f"ckpt-agent-{os.getpid()}"},
                      headers=auth_headers(), timeout=10)
    except httpx.HTTPError:
        return {}
    if r.status_code == 422 and "CSRF protection is disabled" in r.text:
        return {"PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false"}
    return {}


@lru_cache(maxsize=1)
def lean_promote_flow() -> Any:
    """The promote flow as a warm process runs it with ``CKPT_PREFECT_REUSE``: results not
    persisted (a promotion's outcome is in the catalog; its summary is the run's return value
    and artifact, and no task of it persists one) and a result storage named, so that the engine
    does not ask the server for its default result storage at each run (``persist_result=False``
    alone still asks). The storage is Prefect's local result folder, never written."""
    from pathlib import Path

    from prefect.settings import get_current_settings

    from flows.promote import promote_checkpoint  # deferred: start-up — Prefect, SQLAlchemy

    return promote_checkpoint.with_options(persist_result=False,
                                           result_storage=Path(get_current_settings().results.local_storage_path))


@contextmanager
def _not_observed(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield


def skip_suspension_watch() -> bool:
    """Prefect's engine watches each deployment's flow run for a ``Suspended`` state set from
    outside: a thread, a client and an events websocket opened before the run starts (and waited
    for) and closed after it. A promote run never suspends or waits for input, and a run the
    agent supervises is stopped through ``Cancelling`` (``FastPath._cancel``), so a warm process
    runs without that watch: ~0.1 s less from claim to Running. True when Prefect's engine still
    has the hook replaced here (tests/unit/test_fast_path_lean.py fails when it no longer does)."""
    import prefect.flow_engine as engine

    if not hasattr(engine, "observe_flow_run_suspension"):
        return False
    engine.observe_flow_run_suspension = _not_observed
    return True


def _prebuild() -> None:
    """Build before the fork what each warm process would build again after it, once per
    promotion: the run's Prefect settings (``run_settings``), the Prefect models its clients
    validate on first use (pydantic builds a deferred model's validator at its first use: ~5 ms
    to tens of ms each) and the shared verified TLS context (deployments/tls.py) for the CA
    file Prefect's clients use. Anything that fails here is simply built later, as before."""
    import importlib
    import sys

    import pydantic

    try:
        lean_promote_flow()
        settings = run_settings()
        _prebuilt.update(env={k: v for k, v in os.environ.items() if k.startswith("PREFECT_")},
                         held=settings.to_environment_variables(exclude_unset=False), settings=settings)
    except Exception as exc:  # noqa: BLE001 - see above
        log.debug("fast path: Prefect's settings not prebuilt: %s: %s", type(exc).__name__, exc)
    prefixes = ("prefect.client.schemas", "prefect.events.schemas", "prefect.artifacts")
    for name in [m for m in sys.modules if m.startswith(prefixes)]:
        for model in vars(sys.modules[name]).values():
            if (isinstance(model, type) and issubclass(model, pydantic.BaseModel)
                    and not getattr(model, "__pydantic_complete__", True)):
                with suppress(Exception):
                    model.model_rebuild(raise_errors=False)
    orchestration = importlib.import_module("prefect.client.orchestration")
    if isinstance(orchestration.ssl, SharedVerifiedContexts):
        from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

        if not PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():
            import certifi

            with suppress(OSError, ValueError):
                orchestration.ssl.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())


def _fresh_signal_handlers() -> None:
    """The handlers of a fresh interpreter: whatever the agent installed before it forked (its
    command line's handlers) must not run in the fork server or in a flow process."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def process_context() -> Any:
    """Forks of the agent's fork server when it runs (``start_fork_server``), else spawned."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # a private singleton: typeshed does not declare it
    running = _fork_server.get("pid") is not None and server._forkserver_pid == _fork_server["pid"]
    return multiprocessing.get_context("forkserver" if running else "spawn")


def run_warm(conn: Any, env: dict[str, str], beat: Any = None) -> None:
    """The warm process: import what a promote run needs and build Prefect's settings, say
    ready, run the one flow run it is then given (a ``FlowRun`` as JSON over ``conn``; None: stop), exit.
    Prefect's engine records every outcome of the flow itself; the process dying is the
    supervisor's to record. ``beat``: where the run tells the agent it moves bytes (``watch_stall``)."""
    os.environ.update(env)
    from prefect.client.schemas.objects import FlowRun
    from prefect.context import SettingsContext, get_settings_context
    from prefect.flow_engine import run_flow

    from flows.common import step_tasks  # deferred: start-up — Prefect, SQLAlchemy
    from flows.promote import promote_checkpoint  # deferred: start-up — Prefect, SQLAlchemy

    step_tasks()  # the task modules (flows.common imports them) and their registry: built now, not during the run
    lean = warm_up()
    flow = promote_checkpoint
    if lean:  # CKPT_PREFECT_REUSE: what a promote run never uses, not done per run (run_settings, lean_promote_flow)
        flow = lean_promote_flow()
        skip_suspension_watch()
    with SettingsContext(profile=get_settings_context().profile, settings=run_settings(lean=lean)):
        with suppress(OSError):  # a run handed over at once (start_now) closed the other end already
            conn.send(READY)
        flow_run = conn.recv()
        if flow_run is not None:
            if beat is not None:
                progress.share(beat)
            run_flow(flow, flow_run=FlowRun.model_validate(flow_run), return_type="state")


def warm_up() -> bool:
    """First-use costs paid before the run instead of during it: Prefect's parameter encoder
    (FastAPI's, imported on first use), the catalog's schema check (Alembic reads its scripts)
    and SQLAlchemy's first compilations. A failure here is the run's to report, not ours.
    Returns ``Settings.prefect_reuse`` (True when the settings cannot be read: the default)."""
    import fastapi.encoders  # noqa: F401

    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from db.catalog import Catalog  # deferred: start-up — SQLAlchemy, Alembic

    reuse = True
    try:
        settings = load_settings()
        reuse = settings.prefect_reuse
        if reuse:
            share_verified_contexts()  # a warm process forked from the agent has it already; a spawned one not yet
        with Catalog(settings.catalog_url) as cat, suppress(NotFound):
            cat.get_checkpoint("warm-up", 0)
    except Exception as exc:  # noqa: BLE001 - see above
        log.debug("warm-up: %s: %s", type(exc).__name__, exc)
    return reuse


class WarmProcess:
    """One spawned process (``run_warm``) waiting for one promote run."""

    def __init__(self, ctx: Any, env: dict[str, str]) -> None:
        self.conn, child = ctx.Pipe()
        self.beat = ctx.Value("d", 0.0, lock=False)  # when its run last moved a byte (``watch_stall``)
        self.stalled: str | None = None  # why it was killed, once its run stalled
        self.process = ctx.Process(target=run_warm, args=(child, env, self.beat), name="ckpt-promote-warm",
                                   daemon=True)
        self.process.start()
        child.close()
        self._ready = False

    def ready(self) -> bool:
        """Imports done and still alive (never blocks)."""
        try:
            if not self._ready and self.conn.poll():
                self._ready = self.conn.recv() == READY
        except (EOFError, OSError):
            return False
        return self._ready and self.process.is_alive()

    def run(self, flow_run: Any, stall_s: float | None = None) -> None:
        """Hand ``flow_run`` over; with ``stall_s``, a thread kills the process once the run moved
        no byte for that long (``watch_stall``: a hung storage), whoever supervises it."""
        self.beat.value = time.monotonic()  # counted from now: the run shares its beats once it starts
        self.conn.send(flow_run.model_dump(mode="json"))
        if stall_s:
            _in_context(self._watch, stall_s, f"promote run {getattr(flow_run, 'name', flow_run.id)}",
                        name=f"ckpt-stall-{self.process.pid}")

    def _watch(self, stall_s: float, what: str) -> None:
        watch_stall(self.process, self.beat, stall_s, what, on_stall=self._stalled)

    def _stalled(self, why: str) -> None:
        self.stalled = why

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.is_alive():
            with suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        self.conn.close()


def _in_context(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """A daemon thread that sees this thread's context (Prefect's settings live in a contextvar:
    a bare thread would fall back to the settings read at import time)."""
    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(target, *args), name=name, daemon=True)
    thread.start()
    return thread


class LoopThread:
    """``main()``, a coroutine, on an event loop of its own on a daemon thread that sees the
    starting thread's context (``_in_context``); ``stop`` cancels it and waits for the thread.
    The agent's event subscriptions run this way (the fast path's, deployments/part_events.py's)."""

    def __init__(self, main: Callable[[], Any], *, name: str) -> None:
        self._main_fn, self.name = main, name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = _in_context(self._run, name=self.name)

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


class FastPath:
    """The subscription, the warm processes and the supervision of the runs they run."""

    def __init__(self, node: str, *, spare: bool = False, stall_s: float | None = None) -> None:
        from prefect.settings import get_current_settings

        self.node = node
        self.spare = spare  # keep a warm process forked ahead of the next run (Settings.warm_spare)
        self.stall_s = stall_s  # a run that moved no byte this long is killed (Settings.copy_stall_seconds)
        self._ctx = process_context()
        self._env = {**get_current_settings().to_environment_variables(exclude_unset=True), **os.environ}
        self._lock = threading.Lock()
        self._spare: WarmProcess | None = None
        self._running: dict[UUID, WarmProcess] = {}
        self._claimed: set[UUID] = set()  # claimed (Pending), waiting for the warm process
        self._stopping = threading.Event()
        self._listener = LoopThread(self._listen, name="ckpt-fast-path")
        self._offers: set[asyncio.Task] = set()

    def start(self) -> None:
        self._refill()
        self._listener.start()
        _active[:] = [self]

    def start_now(self, flow_run: Any) -> Any:
        """Start ``flow_run``, already claimed by the runner's poll, without waiting: in the spare
        warm process when one is ready, else in a process forked now from the fork server, which runs
        it once it has warmed up (``run_warm``). Returns the process; the runner supervises it."""
        warm = self._take_spare()
        if warm is None:
            warm = WarmProcess(self._ctx, self._env)
        self._refill()
        try:
            warm.run(flow_run, self.stall_s)
        finally:
            warm.conn.close()  # the run is in the pipe; the runner watches the process itself
        return warm.process

    def stop(self) -> None:
        """Stop listening; a run still in a warm process is stopped and left ``Crashed``
        (reconcile finishes its checkpoint), as the runner stops its own on the way out."""
        self._stopping.set()
        if _active and _active[0] is self:
            _active.clear()
        self._listener.stop()
        with self._lock:
            spare, self._spare = self._spare, None
            running = dict(self._running)
            claimed, self._claimed = set(self._claimed), set()
        if spare is not None:
            spare.stop()
        for flow_run_id in claimed:
            self._give_back(flow_run_id)
        for flow_run_id, warm in running.items():
            warm.process.terminate()
            warm.process.join(10)
            self._finish(flow_run_id, f"the agent on {self.node} stopped before the run finished")

    # --- the subscription ------------------------------------------------------------------
    async def _listen(self) -> None:
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            deployment_id = await self._deployment_id(client)
            while not self._stopping.is_set():
                try:
                    await self._subscribe(client, deployment_id)
                except Exception as exc:  # noqa: BLE001 - the runner's poll covers the gap
                    log.warning("fast path: event subscription lost (%s: %s); runs start at the runner's poll "
                                "until it is back", type(exc).__name__, exc)
                await asyncio.sleep(RESUBSCRIBE_SECONDS)

    async def _deployment_id(self, client: Any) -> UUID:
        """The node's promote deployment (``serve`` registers it as the agent starts)."""
        from prefect.exceptions import ObjectNotFound

        while True:
            try:
                return (await client.read_deployment_by_name(names.promote_deployment(self.node))).id
            except ObjectNotFound:
                await asyncio.sleep(0.5)

    async def _subscribe(self, client: Any, deployment_id: UUID) -> None:
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter

        # any_resource, not related: the server applies a related-resource filter to stored
        # events only, and would stream every deployment's runs to this subscription
        wanted = EventFilter(event=EventNameFilter(name=[SCHEDULED, CANCELLING]),
                             any_resource=EventAnyResourceFilter(id=[f"prefect.deployment.{deployment_id}"]))
        async with get_events_subscriber(filter=wanted) as subscriber:
            log.info("fast path: listening for promote runs of %s", names.promote_deployment(self.node))
            async for event in subscriber:
                flow_run_id = UUID(event.resource.id.removeprefix("prefect.flow-run."))
                if event.event == SCHEDULED:
                    offer = asyncio.create_task(self._offer_safely(client, flow_run_id, deployment_id))
                    self._offers.add(offer)  # a reference until done (asyncio keeps weak ones)
                    offer.add_done_callback(self._offers.discard)
                else:
                    self._cancel(flow_run_id)

    async def _offer_safely(self, client: Any, flow_run_id: UUID, deployment_id: UUID) -> None:
        try:
            await self._offer(client, flow_run_id, deployment_id)
        except Exception as exc:  # noqa: BLE001 - one run's trouble must not end the subscription
            log.warning("fast path: flow run %s left to the runner: %s: %s", flow_run_id, type(exc).__name__, exc)
            try:
                await self._hand_back(client, flow_run_id, f"{type(exc).__name__}: {exc}")
            except Exception as again:  # noqa: BLE001 - the agent's stop hands back what is still claimed
                log.warning("fast path: flow run %s not handed back: %s: %s", flow_run_id, type(again).__name__, again)

    # --- claiming and starting a run ------------------------------------------------------
    async def _offer(self, client: Any, flow_run_id: UUID, deployment_id: UUID) -> None:
        """Claim ``flow_run_id`` at once if it is a run of this node's promote deployment, still
        scheduled and due, and start it at once: in the spare warm process when one is ready, else in
        a process forked now from the fork server, which runs it as soon as it has warmed up.

        Neither the claim nor the start waits for the warm process. A run that waited for it,
        still ``Scheduled``, while it was forked again after the previous run took it (seconds
        when many agents share the cores) went to the runner's next poll; runs that waited for
        it one after another, claimed, were started one warm-up apart. A run claimed but not
        started (no process could be started, the agent stopping) goes back to ``Scheduled``,
        due, for the runner's poll."""
        from prefect.client.schemas.responses import SetStateStatus
        from prefect.states import Pending

        flow_run = await client.read_flow_run(flow_run_id)
        state = flow_run.state
        if flow_run.deployment_id != deployment_id or self._stopping.is_set():
            return  # another node's: its Tier 0 is not here
        if state is None or not state.is_scheduled():
            return  # the runner (or an earlier event) took it
        due = state.state_details.scheduled_time
        if due is not None and due > datetime.now(UTC) + DUE_WITHIN:
            return
        result = await client.set_flow_run_state(flow_run_id, Pending(message=claim_message(self.node)))
        if result.status != SetStateStatus.ACCEPT:
            return  # the runner was first: one run, one execution
        with self._lock:
            self._claimed.add(flow_run_id)
        warm = self._take_spare() or WarmProcess(self._ctx, self._env)
        with self._lock:
            claimed = flow_run_id in self._claimed
            self._claimed.discard(flow_run_id)
            if claimed:
                self._running[flow_run_id] = warm
        if not claimed:  # cancelled, or handed back by the agent's stop, meanwhile
            self._put_back(warm)
            return
        _in_context(self._supervise, flow_run_id, warm, name=f"ckpt-fast-path-{flow_run_id}")
        self._refill()
        try:
            warm.run(flow_run.model_copy(update={"state": result.state}), self.stall_s)  # as claimed: no read back
        except Exception:
            warm.process.terminate()  # claimed but never started: the supervisor records it Crashed
            raise
        await client.update_flow_run(flow_run_id, infrastructure_pid=f"{socket.gethostname()}:{warm.process.pid}")

    async def _hand_back(self, client: Any, flow_run_id: UUID, why: str) -> None:
        """A run this path claimed but did not start goes back to ``Scheduled``, due now: the
        runner's next poll starts it (once: whoever pops the claim hands it back)."""
        with self._lock:
            if flow_run_id not in self._claimed:
                return
            self._claimed.discard(flow_run_id)
        from prefect.states import Scheduled

        log.warning("fast path: flow run %s handed back to the runner: %s", flow_run_id, why)
        await client.set_flow_run_state(flow_run_id, Scheduled(scheduled_time=datetime.now(UTC),
                                                               message=f"handed back by the fast path: {why}"),
                                        force=True)

    def _take_spare(self) -> WarmProcess | None:
        """The spare warm process if it is ready (None: no spare, or still warming up)."""
        with self._lock:
            warm = self._spare
            if warm is not None and warm.ready():
                self._spare = None
                return warm
            dead = warm if warm is not None and not warm.process.is_alive() else None
            if dead is not None:
                self._spare = None
        if dead is not None:
            log.warning("fast path: the warm process exited (code %s); starting another", dead.process.exitcode)
            self._refill()
        return None

    def _put_back(self, warm: WarmProcess) -> None:
        extra: WarmProcess | None = warm
        with self._lock:
            if self._spare is None:
                self._spare, extra = warm, None
        if extra is not None:
            extra.stop()

    def _refill(self) -> None:
        with self._lock:
            if not self.spare or self._stopping.is_set():
                return
            if self._spare is not None and self._spare.process.is_alive():
                return
            self._spare = WarmProcess(self._ctx, self._env)

    # --- supervision ---------------------------------------------------------------------
    def _supervise(self, flow_run_id: UUID, warm: WarmProcess) -> None:
        warm.process.join()
        warm.conn.close()
        with self._lock:
            self._running.pop(flow_run_id, None)
        self._finish(flow_run_id, f"the flow process (pid {warm.process.pid}) exited with code "
                                  f"{warm.process.exitcode} before the run finished"
                                  + (f": killed, {warm.stalled}" if warm.stalled else ""))

    def _cancel(self, flow_run_id: UUID) -> None:
        """A run cancelled from the UI or the API: stop its process (``_finish`` records it)."""
        with self._lock:
            warm = self._running.get(flow_run_id)
            waiting = flow_run_id in self._claimed
            self._claimed.discard(flow_run_id)
        if waiting:  # claimed, not started: nothing to stop, the run ends Cancelled
            _in_context(self._finish, flow_run_id, "cancelled before it started", name=f"ckpt-fast-path-{flow_run_id}")
        if warm is not None:
            log.info("fast path: cancelling flow run %s", flow_run_id)
            warm.process.terminate()

    def _give_back(self, flow_run_id: UUID) -> None:
        """On the way out: a run claimed but not started goes back to ``Scheduled`` for the
        runner (of this agent when it starts again, or of another serving the deployment)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Scheduled

        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run_id, Scheduled(
                    scheduled_time=datetime.now(UTC), message=f"handed back: the agent on {self.node} stopped"),
                    force=True)
        except Exception as exc:  # noqa: BLE001 - reconcile still finishes the checkpoint
            log.warning("fast path: could not hand back flow run %s: %s: %s", flow_run_id, type(exc).__name__, exc)

    def _finish(self, flow_run_id: UUID, why: str) -> None:
        """After the process exited: a run not in a final state is ``Cancelled`` when a
        cancellation was asked for, else ``Crashed`` (its checkpoint is left to reconcile)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled, Crashed

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
                if state is not None and state.is_final():
                    return
                if state is not None and state.is_cancelling():
                    client.set_flow_run_state(flow_run_id, Cancelled(message="cancelled; its process was stopped"),
                                              force=True)
                    return
                client.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
                log.warning("fast path: flow run %s crashed: %s", flow_run_id, why)
        except Exception as exc:  # noqa: BLE001 - reconcile still finishes the checkpoint
            log.warning("fast path: could not record the end of flow run %s: %s: %s", flow_run_id,
                        type(exc).__name__, exc)


_active: list[FastPath] = []  # the agent's fast path while it listens (run_in_warm_process)


def run_in_warm_process(flow: Any, flow_run: Any = None, **kwargs: Any) -> Any:
    """What the agent's runner calls, in place of Prefect's ``run_flow_in_subprocess``, to start
    a run of a deployment it holds the flow object of (``serve_runner``): a promote run its poll
    took goes to the fast path's warm process (``FastPath.start_now``) instead of a freshly
    spawned interpreter that imports Prefect and the pipeline again (~1.8 CPU s: in a 64-node
    burst the poll, faster than the event stream under load, took most runs). Anything else,
    or with no fast path listening, is Prefect's own."""
    from prefect.flow_engine import run_flow_in_subprocess

    path = _active[0] if _active else None
    if path is None or flow_run is None or getattr(flow, "name", None) != names.PROMOTE_FLOW or kwargs.get(
            "parameters") or kwargs.get("wait_for") or kwargs.get("context"):
        return run_flow_in_subprocess(flow, flow_run=flow_run, **kwargs)
    try:
        process = path.start_now(flow_run)
    except Exception as exc:  # noqa: BLE001 - the fork server gone, say: the run still starts, as Prefect starts it
        log.warning("fast path: %s starts in a new interpreter: %s: %s", flow_run.name, type(exc).__name__, exc)
        return run_flow_in_subprocess(flow, flow_run=flow_run, **kwargs)
    log.info("fast path: %s, taken by the runner's poll, runs in pid %s", flow_run.name, process.pid)
    return process


@contextmanager
def fast_path(node: str, *, spare: bool = False, stall_s: float | None = None) -> Iterator[FastPath]:
    """The fast path of ``node``'s agent for the duration of the block (around ``serve``);
    ``spare``: a warm process kept forked ahead of the next run (``FastPath.spare``); ``stall_s``:
    a run that moved no byte for this long is killed (``watch_stall``)."""
    path = FastPath(node, spare=spare, stall_s=stall_s)
    path.start()
    try:
        yield path
    finally:
        path.stop()
