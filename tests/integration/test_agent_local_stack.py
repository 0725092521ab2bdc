"""`ckpt up`: the local stack starts (Prefect server with API auth on, S3 server, agent) and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ckpt.local_stack import free_port
from core.events import auth_headers

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


def test_up_serves_the_stack_and_ctrl_c_stops_all_of_it(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "PREFECT_API_URL"))}
    proc = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "up", "--dir", str(tmp_path / "stack"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C stops the stack" in ln for ln in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        assert f"Prefect UI   http://127.0.0.1:{port}" in text
        assert f"export PREFECT_API_URL=http://127.0.0.1:{port}/api" in text
        s3 = next(ln.split()[-1] for ln in lines if ln.startswith("S3 endpoint"))
        assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5).status_code == 200
        # the UI asks the server where the API is: this stack's port, not Prefect's default 4200
        ui = httpx.get(f"http://127.0.0.1:{port}/ui-settings", timeout=5).json()
        assert ui["api_url"] == f"http://127.0.0.1:{port}/api"
        assert ui["auth"] == "BASIC"  # the UI asks for the secret
        assert httpx.get(f"{s3}/ckpt", timeout=5).status_code == 200  # the bucket exists
        secret = next(ln.split("=", 1)[1].strip() for ln in lines if "export PREFECT_API_AUTH_STRING=" in ln)
        dep_url = f"http://127.0.0.1:{port}/api/deployments/name/promote-checkpoint/node-0"
        assert httpx.get(dep_url, timeout=5).status_code == 401  # API auth is on by default
        d = httpx.get(dep_url, timeout=5, headers=auth_headers(secret)).json()
        assert d["status"] == "READY"
        children = _children(proc.pid)
        assert len(children) >= 3  # server, S3 server, agent
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    time.sleep(0.5)
    assert [c for c in children if _alive(c)] == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2)
