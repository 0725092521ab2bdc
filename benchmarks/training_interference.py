"""Benchmark: a CPU-bound training loop beside a promotion, in the same run.

A training job (a separate process: torch matmuls on every core, as a job's compute would, or
on ``--threads`` of them)
reports its step count every 0.1 s. Each round measures, in an order rotated every round:
- the loop's steps/s alone (a window of ``--window`` seconds);
- the loop's steps/s while a Tier 0 -> Tier 1 promotion (``tier1_hop``, the whole hop) runs
  beside it, and the promotion's time, four ways: at the agent's default copy priority
  (``copy_nice`` 10, lowest best-effort I/O: the whole hop runs on a thread at that priority,
  ``core.transfer.run_at``) and at the agent's own (nice 0, I/O unchanged), each with Tier 1
  written and read back directly (``tier1_direct_io``: O_DIRECT, no page cache) and buffered;
and, with no training running, the promotion's quiet time and CPU (this process's user + system
time: the hop runs on its threads), direct and buffered. Goals: the loop slows <= 5 % beside the
promotion at the default settings, and the promotion takes <= 1.5 x its quiet time. The two pull
against each other when the loop keeps every core busy: what the promotion's CPU takes within
1.5 x its quiet time is the least the loop loses, which the last lines print (the floor both
goals together need).

    .venv/bin/python benchmarks/training_interference.py [--gib 1] [--rounds 3] [--window 4] [--threads N]
    .venv/bin/python benchmarks/training_interference.py --smoke    # 4 MiB, one round
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, load_line, parse
from benchmarks.promote_tier1 import HopBench
from core.settings import Settings

SMOKE = {"gib": 4 / 1024, "shards": 4, "window": 0.5, "matrix": 128, "sync": False}

TRAINER = r"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
n = int(sys.argv[1])
a, b = torch.randn(n, n), torch.randn(n, n)
steps, last = 0, time.monotonic()
print(f"{last:.6f} 0", flush=True)
while True:
    c = a @ b
    a = c / c.norm()  # each step depends on the last, as a training step does
    steps += 1
    now = time.monotonic()
    if now - last >= 0.1:
        print(f"{now:.6f} {steps}", flush=True)
        last = now
"""


class Trainer:
    """The training process and the (time, steps) it reported."""

    def __init__(self, matrix: int, threads: int):
        self.proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(matrix), str(threads)],
                                     stdout=subprocess.PIPE, text=True)
        self.samples: list[tuple[float, int]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        while not self.samples:
            time.sleep(0.05)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, n = line.split()
            self.samples.append((float(t), int(n)))

    def rate(self, t0: float, t1: float) -> float:
        """Steps per second between monotonic times t0 and t1 (the reports nearest inside)."""
        inside = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        if len(inside) < 2:
            raise RuntimeError(f"no training reports in [{t0:.2f}, {t1:.2f}]: window too short")
        (a, na), (b, nb) = inside[0], inside[-1]
        return (nb - na) / (b - a)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    ap = bench_parser(__doc__, rounds=3)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--window", type=float, default=4.0, help="seconds the loop runs alone per round")
    ap.add_argument("--matrix", type=int, default=512, help="matmul size of a training step")
    ap.add_argument("--threads", type=int, default=0,
                    help="the loop's threads (default 0: every core; fewer leaves cores to the rest of the node, "
                         "as a GPU job's host side does)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    ap.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                    help="sync before each promotion (no writeback of the last one during it)")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if not 0 <= args.threads <= cores:
        ap.error(f"--threads {args.threads}: out of range (0 for every core, at most {cores})")
    threads = args.threads or cores

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        hop = HopBench(work, args.gib, args.shards, args.parallelism)
        nbytes = hop.manifest.total_bytes
        low: dict[str, object] = {"copy_nice": 10, "copy_io_class": "best-effort"}
        own: dict[str, object] = {"copy_nice": 0, "copy_io_class": "unchanged"}
        modes = {"direct I/O": {"tier1_direct_io": True}, "buffered": {"tier1_direct_io": False}}
        ways = {f"{prio}, {mode}": {**settings, **modes[mode]}
                for prio, settings in (("nice 10, I/O best-effort 7", low), ("nice 0, I/O unchanged", own))
                for mode in modes}
        default = f"nice 10, I/O best-effort 7, {'direct I/O' if Settings().tier1_direct_io else 'buffered'}"

        def promote(**prio: object) -> tuple[float, float, float, tuple[float, float]]:
            """(start, end, seconds, (user, system) CPU seconds of this process) of one promotion."""
            hop.fresh(**prio)
            if args.sync:
                subprocess.run(["sync"], check=True)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            hop.promote()
            t1 = time.monotonic()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            return t0, t1, t1 - t0, (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)

        hop.fresh()
        hop.promote()  # warm: imports, the source in the page cache
        quiet: dict[str, list[float]] = {m: [] for m in modes}
        quiet_cpu: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode, settings in modes.items():
                *_, took, cpu_s = promote(**low, **settings)
                quiet[mode].append(took)
                quiet_cpu[mode].append(cpu_s)
        alone: list[float] = []
        beside: dict[str, list[float]] = {w: [] for w in ways}
        hop_s: dict[str, list[float]] = {w: [] for w in ways}
        trainer = Trainer(args.matrix, threads)
        try:
            time.sleep(max(0.5, args.window / 4))  # its first steps (allocation, thread start)
            names = ["alone", *ways]
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    if name == "alone":
                        t0 = time.monotonic()
                        time.sleep(args.window)
                        alone.append(trainer.rate(t0, time.monotonic()))
                        continue
                    t0, t1, took, _ = promote(**ways[name])
                    time.sleep(0.25)  # the report after the promotion's end
                    beside[name].append(trainer.rate(t0, t1 + 0.15) if took > 0.3 else trainer.rate(t0, t0 + 0.3))
                    hop_s[name].append(took)
        finally:
            trainer.stop()

        a = statistics.median(alone)
        print(f"checkpoint: {nbytes / 2**30:.3f} GiB in {len(hop.manifest.files)} files; training loop: "
              f"{args.matrix}x{args.matrix} float32 matmuls on {threads} threads; {args.rounds} rounds; "
              f"the default: {default}")
        print(f"\n{'training loop':58} {'median steps/s':>15} {'best':>8} {'slowdown':>9}   rounds")
        print(f"{'alone (baseline)':58} {a:15.1f} {max(alone):8.1f} {0:8.1%}   "
              + " ".join(f"{x:.1f}" for x in alone))
        for name, got in beside.items():
            m = statistics.median(got)
            print(f"{'beside a promotion, ' + name:58} {m:15.1f} {max(got):8.1f} {1 - m / a:8.1%}   "
                  + " ".join(f"{x:.1f}" for x in got))
        print(f"\n{'promotion (whole hop)':58} {'median s':>15} {'best s':>8} {'x quiet':>9}   rounds")
        q = {mode: statistics.median(got) for mode, got in quiet.items()}
        for mode, got in quiet.items():
            print(f"{'quiet, no training, ' + mode + ' (baseline)':58} {q[mode]:15.3f} {min(got):8.3f} {1:9.2f}   "
                  + " ".join(f"{x:.3f}" for x in got))
        for name, got in hop_s.items():
            m = statistics.median(got)
            mode = next(md for md in modes if name.endswith(md))
            print(f"{'beside training, ' + name:58} {m:15.3f} {min(got):8.3f} {m / q[mode]:9.2f}   "
                  + " ".join(f"{x:.3f}" for x in got))
        print()
        for mode in modes:
            user, system = (statistics.median(c[i] for c in quiet_cpu[mode]) for i in (0, 1))
            c = statistics.median(sum(x) for x in quiet_cpu[mode])
            left = max(0.0, c - (cores - threads) * 1.5 * q[mode])  # what the loop's free cores cannot take
            floor = left / (threads * 1.5 * q[mode])
            print(f"promotion CPU, quiet, {mode} (this process, median): {c:.3f} s (user {user:.3f}, system "
                  f"{system:.3f}) for "
                  f"{nbytes / 2**30:.3f} GiB; within 1.5 x its quiet time ({1.5 * q[mode]:.2f} s), with "
                  f"{cores - threads} of {cores} cores free of the loop, that is {floor:.1%} of the loop's cores, "
                  f"the least it loses while both goals hold")
        print(load_line(load0))
        mode = next(md for md in modes if default.endswith(md))
        slow, ratio = 1 - statistics.median(beside[default]) / a, statistics.median(hop_s[default]) / q[mode]
        print(f"goal ({default}): training slowdown <= 5 % -> {slow:.1%}, {'MET' if slow <= 0.05 else 'NOT MET'}; "
              f"promotion <= 1.5 x quiet -> {ratio:.2f} x, {'MET' if ratio <= 1.5 else 'NOT MET'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
