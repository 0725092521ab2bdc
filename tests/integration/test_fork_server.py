"""The agent's warm processes are forked from a fork server the agent forks from itself after
its imports (deployments.fast_path.start_fork_server): the warm process is ready, is a child of
that server, shares its pages, runs what it is given, and a killed one reports its signal as
before; no resource tracker process is started beside the server; a dead server is replaced
(spawned) and warm processes keep coming. A process with a second thread never forks (it falls
back to spawning).

Each case is its own interpreter (the fork server is once per process, and pytest's has threads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys, threading, time
from deployments.fast_path import WarmProcess, process_context, start_fork_server, _fork_server

def ppid(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])

def ready(warm):
    deadline = time.monotonic() + 300
    while not warm.ready():
        assert time.monotonic() < deadline and warm.process.is_alive()
        time.sleep(0.05)

out = {}
if sys.argv[1] == "threaded":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    out["started"] = start_fork_server()
    out["context"] = process_context().get_start_method()
    stop.set()
else:
    import signal
    signal.signal(signal.SIGTERM, lambda *_: None)  # the agent's own handler: not its flow processes'
    out["started"] = start_fork_server()
    out["again"] = start_fork_server()
    out["context"] = process_context().get_start_method()
    warm = WarmProcess(process_context(), dict(os.environ))
    ready(warm)
    out["server_parent"] = ppid(_fork_server["pid"]) == os.getpid()
    out["warm_parent"] = ppid(warm.process.pid) == _fork_server["pid"]
    lines = open(f"/proc/{warm.process.pid}/smaps_rollup").read().splitlines()[1:]
    rollup = {l.split(":")[0]: int(l.split()[1]) for l in lines}
    out["warm_rss_kib"], out["warm_private_kib"] = rollup["Rss"], rollup["Private_Clean"] + rollup["Private_Dirty"]
    me = os.getpid()
    children = open(f"/proc/{me}/task/{me}/children").read().split()
    out["children"] = [open(f"/proc/{c}/cmdline").read().replace("\0", " ") for c in children]
    warm.stop()
    out["stopped_code"] = warm.process.exitcode
    killed = WarmProcess(process_context(), dict(os.environ))
    ready(killed)
    killed.process.terminate()
    killed.process.join(60)
    out["killed_code"] = killed.process.exitcode
    server = _fork_server["pid"]
    os.kill(server, 9)  # the server gone: multiprocessing starts a spawned one, warm processes still come
    while open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)
    again = WarmProcess(process_context(), dict(os.environ))
    ready(again)
    out["after_server_died"] = ppid(again.process.pid) != server
    again.stop()
    out["after_server_died_code"] = again.process.exitcode
print(json.dumps(out))
"""


def run(mode: str, tmp_path: Path) -> dict:
    env = {**os.environ, "CKPT_DATA_DIR": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect"),
           "CKPT_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_warm_process_is_forked_from_the_agent_and_shares_its_pages(tmp_path):
    out = run("single", tmp_path)
    assert out["started"] is True and out["again"] is False  # one server per agent
    assert out["context"] == "forkserver"
    assert out["server_parent"] and out["warm_parent"]
    # Prefect, SQLAlchemy and the flow are the server's pages: the warm process owns a small part
    # of what it maps (a spawned one owns ~100 MB of its ~125 MB)
    assert out["warm_private_kib"] < out["warm_rss_kib"] / 2, out
    # the fork server is the agent's one child: no resource tracker interpreter (~7 MB) beside it
    assert len(out["children"]) == 1 and "resource_tracker" not in out["children"][0], out["children"]
    assert out["stopped_code"] == 0  # told to stop, it exits cleanly
    assert out["killed_code"] == -15  # the supervisor still sees how a killed flow process ended
    assert out["after_server_died"] and out["after_server_died_code"] == 0


def test_a_process_with_threads_does_not_fork(tmp_path):
    out = run("threaded", tmp_path)
    assert out == {"started": False, "context": "spawn"}
