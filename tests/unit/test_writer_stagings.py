"""Which staging folders on a Tier 0 hold room for a writer that is gone: ``core.space.writer_stagings``
judges by the pid in the name and by the newest write in the folder (real folders, real pids)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from core.layout import staging_name, staging_pid
from core.space import STAGING_IDLE_S, writer_stagings


def staging(root, run: str, name: str, pid: int | None = None):
    folder = root / run / (staging_name(name) if pid is None else f".ckpt-staging-{pid}-0123abcd-{name}")
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / "model.safetensors").write_bytes(b"\0" * 1000)
    return folder


def age(folder, seconds: float) -> None:
    then = time.time() - seconds
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_a_live_writers_staging_is_kept_and_a_gone_ones_is_dead(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    live = staging(tmp_path, "run-a", "step-00000100")
    dead = staging(tmp_path, "run-a", "step-00000200", pid=int(gone.stdout))
    (tmp_path / "run-a" / "step-00000050").mkdir()  # a checkpoint: not staging

    found = {s.path: (s.pid, s.bytes, s.dead) for s in writer_stagings(tmp_path)}

    assert found == {live: (os.getpid(), 1000, False), dead: (int(gone.stdout), 1000, True)}
    assert staging_pid(live.name) == os.getpid() and staging_pid("step-00000100") is None


def test_a_staging_with_no_write_for_the_bound_is_dead_whatever_its_pid(tmp_path):
    """A pid since reused by another process looks alive: the folder's idleness decides."""
    idle = staging(tmp_path, "run-a", "step-00000100")
    age(idle, STAGING_IDLE_S + 60)
    busy = staging(tmp_path, "run-b", "step-00000100")
    age(busy, STAGING_IDLE_S + 60)
    (busy / "shards" / "model.safetensors").write_bytes(b"\0" * 2000)  # its writer still writes

    found = {s.path: s.dead for s in writer_stagings(tmp_path)}

    assert found == {idle: True, busy: False}
