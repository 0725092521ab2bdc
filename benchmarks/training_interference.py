"""Benchmark: a CPU-bound training loop beside a promotion, in the same run.

A training job (a separate process: torch matmuls on every core, as a job's compute would)
reports its step count every 0.1 s. Each round measures, in an order rotated every round:
- the loop's steps/s alone (a window of ``--window`` seconds);
- the loop's steps/s while a Tier 0 -> Tier 1 promotion (``tier1_hop``, the whole hop) runs
  beside it at the agent's default priority (``copy_nice`` 10, lowest best-effort I/O: the whole
  hop runs on a thread at that priority, ``core.transfer.run_at``), and the promotion's time;
- the same at ``copy_nice`` 5, and at the agent's own priority (``copy_nice`` 0, I/O unchanged);
and, with no training running, the promotion's quiet time and CPU (this process's user + system
time: the hop runs on its threads). Goals: the loop slows <= 5 % beside the promotion, and the
promotion takes <= 1.5 x its quiet time. The two pull against each other when the loop keeps every
core busy: what the promotion's CPU takes within 1.5 x its quiet time is the least the loop
loses, which the last lines print (the floor both goals together need).

    .venv/bin/python benchmarks/training_interference.py [--gib 1] [--rounds 3] [--window 4]
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
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    ap.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                    help="sync before each promotion (no writeback of the last one during it)")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]
    threads = os.cpu_count() or 1

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        hop = HopBench(work, args.gib, args.shards, args.parallelism)
        nbytes = hop.manifest.total_bytes
        ways = {"lowered (default: nice 10, I/O best-effort 7)": {"copy_nice": 10, "copy_io_class": "best-effort"},
                "nice 5, I/O best-effort 7": {"copy_nice": 5, "copy_io_class": "best-effort"},
                "agent's own priority (nice 0, I/O unchanged)": {"copy_nice": 0, "copy_io_class": "unchanged"}}

        cpu: list[tuple[float, float]] = []  # (user, system) seconds of each quiet promotion

        def promote(**prio: object) -> tuple[float, float, float]:
            hop.fresh(**prio)
            if args.sync:
                subprocess.run(["sync"], check=True)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            hop.promote()
            t1 = time.monotonic()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
            return t0, t1, t1 - t0

        hop.fresh()
        hop.promote()  # warm: imports, the source in the page cache
        quiet = [promote(**ways[next(iter(ways))])[2] for _ in range(args.rounds)]
        quiet_cpu = list(cpu)
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
                    t0, t1, took = promote(**ways[name])
                    time.sleep(0.25)  # the report after the promotion's end
                    beside[name].append(trainer.rate(t0, t1 + 0.15) if took > 0.3 else trainer.rate(t0, t0 + 0.3))
                    hop_s[name].append(took)
        finally:
            trainer.stop()

        a = statistics.median(alone)
        print(f"checkpoint: {nbytes / 2**30:.3f} GiB in {len(hop.manifest.files)} files; training loop: "
              f"{args.matrix}x{args.matrix} float32 matmuls on {threads} threads; {args.rounds} rounds")
        print(f"\n{'training loop':52} {'median steps/s':>15} {'best':>8} {'slowdown':>9}   rounds")
        print(f"{'alone (baseline)':52} {a:15.1f} {max(alone):8.1f} {0:8.1%}   "
              + " ".join(f"{x:.1f}" for x in alone))
        for name, got in beside.items():
            m = statistics.median(got)
            print(f"{'beside a promotion, copy ' + name:52} {m:15.1f} {max(got):8.1f} {1 - m / a:8.1%}   "
                  + " ".join(f"{x:.1f}" for x in got))
        q = statistics.median(quiet)
        print(f"\n{'promotion (whole hop)':52} {'median s':>15} {'best s':>8} {'x quiet':>9}   rounds")
        print(f"{'quiet, no training (baseline)':52} {q:15.3f} {min(quiet):8.3f} {1:9.2f}   "
              + " ".join(f"{x:.3f}" for x in quiet))
        for name, got in hop_s.items():
            m = statistics.median(got)
            print(f"{'beside training, copy ' + name:52} {m:15.3f} {min(got):8.3f} {m / q:9.2f}   "
                  + " ".join(f"{x:.3f}" for x in got))
        user, system = (statistics.median(c[i] for c in quiet_cpu) for i in (0, 1))
        floor = (user + system) / (threads * 1.5 * q)
        print(f"\npromotion CPU, quiet (this process: user + system, median): {user + system:.3f} s "
              f"(user {user:.3f}, system {system:.3f}) for {nbytes / 2**30:.3f} GiB")
        print(f"the least the loop loses while both goals hold: the promotion's CPU within 1.5 x its quiet time "
              f"({1.5 * q:.2f} s) on {threads} cores = {floor:.1%} (<= 5 % needs <= "
              f"{0.05 * threads * 1.5 * q:.3f} CPU s per promotion)")
        print(load_line(load0))
        lowered = next(iter(ways))
        slow, ratio = 1 - statistics.median(beside[lowered]) / a, statistics.median(hop_s[lowered]) / q
        print(f"goal: training slowdown <= 5 % -> {slow:.1%}, {'MET' if slow <= 0.05 else 'NOT MET'}; "
              f"promotion <= 1.5 x quiet -> {ratio:.2f} x, {'MET' if ratio <= 1.5 else 'NOT MET'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
