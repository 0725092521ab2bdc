"""Where an agent's memory goes: the resident set (VmRSS) of a fresh interpreter after each
layer a node agent and its part processes import, in import order, with the heavy packages each
layer pulled in (torch and numpy must not be among them: an agent moves bytes, it never builds
tensors). Baselines in the same run: a bare interpreter, and Prefect alone (its client, imported
by any flow run).

Each row is its own interpreter importing the layers up to it (so one layer's figure is the
difference to the row above), ``--rounds`` times; medians and the smallest of the rounds. The
last row is a part's process as it runs (``deployments.processes.PRELOAD`` imported, the
catalog's schema checked against a SQLite catalog).

Then the group as an agent runs it, measured from outside (``/proc/PID/smaps_rollup`` and
``/proc/PID/pagemap``), ``--rounds`` times: the agent with a spawned part process (the baseline:
two interpreters, each with its own copy of every import) and the agent with its zygote (forked
from the agent once it imported what a child needs) and a part process forked from the zygote,
as the agent runs them (``deployments.processes.Zygote``). Two RSS figures
added would count the shared pages twice; the honest figure of what the group costs the node is
its distinct page frames (every resident page counted once, shared libraries in full even where
other processes map them too; needs root to read the frame numbers), and the sum of PSS beside
it (each shared page divided among all its mappers, so slightly low where libraries are shared
with other programs). The goal is judged on distinct frames where readable, else on PSS.
Each part takes a new process: the wall and CPU seconds until one is ready are printed for
both, the CPU being what every promoted part pays outside its bytes.

    .venv/bin/python benchmarks/agent_memory.py [--rounds 3]
    .venv/bin/python benchmarks/agent_memory.py --smoke    # one round, no per-layer rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, bench_parser, load_line, parse
from db.catalog import upgrade

HEAVY = ("torch", "numpy", "safetensors", "boto3", "pandas", "fsspec", "httpx", "alembic", "sqlalchemy",
         "uvicorn", "fastapi")
LAYERS: list[tuple[str, list[str]]] = [
    ("bare interpreter (baseline)", []),
    ("core: settings, transfer engine", ["core.settings", "core.transfer", "core.storage.local"]),
    ("db: the catalog (SQLAlchemy, Alembic)", ["db.catalog"]),
    ("prefect (its client; baseline of a flow run)", ["prefect"]),
    ("tasks: the pipeline steps", ["tasks.hop", "tasks.retention"]),
    ("flows: promote, its engine", ["flows.promote", "flows.common", "prefect.flow_engine"]),
    ("deployments: the agent", ["deployments.agent", "deployments.processes"]),
]
PROBE = r"""
import importlib, json, sys
for m in json.loads(sys.argv[1]):
    importlib.import_module(m)
if sys.argv[2] == "warm":
    from benchmarks.agent_memory import part_ready
    part_ready()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024
print(json.dumps({"rss": rss, "heavy": [k for k in json.loads(sys.argv[3]) if k in sys.modules]}))
"""
# The agent as it runs: a part's process spawned (a fresh interpreter) or forked from
# the agent's zygote, as the agent starts it (deployments.processes); the figures of
# the whole group are then measured from outside (group_memory).
GROUP_PROBE = r"""
import importlib, json, multiprocessing, os, sys, tempfile, time
for m in json.loads(sys.argv[1]):
    importlib.import_module(m)
from benchmarks.agent_memory import part_child, part_forked, tree
t0 = time.monotonic()
if sys.argv[2] == "forked":
    from deployments.processes import Zygote
    ready = tempfile.mktemp(prefix="ckpt-mem-ready-")
    part = Zygote.get().fork(part_forked, (ready,))
    while not os.path.exists(ready):
        assert time.monotonic() - t0 < 300, "part process not ready"
        time.sleep(0.005)
else:
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    part = ctx.Process(target=part_child, args=(child,), daemon=True)
    part.start()
    assert conn.poll(300), "part process not ready"
    conn.recv()
wall = time.monotonic() - t0
ticks = sum(int(x) for x in open(f"/proc/{part.pid}/stat").read().rsplit(")", 1)[1].split()[11:13])
print(json.dumps({"pids": tree(os.getpid()), "ready_s": wall, "ready_cpu_s": ticks / os.sysconf("SC_CLK_TCK")}),
      flush=True)
sys.stdin.readline()
if sys.argv[2] == "forked":
    part.kill()
    part.join(30)
    os.unlink(ready)
else:
    conn.send(None)
    part.join(30)
"""


def part_ready() -> None:
    """What a part's process has done before its copy: its imports (the zygote's preload)
    and the catalog's schema check."""
    import importlib

    from core.settings import load_settings  # deferred: start-up — in the measured process, as a part's
    from db.catalog import Catalog  # deferred: start-up — in the measured process, as a part's
    from deployments.processes import PRELOAD  # deferred: start-up — in the measured process, as a part's

    for name in PRELOAD:
        importlib.import_module(name)
    with Catalog(load_settings().catalog_url) as cat:
        cat.list_runs()


def part_child(conn) -> None:
    """A part's process (``GROUP_PROBE``): ready, then waits to be told to exit."""
    part_ready()
    conn.send("ready")
    conn.recv()


def part_forked(ready: str, beat) -> None:
    """A part's process forked from the agent's zygote (``GROUP_PROBE``): ready (``ready``
    written), then waits to be killed."""
    import time  # deferred: in the measured process, as a part's

    part_ready()
    with open(ready, "w"):
        pass
    time.sleep(3600)


def tree(pid: int) -> list[int]:
    """``pid`` and every live process under it (the zygote and the part)."""
    from benchmarks.burst import descendants  # deferred: start-up — in the measured process

    return [pid, *descendants(pid)]


def probe(mods: list[str], warm: bool, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(mods), "warm" if warm else "-", json.dumps(HEAVY)],
                         capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kib(pid: int, key: str) -> int:
    return sum(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup") if line.startswith(key))


def frames(pid: int) -> set[int] | None:
    """The physical page frames ``pid`` has resident (None where /proc hides them: not root)."""
    got: set[int] = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in maps:
            lo, hi = (int(x, 16) // 4096 for x in line.split()[0].split("-"))
            if "[vsyscall]" in line:
                continue
            pagemap.seek(lo * 8)
            data = pagemap.read((hi - lo) * 8)
            for (entry,) in struct.iter_unpack("Q", data):
                if entry >> 63:  # present
                    got.add(entry & ((1 << 55) - 1))
    return got if any(got) else None


def group_memory(mode: str, mods: list[str], env: dict[str, str]) -> dict:
    """The agent with a part's process (and the zygote when forked),
    measured from outside:
    the sum of PSS (each shared page divided among the processes mapping it) and, where the page
    frames are visible, the distinct frames of the group (every page it holds, counted once)."""
    proc = subprocess.Popen([sys.executable, "-c", GROUP_PROBE, json.dumps(mods), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        got = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        pids = got["pids"]
        pss = sum(_kib(pid, "Pss:") for pid in pids) * 1024
        uss = [(_kib(pid, "Private_Clean:") + _kib(pid, "Private_Dirty:")) * 1024 for pid in pids]
        sets = [frames(pid) for pid in pids]
        distinct = len(set().union(*sets)) * 4096 if all(f is not None for f in sets) else None  # type: ignore[misc]
    finally:
        proc.communicate("\n", timeout=60)
    return {"processes": len(pids), "pss": pss, "uss": uss, "distinct": distinct, "ready_s": got["ready_s"],
            "ready_cpu_s": got["ready_cpu_s"]}


def main() -> None:
    ap = bench_parser(__doc__, rounds=3)
    ap.add_argument("--layers", action=argparse.BooleanOptionalAction, default=True,
                    help="a row per layer (else: the bare interpreter, the whole agent, a part's process)")
    args = parse(ap, {"layers": False})
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckpt-mem-") as home:
        env = {**os.environ, "CKPT_DATA_DIR": home, "PREFECT_HOME": str(Path(home) / "prefect"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        upgrade(f"sqlite:///{Path(home) / 'catalog.db'}")
        rows: list[tuple[str, list[float], list[str]]] = []
        mods: list[str] = []
        for i, (name, add) in enumerate(LAYERS):
            mods = mods + add
            if not args.layers and 0 < i < len(LAYERS) - 1:
                continue
            got = [probe(mods, False, env) for _ in range(args.rounds)]
            rows.append((name, [g["rss"] / 1e6 for g in got], got[-1]["heavy"]))
        got = [probe(mods, True, env) for _ in range(args.rounds)]
        rows.append(("part process (ready to copy)", [g["rss"] / 1e6 for g in got], got[-1]["heavy"]))
        prefect_alone = [probe(["prefect"], False, env)["rss"] / 1e6 for _ in range(args.rounds)]
        groups = {mode: [group_memory(mode, mods, env) for _ in range(args.rounds)] for mode in ("spawned", "forked")}

    print(f"resident memory by layer, fresh interpreter per row, {args.rounds} rounds")
    print(f"{'layers imported (cumulative)':46} {'median MB':>10} {'min MB':>8} {'+ layer':>8}   heavy packages loaded")
    prev = 0.0
    for name, mb, heavy in rows:
        med = statistics.median(mb)
        print(f"{name:46} {med:10.1f} {min(mb):8.1f} {med - prev:+8.1f}   {' '.join(heavy) or '-'}")
        prev = med
    print(f"{'prefect alone (baseline)':46} {statistics.median(prefect_alone):10.1f} {min(prefect_alone):8.1f}")
    agent, part = statistics.median(rows[-2][1]), statistics.median(rows[-1][1])
    print(f"\nthe agent with a part's process, measured from outside, {args.rounds} rounds (MB; PSS: each shared page "
          f"divided among the processes mapping it; distinct frames: every page of the group once)")
    print(f"{'group':46} {'PSS median':>10} {'PSS min':>8} {'distinct':>9}   USS per process (median)")
    labels = {"spawned": "spawned part process (baseline)", "forked": "part process from the zygote"}
    for mode, label in labels.items():
        got = groups[mode]
        pss = [g["pss"] / 1e6 for g in got]
        dist = [g["distinct"] / 1e6 for g in got if g["distinct"] is not None]
        n = got[0]["processes"]
        uss = " + ".join(f"{statistics.median(g['uss'][i] for g in got) / 1e6:.1f}" for i in range(n))
        shown = f"{statistics.median(dist):9.1f}" if dist else f"{'-':>9}"
        print(f"{f'{label} ({n} processes)':46} {statistics.median(pss):10.1f} {min(pss):8.1f} {shown}   {uss}")
    print(f"\nstarting the process each part uses (one per part), {args.rounds} rounds: wall seconds until "
          f"ready, CPU seconds of that process until ready")
    print(f"{'part process':46} {'wall med':>10} {'wall min':>8} {'CPU med':>9} {'CPU min':>8}")
    for mode, label in labels.items():
        wall = [g["ready_s"] for g in groups[mode]]
        cpu = [g["ready_cpu_s"] for g in groups[mode]]
        print(f"{label:46} {statistics.median(wall):10.3f} {min(wall):8.3f} {statistics.median(cpu):9.2f} "
              f"{min(cpu):8.2f}")
    print(load_line(load0))
    torch_free = all("torch" not in h and "numpy" not in h for _, _, h in rows)
    forked = groups["forked"]
    dist = [g["distinct"] / 1e6 for g in forked if g["distinct"] is not None]
    group = statistics.median(dist) if dist else statistics.median(g["pss"] / 1e6 for g in forked)
    print(f"goal: agent + its part process <= 150 MB -> {agent:.0f} + {part:.0f} = {agent + part:.0f} MB resident "
          f"if nothing were shared; forked, the group holds {group:.0f} MB ({'distinct frames' if dist else 'PSS'}; "
          f"imports only, a running agent adds its threads and buffers), {'MET' if group <= 150 else 'NOT MET'}; "
          f"torch/numpy not imported: {'yes' if torch_free else 'NO'}")


if __name__ == "__main__":
    main()
