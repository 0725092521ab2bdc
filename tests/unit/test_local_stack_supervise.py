"""``ckpt up``'s stack keeps itself whole: a dead agent is started again with a backoff, told once
per restart, while the servers keep running; the port asked with ``--port`` is the one it comes
back on (a port held only by TIME_WAIT connections is free), and a port really taken is an
error, never a silent other port; so is S3's, the port after it. Agents here are small
processes standing in for ``ckpt agent``; time is passed in, never waited for, but for the
processes' own exits."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import ckpt.local_stack as ls
from core.errors import ConfigError

EXIT_AT_ONCE = "import sys; sys.exit(3)"
RUN_UNTIL_KILLED = "import time; time.sleep(600)"


@pytest.fixture
def stack(tmp_path, monkeypatch):
    """A stack of two nodes whose 'agents' run ``script[0]`` (changeable) and whose 'server' sleeps."""
    script = [EXIT_AT_ONCE]
    started: list[str] = []

    def fake_agent(env, log, *, node, **_kw):
        started.append(node)
        return subprocess.Popen([sys.executable, "-c", script[0]])

    monkeypatch.setattr(ls, "start_agent", fake_agent)
    s = ls.LocalStack(tmp_path, nodes=("node-0", "node-1"))
    s.procs.append(subprocess.Popen([sys.executable, "-c", RUN_UNTIL_KILLED]))  # the Prefect server, S3
    s.script, s.started = script, started  # type: ignore[attr-defined]
    yield s
    for p in s.agents + s.procs:
        p.kill()
        p.wait()


def exited(stack) -> None:
    for p in stack.agents:
        if p.args[-1] == EXIT_AT_ONCE:
            p.wait(timeout=60)


def test_a_dead_agent_is_started_again_with_backoff_and_told_once_per_restart(stack):
    stack.script[0] = RUN_UNTIL_KILLED
    stack.start_agents(now=0.0)
    stack.script[0] = EXIT_AT_ONCE
    stack.agents[1].kill()  # node-1's agent dies; node-0's runs on
    stack.agents[1].wait()
    server = stack.procs[0]

    said = []
    for now in (1.0, 1.5):  # found dead at 1.0: restart due at 2.0
        said += stack.supervise(now=now)
    assert len(said) == 1 and said[0].startswith("agent node-1 exited with -9; restart 1 in 1 s")
    assert "keep running" in said[0] and "agent-node-1.log" in said[0]
    assert stack.started == ["node-0", "node-1"]

    waits = []
    now = 2.0
    for _ in range(8):  # each restart exits at once: found dead, then started when due
        assert stack.supervise(now=now) == []  # due: started again, nothing said
        exited(stack)
        now += 0.1
        (line,) = stack.supervise(now=now)
        waits.append(int(line.split(" in ")[1].split(" s")[0]))
        now += waits[-1]
    assert waits == [2, 4, 8, 16, 32, 60, 60, 60]  # doubling, at most a minute
    assert stack.started.count("node-1") == 9 and stack.started.count("node-0") == 1
    assert server.poll() is None and stack.servers_alive()  # the server and S3 were never touched
    assert stack.agents[0].poll() is None


def test_an_agent_that_ran_a_minute_starts_its_backoff_afresh(stack):
    stack.start_agents(now=0.0)
    exited(stack)
    assert "restart 1 in 1 s" in stack.supervise(now=0.5)[0]
    stack.supervise(now=1.5)
    exited(stack)
    assert "restart 2 in 2 s" in stack.supervise(now=1.6)[0]
    stack.supervise(now=3.6)  # started again at 3.6; it then runs past a minute before it dies
    exited(stack)
    assert "restart 1 in 1 s" in stack.supervise(now=3.6 + ls.AGENT_STEADY_S + 1)[0]


def test_a_dead_server_is_not_papered_over(stack):
    stack.start_agents(now=0.0)
    stack.procs[0].kill()
    stack.procs[0].wait()
    assert not stack.servers_alive()  # ckpt up stops and says so


def test_a_port_held_only_by_time_wait_is_free_and_a_listening_one_is_an_error():
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((ls.LOOPBACK, 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection((ls.LOOPBACK, port))
        conn, _ = listener.accept()
        with pytest.raises(ConfigError, match=f"port {port} .* is taken") as err:
            ls.free_port(port, required=True)
        assert "--port" in str(err.value)
        assert ls.free_port(port) != port  # not required (no --port): another one
        conn.close()  # the server side closes first: its end of the connection is left in TIME_WAIT
        client.close()
    assert ls.free_port(port, required=True) == port  # a restarted server may bind there (SO_REUSEADDR)


def test_ckpt_up_on_a_taken_port_says_so_and_starts_nothing(tmp_path, monkeypatch):
    import signal

    from typer.testing import CliRunner

    from ckpt.cli import app

    monkeypatch.setattr(signal, "signal", lambda *_a: None)  # ckpt up's SIGTERM handler stays out of pytest

    with socket.socket() as taken:
        taken.bind((ls.LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is taken"):
            CliRunner().invoke(app, ["up", "--dir", str(tmp_path / "stack"), "--port", str(port), "--no-tier2"],
                               catch_exceptions=False)
    assert not (tmp_path / "stack" / "prefect" / "server.log").exists()  # no server was started elsewhere


def _port_before_a_listener() -> tuple[int, socket.socket]:
    """A free port P whose next one, P + 1, a socket listens on (returned, to close)."""
    for _ in range(50):
        taken = socket.socket()
        taken.bind((ls.LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1] - 1
        if port > 0 and ls.free_port(port) == port:
            return port, taken
        taken.close()
    raise AssertionError("no free port right before a listening one")


def test_ckpt_up_on_a_port_whose_s3_port_is_taken_says_so_and_starts_nothing(tmp_path, monkeypatch):
    import signal

    from typer.testing import CliRunner

    from ckpt.cli import app

    monkeypatch.setattr(signal, "signal", lambda *_a: None)  # ckpt up's SIGTERM handler stays out of pytest
    port, taken = _port_before_a_listener()
    with taken, pytest.raises(ConfigError, match=rf"S3 server's \(--port \+ 1\) port {port + 1} on 127.0.0.1 is taken"):
        CliRunner().invoke(app, ["up", "--dir", str(tmp_path / "stack"), "--port", str(port)], catch_exceptions=False)
    assert not (tmp_path / "stack" / "prefect" / "server.log").exists()  # not even the Prefect server started
    assert not (tmp_path / "stack" / "logs" / "moto.log").exists()


def test_a_stack_restarted_on_its_port_serves_s3_on_the_same_endpoint(tmp_path):
    """The S3 endpoint in a job's exports stays valid across a restart with ``--port P``: S3 is
    on P + 1 each time, also when the last run's connections left that port in TIME_WAIT."""
    import httpx

    port, taken = _port_before_a_listener()
    taken.close()  # P + 1 is free now
    endpoints = []
    for _ in range(2):  # started, then started again on the same --port
        stack = ls.LocalStack(tmp_path / "stack", port=port, port_required=True)
        client = httpx.Client(timeout=10)
        try:
            stack.start_s3()
            assert client.get(f"{stack.s3_url}/ckpt").status_code == 200  # the bucket is made
            env = ls.stack_env(tmp_path / "data", api_url=f"http://{ls.LOOPBACK}:{port}/api", s3_url=stack.s3_url)
            endpoints.append(ls.job_exports(env, node="node-0", catalog_url="sqlite://")["CKPT_S3_ENDPOINT_URL"])
        finally:
            stack.stop()  # the server goes first: its end of the kept-alive connection is left in TIME_WAIT
            client.close()
    assert endpoints == [f"http://127.0.0.1:{port + 1}"] * 2


def test_a_restarted_stack_keeps_its_api_secret_readable_only_by_its_owner(tmp_path):
    """The secret a job's exports carry survives a restart of ``ckpt up`` on the same folder;
    another folder gets its own; the file is the owner's alone."""
    import stat

    first = ls.stack_auth_string(tmp_path / "stack")
    assert len(first) >= 40
    assert ls.stack_auth_string(tmp_path / "stack") == first
    assert stat.S_IMODE((tmp_path / "stack" / ls.AUTH_FILE).stat().st_mode) == 0o600
    assert ls.stack_auth_string(tmp_path / "other") != first
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / ls.AUTH_FILE).write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        ls.stack_auth_string(tmp_path / "blank")
