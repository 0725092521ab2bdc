"""Starting, waiting on and stopping the local processes a stack runs (servers, agents): shared
by ``ckpt.local_stack`` and ``ckpt.production_stack``, and by the test kit and scripts."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

from core.errors import ConfigError

LOOPBACK = "127.0.0.1"


def free_port(preferred: int | None = None, *, required: bool = False, what: str = "") -> int:
    """``preferred`` if nothing listens there, else a free port the OS picks; with ``required``
    a taken ``preferred`` is a ``ConfigError`` (a stack restarted with ``--port P`` must come
    back on P: the exports its jobs hold name it), which names the port as ``what`` says (e.g.
    "the S3 server's"). The test bind sets SO_REUSEADDR, as the servers themselves do (uvicorn,
    werkzeug): a port held only by TIME_WAIT connections of a stack that just stopped is free,
    not taken."""
    if preferred:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((LOOPBACK, preferred))
                return preferred
            except OSError as exc:
                if required:
                    raise ConfigError(f"{what + ' ' if what else ''}port {preferred} on {LOOPBACK} is taken "
                                      f"({exc.strerror}): another process listens there; stop it, or start on "
                                      "another --port (and give the jobs the new exports)") from None
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_http(url: str, *, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise ConfigError(f"{what or url} exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise ConfigError(f"{what or url} not ready after {timeout:.0f}s")
        time.sleep(0.3)


def stop_process(proc: subprocess.Popen | None, grace: float = 15.0) -> None:
    """SIGINT (Prefect's serve pauses its deployments on it), then SIGTERM, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 5.0)):
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait(timeout=10)


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)  # a Ctrl-C in the terminal reaches us, not them


class Started:
    """A context manager over ``start()`` / ``stop()``: a start that fails half way stops
    what it had started."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
