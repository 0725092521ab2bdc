"""`ckpt up`: the local stack starts (Prefect server with API auth on, S3 server on the port after
its, agent), starts a dead agent again without touching the servers, and stops cleanly."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tasks.prefect_events import auth_headers
from tests.kit.agents import wait_for
from tests.kit.up import fresh_shell_env, start_up_anywhere

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_on(up) -> None:
    """What ckpt up prints after it is ready, into ``up.lines`` (until it exits)."""
    for line in iter(up.proc.stdout.readline, ""):
        up.lines.append(line)


def test_up_serves_the_stack_and_ctrl_c_stops_all_of_it(tmp_path):
    up, port = start_up_anywhere(tmp_path / "stack", env=fresh_shell_env(tmp_path / "home"), cwd=tmp_path)
    again: list[int] = []
    try:
        assert f"Prefect UI   http://127.0.0.1:{port}" in up.text
        assert up.exports["PREFECT_API_URL"] == f"http://127.0.0.1:{port}/api"
        # S3 on the port after: a restart with the same --port keeps this export valid too
        assert up.exports["CKPT_S3_ENDPOINT_URL"] == up.s3_url == f"http://127.0.0.1:{port + 1}"
        assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5).status_code == 200
        # the UI asks the server where the API is: this stack's port, not Prefect's default 4200
        ui = httpx.get(f"http://127.0.0.1:{port}/ui-settings", timeout=5).json()
        assert ui["api_url"] == f"http://127.0.0.1:{port}/api"
        assert ui["auth"] == "BASIC"  # the UI asks for the secret
        assert httpx.get(f"{up.s3_url}/ckpt", timeout=5).status_code == 200  # the bucket exists
        dep_url = f"http://127.0.0.1:{port}/api/deployments/name/promote-checkpoint/node-0"
        assert httpx.get(dep_url, timeout=5).status_code == 401  # API auth is on by default
        d = httpx.get(dep_url, timeout=5, headers=auth_headers(up.exports["PREFECT_API_AUTH_STRING"])).json()
        assert d["status"] == "READY"
        children = _children(up.proc.pid)
        assert len(children) >= 3  # server, S3 server, agent

        # the agent dies: it is started again, told once, and the server and S3 stay as they are
        agent = next(c for c in children if b"agent" in Path(f"/proc/{c}/cmdline").read_bytes())
        servers = [c for c in children if c != agent]
        reader = threading.Thread(target=_read_on, args=(up,), daemon=True)
        reader.start()
        os.kill(agent, signal.SIGKILL)
        wait_for("ckpt up to say it restarts the agent", lambda: "restart 1 in 1 s" in up.text, timeout=60)
        assert "agent node-0 exited with -9; restart 1 in 1 s" in up.text
        again = wait_for("a new agent", lambda: [c for c in _children(up.proc.pid) if c not in children
                                                 and b"agent" in Path(f"/proc/{c}/cmdline").read_bytes()],
                         timeout=60)
        assert all(_alive(c) for c in servers) and _alive(again[0])
        assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5).status_code == 200
        assert up.text.count("exited with") == 1
    finally:
        rest = up.stop()
    assert up.proc.returncode == 0, rest
    assert "stopped" in up.text + rest
    children += again  # the restarted agent is stopped with the rest
    wait_for("every child of ckpt up to be gone", lambda: not [c for c in children if _alive(c)], timeout=10)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2)
