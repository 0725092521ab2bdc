"""Early writeback: a file written at a network's pace, then fsynced, with and without handing
its bytes to the kernel to write as they land (``core/storage/writeback.py``), in the same rounds.

Each contender writes ``--mib`` MiB in 256 KiB writes (as a fetch lands a GET's body), paced
at ``--rate`` MB/s, then fsyncs; its time is the first write to the end of the fsync, and the
time the fsync alone took is printed beside it (what a resume waits for after its last byte).
Contenders: no early writeback (the baseline: the fsync writes the whole file), and early
writeback every 1 MiB (``WRITEBACK_BYTES``) and every 4 MiB. The page cache is written back
(``os.sync``, untimed) before each.

    .venv/bin/python benchmarks/writeback.py [--mib 512] [--rate 400] [--rounds 5]
    .venv/bin/python benchmarks/writeback.py --smoke
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, load_line, parse, table
from core.storage import writeback

CHUNK = 256 * 1024
BASE = "no early writeback (fsync writes all)"
SMOKE = {"mib": 4, "rate": 200.0}


def write_paced(path: Path, nbytes: int, rate: float, every: int | None) -> tuple[float, float]:
    """(write + fsync seconds, fsync seconds) of one file written at ``rate`` bytes/s."""
    data = os.urandom(CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        wb = writeback.Writeback(fd, every=every) if every else None
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            os.pwrite(fd, data, done)
            done += CHUNK
            if wb is not None:
                wb.wrote(CHUNK)
            if (wait := t0 + done / rate - time.perf_counter()) > 0:
                time.sleep(wait)
        t1 = time.perf_counter()
        os.fsync(fd)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        path.unlink()
    return t2 - t0, t2 - t1


def main() -> None:
    ap = bench_parser(__doc__, rounds=5)
    ap.add_argument("--mib", type=int, default=512, help="file size, MiB")
    ap.add_argument("--rate", type=float, default=400.0, help="write pace, MB/s (a fetch's arrival rate)")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: system temp)")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]
    contenders = {BASE: None, "early writeback every 1 MiB": writeback.WRITEBACK_BYTES,
                  "early writeback every 4 MiB": 4 * 1024 * 1024}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    fsyncs: dict[str, list[float]] = {k: [] for k in contenders}
    nbytes = args.mib * 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-writeback-", dir=args.dir) as d:
        names = list(contenders)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                os.sync()
                total, fsync = write_paced(Path(d) / "f", nbytes, args.rate * 1e6, contenders[name])
                times[name].append(total)
                fsyncs[name].append(fsync)
    print(f"{args.mib} MiB written in {CHUNK // 1024} KiB writes at {args.rate:g} MB/s, then fsynced")
    table("write + fsync", times, BASE, nbytes=nbytes)
    print("the fsync alone (median, best): " + ", ".join(
        f"{k}: {statistics.median(v):.3f} s, {min(v):.3f} s" for k, v in fsyncs.items()))
    print(load_line(load0))
    print(f"early writeback every 1 MiB: fsync {statistics.median(fsyncs[names[1]]):.3f} s against "
          f"{statistics.median(fsyncs[BASE]):.3f} s without (median)")


if __name__ == "__main__":
    main()
