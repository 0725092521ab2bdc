"""The agent's threads allocate from one glibc malloc arena once its zygote is forked
(``deployments.processes.malloc_arenas``): a thread that allocates gets no arena of its own,
whose touched pages would stay with the agent; a zygote sets glibc's default back for its
children. glibc's ``malloc_stats`` lists the arenas."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, threading
from deployments.processes import DEFAULT_ARENAS, ONE_ARENA, malloc_arenas
if sys.argv[1] in ("one", "reset"):
    malloc_arenas(ONE_ARENA)  # the agent, once its zygote is forked
if sys.argv[1] == "reset":
    malloc_arenas(DEFAULT_ARENAS)  # a zygote started from it
together = threading.Barrier(4)
held = []
def work():
    held.append([bytearray(100_000) for _ in range(4)])  # from an arena (below the mmap threshold)
    together.wait()  # all four threads alive at once
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL(None).malloc_stats()  # on stderr, an "Arena N:" block per arena
"""


def _arenas(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_agents_threads_share_one_malloc_arena():
    assert _arenas("default") > 1  # glibc's default: threads that allocate get arenas of their own
    assert _arenas("one") == 1
    assert _arenas("reset") > 1  # a zygote forked from the agent sets glibc's default back
