"""The agent's child processes: one per part it promotes, one per checkpoint run it starts, one per
reconcile pass (deployments/reconcile_loop.py).

The only start-up tuning of the agent, on public interfaces alone: each child is forked from the
agent's zygote (``Zygote``), a process forked from the agent once it imported Prefect and the
pipeline (``PRELOAD``), set up its Tier 0 and Tier 1 (the catalog's driver and engine), built
its deployments and imported what serving imports (``preload_agent``), before its first thread;
never the S3 client, which the children that reach Tier 2 load themselves. A child then shares
those pages with the agent and the zygote and starts in milliseconds instead of importing them
again in a new interpreter, with the catalog's engine set up (``db.session``: a pool of its own); the
agent itself keeps its memory at rest (a promotion's catalog connection, buffers and touched
pages end with its process). A child is handed what it must see as arguments (the agent's
settings and Prefect's, ``ChildContext``): the zygote has the environment of the agent's start.

A child that moves no byte for ``copy_stall_seconds`` (its storage stopped answering) is killed
(``watch_stall``): nothing queues behind it for ever, and its claims, no longer renewed, lapse
for reconcile.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

from core import events, progress
from core.errors import BadEvent
from core.events import Announcer, announcing
from core.settings import Settings
from deployments import names

log = logging.getLogger("ckpt.agent.parts")

# What a child imports: the agent imports them once, before it forks the zygote.
PRELOAD = ["prefect.client.orchestration", "prefect.context", "prefect.flow_engine", "prefect.settings",
           "prefect.states", "flows.promote", "flows.reconcile", "tasks.prefect_events", "deployments.processes",
           "deployments.reconcile_loop"]
# What the agent imports once it serves, which a child never needs (``preload_agent``).
AGENT_PRELOAD = ["prefect.runner.server", "anyio.streams.memory", "anyio.streams.stapled", "anyio.streams.tls"]
M_ARENA_MAX = -8  # glibc's malloc.h
ONE_ARENA = 1
DEFAULT_ARENAS = 8 * (os.cpu_count() or 1)  # glibc's own limit on 64-bit: 8 per core
STALL_POLL_S = 5.0  # how often a watched process's beat is looked at (``watch_stall``)
KILL_WAIT_S = 10.0  # how long a stalled process is given to end once killed
REQUEST_ATTEMPTS = 4  # creating a checkpoint's run: 1 + 2 + 4 s between them, then reconcile's backlog
FOLLOWUPS = 3  # a part process's exit code: promoted, and its checkpoint's run is to be started


class Child:
    """A child the zygote forked (``Zygote.fork``), as the agent sees it: ``sentinel`` (a pidfd,
    readable once the child ended, for ``multiprocessing.connection.wait``), ``kill`` (by the
    pidfd: never another process that got its pid since), ``beat`` (``core.progress.share``:
    when it last moved a byte), and once it ended its exit code (``exitcode``: negative for a
    signal, as ``multiprocessing`` says it; None when the zygote could not tell) and the value
    its target returned (``result``; None when it returned none or it could not be read)."""

    def __init__(self, pid: int, pidfd: int, status: int, result: int, beat: Any, beat_map: mmap.mmap):
        self.pid, self.sentinel, self._status, self._result = pid, pidfd, status, result
        self.beat, self._beat_map = beat, beat_map
        self._code: int | None = None
        self._ended = False

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until it ended (True), at most ``timeout`` seconds; its exit code then read."""
        from multiprocessing.connection import wait

        if not self._ended and wait([self.sentinel], timeout):
            raw = _read_all(self._status)  # the zygote writes it once it reaped the child
            self._code = struct.unpack("!i", raw)[0] if len(raw) == 4 else None
            self._ended = True
        return self._ended

    @property
    def exitcode(self) -> int | None:
        return self._code

    def result(self) -> Any:
        if not self._ended:
            return None
        try:
            data = _read_all_at(self._result)
            return pickle.loads(data) if data else None
        except Exception:  # noqa: BLE001 - a child killed while it wrote it: no value
            return None

    def close(self) -> None:
        for fd in (self.sentinel, self._status, self._result):
            with suppress(OSError):
                os.close(fd)
        del self.beat  # the ctypes view holds the map's buffer
        self._beat_map.close()


class Zygote:
    """The agent's fork server: a process forked from the agent before its first thread
    (``start_fork_server``), once it imported what a child needs (``PRELOAD``), which forks each
    child (``fork``). A child then shares the agent's imported pages copy-on-write and starts in
    milliseconds; the agent stays small at rest (a promotion's connections, buffers and touched
    pages end with its process). Everything is on public interfaces: ``os.fork`` of the agent
    while it has one thread, ``multiprocessing``'s fork context in the zygote (one thread), a
    Unix socket that carries the descriptors (``socket.send_fds``), pidfds.

    A request is three descriptors: an anonymous file holding the target and its arguments,
    pickled; a shared page for the child's beat; an anonymous file its return value is written
    to (a file never blocks its writer, whatever the size). The zygote answers with the child's
    pid, a pidfd of it and a pipe on which it writes the exit code once it reaped the child. A
    request it cannot serve is answered with why, and the zygote serves the next. It ends when
    the agent does (its socket closes), stopping the children still running (SIGTERM), as the
    agent's own daemonic children were. One that died is started again from the agent at the
    next child, with a warning: the agent may have threads by then (the first start has none)."""

    _lock = threading.Lock()
    _running: Zygote | None = None
    _frozen = False  # gc.freeze() done once: a restart would freeze the agent's live objects for good

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.lock = threading.Lock()

    @classmethod
    def get(cls) -> Zygote:
        """The zygote of this process, started now if there is none (or it died)."""
        with cls._lock:
            z = cls._running
            if z is None or not z.alive():
                if z is not None:
                    log.warning("the agent's fork zygote (pid %s) is gone; starting another from the agent, "
                                "which runs %d threads", z.pid, threading.active_count())
                    z.sock.close()
                elif threading.active_count() > 1:
                    log.warning("the agent's fork zygote starts from a process that runs %d threads: %s",
                                threading.active_count(), ", ".join(t.name for t in threading.enumerate()))
                cls._running = z = cls._start()
            return z

    @classmethod
    def _start(cls) -> Zygote:
        for name in PRELOAD:
            importlib.import_module(name)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if not cls._frozen:
            gc.freeze()  # the objects imported so far are never written by a collection in the children
            cls._frozen = True
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote (its children's work is tested)
            code = 0
            try:
                ours.close()
                malloc_arenas(DEFAULT_ARENAS)  # not the agent's one (``malloc_arenas``)
                _zygote_serve(theirs)
            except BaseException:  # noqa: BLE001 - a zygote that fails says why and ends
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        return Zygote(ours, pid)

    @classmethod
    def stop(cls) -> None:
        """End this process's zygote, if it runs (its children are stopped with it); the next
        child starts another. For a process that used one and goes on without (a test)."""
        with cls._lock:
            z, cls._running = cls._running, None
        if z is not None:
            z.sock.close()
            with suppress(ChildProcessError):
                os.waitpid(z.pid, 0)

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def fork(self, target: Callable[..., Any], args: tuple[Any, ...]) -> Child:
        """``target(*args, beat)`` in a new child; its return value, if any, is ``Child.result()``
        once it ended."""
        payload = _anonymous_file("ckpt-request", pickle.dumps((target, args)))
        beat_fd = _anonymous_file("ckpt-beat", bytes(8))
        result_fd = _anonymous_file("ckpt-result", b"")
        try:
            beat_map = mmap.mmap(beat_fd, 8)
            beat = ctypes.c_double.from_buffer(beat_map)
            beat.value = time.monotonic()
            with self.lock:
                socket.send_fds(self.sock, [b"child"], [payload, beat_fd, result_fd])
                answer, fds, _, _ = socket.recv_fds(self.sock, 4096, 2)
            for fd in fds:
                os.set_inheritable(fd, False)
        except BaseException:
            os.close(result_fd)
            raise
        finally:
            os.close(payload)
            os.close(beat_fd)
        if len(fds) != 2:
            os.close(result_fd)
            for fd in fds:
                os.close(fd)
            raise OSError(f"the fork zygote did not start the child: {answer.decode(errors='replace') or 'it ended'}")
        return Child(int(answer), fds[0], fds[1], result_fd, beat, beat_map)


def _anonymous_file(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd


def _zygote_serve(sock: socket.socket) -> None:  # pragma: no cover - runs in the zygote
    """The zygote's loop: a child per request (``multiprocessing``'s fork context: this process
    has one thread, and a child ends as any ``multiprocessing`` process does, its threads joined
    and their exit hooks run, such as Prefect's log and event workers draining), and each ended
    child's exit code to its pipe. Nothing one request or one child does ends the loop."""
    import multiprocessing  # deferred: the zygote alone starts processes this way

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent's Ctrl-C ends the agent, whose socket ends this
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the agent's handler (a zygote started again inherits it)
    ctx = multiprocessing.get_context("fork")
    running: dict[int, tuple[Any, int]] = {}  # sentinel -> (the process, its status pipe's write end)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd != sock.fileno():
                process, status_w = running.pop(fd)
                poller.unregister(fd)
                process.join()
                with suppress(OSError):  # the agent gave up on it (left behind) and closed its end
                    os.write(status_w, struct.pack("!i", process.exitcode))
                os.close(status_w)
                process.close()
                continue
            try:
                _, fds, _, _ = socket.recv_fds(sock, 4096, 3)
            except OSError:
                fds = []
            if len(fds) != 3:
                for got in fds:
                    os.close(got)
                for process, _ in running.values():  # the agent ended: so do its children
                    with suppress(OSError):
                        process.terminate()
                return
            for got in fds:
                os.set_inheritable(got, False)
            _serve_one(sock, ctx, fds, running, poller)


def _serve_one(sock: socket.socket, ctx: Any, fds: list[int], running: dict[int, tuple[Any, int]],
               poller: Any) -> None:  # pragma: no cover - runs in the zygote
    """One request: its child started and answered, or why not answered."""
    payload, beat_fd, result_fd = fds
    process: Any = None
    status_r = status_w = -1
    try:
        target, args = pickle.loads(_read_all_at(payload))
        status_r, status_w = os.pipe()
        inherited = [sock.fileno(), status_r, status_w, *(w for _, w in running.values())]
        process = ctx.Process(target=_child_main, args=(target, args, beat_fd, result_fd, inherited),
                              name="ckpt-agent-child")
        process.start()
        pid = process.pid
        pidfd = os.pidfd_open(pid)
        try:
            socket.send_fds(sock, [str(pid).encode()], [pidfd, status_r])
        finally:
            os.close(pidfd)
        running[process.sentinel] = (process, status_w)
        poller.register(process.sentinel, select.POLLIN)
        status_w = -1
    except BaseException as exc:  # noqa: BLE001 - answered with why; the next request is served
        if process is not None and process.pid is not None:  # started, not handed over: not left running
            with suppress(OSError):
                process.kill()
            process.join()
        with suppress(OSError):
            sock.send(f"{type(exc).__name__}: {exc}".encode() or b"?")
    finally:
        for fd in (payload, beat_fd, result_fd, status_r, status_w):
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)


def _child_main(target: Callable[..., Any], args: tuple[Any, ...], beat_fd: int, result_fd: int,
                inherited: list[int]) -> None:  # pragma: no cover - runs in the child (its effects are tested)
    """A child: ``target(*args, beat)``, its value pickled to ``result_fd``; the zygote's own
    descriptors (``inherited``) closed first."""
    for fd in inherited:
        with suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    beat_map = mmap.mmap(beat_fd, 8)
    os.close(beat_fd)
    value = target(*args, ctypes.c_double.from_buffer(beat_map))
    if value is not None:
        view = memoryview(pickle.dumps(value))
        while view:
            view = view[os.write(result_fd, view):]
    os.close(result_fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_all_at(fd: int) -> bytes:
    """The whole of the file ``fd`` from its start, whatever its offset."""
    size, chunks, at = os.fstat(fd).st_size, [], 0
    while at < size and (chunk := os.pread(fd, min(1 << 20, size - at), at)):
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks)


def preload_agent() -> None:
    """Import, before the zygote is forked, what the agent imports once it serves: ``serve``'s
    runner imports its web server's module (FastAPI, uvicorn) even with the server off, and anyio
    its event-loop backend and streams on first use. Imported after the fork, their objects would
    fill the freed slots of pages the agent shares with the zygote, and each such page would be
    copied, one copy in each (docs/benchmarks.md: the agent's memory)."""
    import anyio

    for name in AGENT_PRELOAD:
        importlib.import_module(name)
    anyio.run(_nothing)  # its asyncio backend


async def _nothing() -> None:
    return None


def malloc_arenas(most: int) -> None:
    """At most ``most`` glibc malloc arenas for this process's threads from now on
    (``mallopt(M_ARENA_MAX, most)``). The agent keeps one once its zygote is forked
    (``ONE_ARENA``): each thread that allocates would otherwise get an arena of its own whose
    touched pages stay with it, and the agent's threads (the runner's loops, the event
    subscription, the scan, reconcile's schedule) mostly wait (docs/benchmarks.md: the agent's
    memory). A zygote sets glibc's default back (``DEFAULT_ARENAS``) as it starts, so its
    children's copy threads keep an arena each, a zygote started again from the agent too.
    Without glibc, nothing."""
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_ARENA_MAX, most)


def start_fork_server(settings: Settings | None = None) -> None:
    """Start the zygote now, before the agent's first thread runs (``Zygote``). With the
    agent's ``settings``, the steps a child runs are built first, under their retry policy
    (``flows.common.task_steps``: a Prefect task each, which reads its function's source to
    key it), so that no child builds them again."""
    if settings is not None:
        from flows.common import task_steps  # deferred: start-up — Prefect

        task_steps(settings)
    Zygote.get()


def watch_stall(process: Any, beat: Any, stall_s: float, what: str, *, again: str = "reconcile tries the part again",
                clock: Callable[[], float] = time.monotonic, kill_wait_s: float = KILL_WAIT_S) -> str | None:
    """Wait until ``process`` (a ``multiprocessing`` process: only its sentinel is waited on, so
    whoever else joins it still gets its exit code) ends. Once its ``beat`` (``core.progress.share``:
    when it last moved a byte) is older than ``stall_s`` it is stalled on a storage that stopped
    answering, and killed. A process the kill cannot end within ``kill_wait_s`` (stuck inside the
    kernel on a hung mount) is left behind, logged (``again``: what happens next, in the line).
    Returns why it was killed, or None."""
    from multiprocessing.connection import wait

    while not wait([process.sentinel], min(STALL_POLL_S, stall_s / 4)):
        idle = clock() - beat.value
        if idle > stall_s:
            break
    else:
        return None
    why = f"stalled, no byte moved for {idle:.0f} s (copy_stall_seconds {stall_s:g}): its storage does not answer"
    log.error("%s: %s; stopping its process (pid %s); %s", what, why, process.pid, again)
    process.kill()
    if not wait([process.sentinel], kill_wait_s):
        log.error("%s: its process (pid %s) did not end (stuck in the kernel on the hung storage); left behind, "
                  "the next one goes on", what, process.pid)
    return why


def run_child(target: Callable[..., Any], args: tuple[Any, ...], *, stall_s: float, what: str,
              again: str = "reconcile tries it again") -> tuple[int | None, Any]:
    """``target(*args, beat)`` in a child forked from the zygote, watched for stalls
    (``watch_stall``); its exit code and the value it returned (None when it returned none or
    did not end), after one line in the log when the code was not one of its own (killed, out
    of memory, stalled: nothing was logged there; ``again``: what happens next)."""
    child = Zygote.get().fork(target, args)
    try:
        stalled = watch_stall(child, child.beat, stall_s, what, again=again)
        child.join(0 if stalled else None)  # ended (or killed); one the kill could not end is left behind
        code = child.exitcode
        if code not in (0, 1, FOLLOWUPS) and not stalled:  # a stall: ``watch_stall`` said it
            log.error("%s: its process (pid %s) exited with code %s (%s)", what, child.pid, code, again)
        return code, child.result()
    finally:
        child.close()


class ChildContext:
    """What a child must see, built once in the agent (``child_context``) and handed to each child:
    the agent's environment (the zygote has the environment of the agent's start) and Prefect's
    settings in force in the agent, with no flow-run heartbeats: the agent watches its child
    itself (``run_child``), a self-hosted server acts on heartbeats only through a "zombie"
    automation this stack does not create, and the engine joins the heartbeat thread, which
    sleeps in 1 s steps, at the end of every run; and no check of the server's API version per
    client (two round trips per run: the agent checked it as it registered its deployments, and
    its children talk to the same server). The settings travel built (pickled): reading them
    again from the environment in every child, two validations of Prefect's whole settings
    tree, was most of a part's CPU outside its bytes."""

    def __init__(self, env: Mapping[str, str], prefect: Any) -> None:
        self.env, self.prefect = dict(env), prefect


def child_context() -> ChildContext:
    """The ``ChildContext`` of the agent's children, from the Prefect settings in force here."""
    from prefect.settings import (
        PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        get_current_settings,
    )

    current = get_current_settings()
    env = {**current.to_environment_variables(exclude_unset=True), **os.environ}
    prefect = current.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                                                PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False})
    return ChildContext(env, prefect)


def agent_logging(level: str) -> None:
    """The agent's own lines (the ``ckpt`` and ``core`` loggers) at ``level`` and above, one
    line each on stderr, through a handler of their own (Prefect's lines keep Prefect's level
    and format). The agent's child processes set it up again (``agent_context``): the fork
    zygote they are forked from may have been started before it was."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s",
                                           "%H:%M:%S"))  # as Prefect writes its own
    for name in ("ckpt", "core"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = [handler]
        logger.propagate = False  # not twice through the root logger's handler


@contextmanager
def agent_context(context: ChildContext, beat: Any, log_level: str) -> Iterator[None]:
    """A child's environment and Prefect settings: the agent's (``context``), in force for the
    block; its beat shared (``core.progress.share``) and the agent's log lines set up."""
    from prefect.context import SettingsContext, get_settings_context

    progress.share(beat)
    os.environ.update(context.env)
    agent_logging(log_level)
    with SettingsContext(profile=get_settings_context().profile, settings=context.prefect):
        yield


def what(payload: Mapping[str, Any]) -> str:
    return f"{payload.get('run')!r} step {payload.get('step')!r} part {payload.get('part', 0)!r}"


def promote_part(settings: Settings, payload: Mapping[str, Any], announcer: Announcer, request: Any) -> Any:
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
        log.error("promotion of %s failed: %s: %s (reconcile tries it again)", what(payload), type(exc).__name__,
                  first)
        return None
    log.info("promoted %s on %s in pid %d", what(payload), settings.node, os.getpid())
    return result


def run_part_process(settings: Settings, payload: dict[str, Any], context: ChildContext, beat: Any) -> None:
    """A part's promotion in a child: its events posted to the API in one request when it is
    done (``EventBatch``: a process that exits leaves nothing queued), exit code 1 when it
    failed, ``FOLLOWUPS`` when its checkpoint's run is to be started (``start_checkpoint_run``,
    which the agent does in a child of its own, so that the next part does not wait for it)."""
    from tasks.prefect_events import emit  # deferred: start-up — Prefect

    asked: list[tuple[Any, ...]] = []
    with agent_context(context, beat, settings.log_level):
        from prefect.settings import get_current_settings

        api = get_current_settings().api.url
        batch = EventBatch()
        try:
            result = promote_part(settings, payload, batch if api else emit, lambda *a: asked.append(a))
        finally:
            if api:
                batch.send(api)
    if result is None:
        sys.exit(1)
    if asked:
        sys.exit(FOLLOWUPS)


def run_checkpoint_process(settings: Settings, params: dict[str, Any], context: ChildContext,
                           beat: Any) -> None:
    """A checkpoint's promote run in a child (``start_checkpoint_run``); exit code 1 when it
    could not be created."""
    with agent_context(context, beat, settings.log_level):
        if start_checkpoint_run(settings.node, **params) is None:
            sys.exit(1)


def start_checkpoint_run(node: str, run: str, step: int, part: int, parts: int, attempt: str = "") -> Any:
    """Create the checkpoint's one promote run on ``node``'s deployment and run it here, at once,
    with Prefect's engine (``run_flow``: states, logs and artifacts as in any run). The same
    request again is the same run (``followups_key``); it is created ``Pending``, a state the
    runner's poll never takes, with a message only this call knows, so exactly the caller that
    created it runs it. Retried; when the server cannot be reached, reconcile's follow-ups
    backlog runs them. Returns the flow run, or None."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    from flows.promote import followups_key, promote_checkpoint  # deferred: start-up — Prefect, SQLAlchemy

    params = {"run": run, "step": step, "part": part, "parts": parts, "node": node, "attempt": attempt}
    mine = f"started by the agent on {node} ({uuid.uuid4().hex[:12]})"
    for tried in range(REQUEST_ATTEMPTS):
        try:
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name(names.promote_deployment(node))
                flow_run = client.create_flow_run_from_deployment(
                    deployment.id, parameters=params, state=Pending(message=mine),
                    idempotency_key=followups_key(run, step, attempt))
            break
        except Exception as exc:  # noqa: BLE001 - retried, then reconcile's follow-ups backlog
            if tried + 1 == REQUEST_ATTEMPTS:
                log.error("checkpoint %s step %s complete on Tier 1, its promote run not created (%s: %s): "
                          "reconcile runs its follow-ups", run, step, type(exc).__name__, exc)
                return None
            time.sleep(2 ** tried)
    if flow_run.state is None or flow_run.state.message != mine:
        return flow_run  # asked before: its creator runs it
    log.info("checkpoint %s step %s complete on Tier 1: its promote run is %s", run, step, flow_run.id)
    run_flow(lean_flow(promote_checkpoint), flow_run=flow_run, return_type="state")
    return flow_run


def crash_checkpoint_run(node: str, run: str, step: int, attempt: str, why: str) -> None:
    """The checkpoint's promote run, when its process ended before it did (killed when it stalled,
    out of memory), recorded ``Crashed`` with ``why``, as Prefect's runner records the runs of
    the processes it starts (``flows.promote.crash_followups_run``); reconcile finishes the
    follow-ups."""
    from flows.promote import crash_followups_run  # deferred: start-up — Prefect, SQLAlchemy

    crash_followups_run(run, step, attempt, why)


def lean_flow(flow: Any) -> Any:
    """``flow`` with its result not persisted (a promotion's outcome is in the catalog; its summary
    is the run's return value and artifact) and a result storage named, so that the engine does
    not ask the server for its default result storage at each run (``persist_result=False``
    alone still asks): Prefect's local result folder, never written."""
    from pathlib import Path

    from prefect.settings import get_current_settings

    folder = Path(get_current_settings().results.local_storage_path)
    return flow.with_options(persist_result=False, result_storage=folder)


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
