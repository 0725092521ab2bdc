"""A long-running command started with SIGINT ignored (a background job of a non-interactive
shell: `nohup ckpt up &`, a cron or Slurm script) still stops on SIGINT, as `ckpt up` stops its
agents and a user stops `ckpt up`: before, it ignored it until the SIGTERM after it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


def _catches_sigint(pid: int) -> bool:
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def test_a_command_started_with_sigint_ignored_stops_on_sigint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "PREFECT_"))}
    env.update(CKPT_DATA_DIR=str(tmp_path / "data"), PREFECT_HOME=str(tmp_path / "prefect"))
    # as a shell starts a background job: SIGINT ignored, which exec keeps
    command = f'trap "" INT; exec {shlex.quote(sys.executable)} -m ckpt.cli reconcile --every'
    proc = subprocess.Popen(["sh", "-c", command], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _catches_sigint(proc.pid):  # what the shell gave it replaced by Python's Ctrl-C
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "SIGINT never caught"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, 130, -signal.SIGINT), out
