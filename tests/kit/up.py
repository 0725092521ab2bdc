"""``ckpt up`` run for real, as a user runs it: a child process whose printed ``export`` lines
are all another shell gets, and ``fresh_shell_env``, the environment of such a shell (no
``CKPT_*``, ``PREFECT_*`` or ``AWS_*`` of the test process leaks in)."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY = "Ctrl-C stops the stack"


def fresh_shell_env(home: Path) -> dict[str, str]:
    """What a new login shell of a user who installed the package has: ``PATH`` with the
    environment's ``bin`` (``python``, ``ckpt``) first, ``HOME`` (an empty one), and
    ``PYTHONPATH`` naming this tree (so the tree under test wins over any installed copy)."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "PYTHONPATH": str(REPO)}


def parse_exports(lines: list[str]) -> dict[str, str]:
    """``export K=V`` lines (values shell-quoted) as a dict, as a shell would read them."""
    out = {}
    for line in lines:
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            out[key] = value
    return out


@dataclass
class Up:
    """A running ``ckpt up``: its process, what it printed, and the exports it printed."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    @property
    def exports(self) -> dict[str, str]:
        return parse_exports(self.lines)

    @property
    def s3_url(self) -> str:
        return next(ln.split()[-1] for ln in self.lines if ln.startswith("S3 endpoint"))

    def stop(self, timeout: float = 90) -> str:
        """Ctrl-C, as a user stops it; returns the rest of its output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        rest, _ = self.proc.communicate(timeout=timeout)
        return rest or ""


def stack_port() -> int:
    """A port P for ``ckpt up --port P`` with P and P + 1 (its S3 server's, required as P is) free."""
    from ckpt.processes import free_port

    for _ in range(100):
        port = free_port()
        if port < 65535 and free_port(port + 1) == port + 1:
            return port
    raise AssertionError("no two free loopback ports in a row")


def start_up(root: Path, *, env: dict[str, str], port: int, cwd: Path, args: tuple[str, ...] = (),
             timeout: float = 180) -> Up:
    """``ckpt up --dir ROOT --port PORT`` with ``env``; returns once it printed its exports."""
    proc = subprocess.Popen(["ckpt", "up", "--dir", str(root), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    up = Up(proc)
    try:
        deadline = time.monotonic() + timeout
        while not any(READY in ln for ln in up.lines):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"ckpt up not ready:\n{up.text}")
            up.lines.append(proc.stdout.readline())
    except BaseException:
        up.stop()
        raise
    return up


TAKEN = "is taken"  # ckpt up's one-line error when --port or --port + 1 is in use


def start_up_anywhere(root: Path, *, env: dict[str, str], cwd: Path, args: tuple[str, ...] = (),
                      timeout: float = 180, tries: int = 3) -> tuple[Up, int]:
    """``start_up`` on a ``stack_port``; when another process took P or P + 1 between the pick
    and ckpt up's bind (parallel test workers' servers bind OS-picked ports too), which ckpt up
    refuses in one line, it is started again on another pair. Returns it and its port."""
    for attempt in range(tries):
        port = stack_port()
        try:
            return start_up(root, env=env, port=port, cwd=cwd, args=args, timeout=timeout), port
        except AssertionError as exc:
            if TAKEN not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")

