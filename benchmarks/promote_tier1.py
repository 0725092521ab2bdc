"""Benchmark: promote a 1 GiB, 64-shard safetensors checkpoint Tier 0 -> Tier 1, verified,
beside ``cp -r`` of the same folder (the baseline), ``cp -r && sync`` and ``cp -r`` followed
by ``sha256sum`` of the copy, measured in the same run, several rounds, medians and ratios
(plus best-of-rounds, steadier when other work shares the machine).

What "ours" does per file: read once -> CRC32C against the manifest -> write to a staging
name -> fsync -> read back and compare -> link into place -> fsync the folder; manifest last.
``cp -r`` does none of the checks and no fsync. Full size by hand; CI runs only ``--smoke``.

    .venv/bin/python benchmarks/promote_tier1.py [--gib 1] [--shards 64] [--rounds 5] [--dir /tmp]
    .venv/bin/python benchmarks/promote_tier1.py --smoke    # 4 MiB, 4 shards, one round
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, load_line, parse, run_rounds, table, write_shards
from core.manifest_build import build_manifest, write_manifest
from core.storage.local import LocalStore
from core.transfer import copy_part, verify_part

RUN, STEP = "bench", 1000
PREFIX = f"{RUN}/step-{STEP:08d}"
SMOKE = {"gib": 4 / 1024, "shards": 4}


def main() -> None:
    ap = bench_parser(__doc__, rounds=5)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--buffer-mib", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        t0_root, t1_root = work / "tier0", work / "tier1"
        src = t0_root / PREFIX
        write_shards(src, int(args.gib * 2**30), args.shards)
        t_build = time.perf_counter()
        m = build_manifest(src, RUN, STEP, parallelism=args.parallelism)
        t_build = time.perf_counter() - t_build
        write_manifest(src, m)
        nbytes = m.total_bytes
        buf = args.buffer_mib * 2**20
        t0, t1 = LocalStore(t0_root, 0, buffer_bytes=buf), LocalStore(t1_root, 1, buffer_bytes=buf)
        cp_dst = work / "cp"

        def ours():
            copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=args.parallelism)

        def ours_plus_verify():
            ours()
            verify_part(t1, PREFIX, m, parallelism=args.parallelism, buffer_bytes=buf)

        def clean(_name: str) -> None:
            shutil.rmtree(cp_dst, ignore_errors=True)
            shutil.rmtree(t1_root, ignore_errors=True)

        contenders = {
            "cp -r": lambda: subprocess.run(["cp", "-r", str(src), str(cp_dst)], check=True),
            "cp -r && sync": lambda: subprocess.run(f"cp -r '{src}' '{cp_dst}' && sync", shell=True, check=True),
            "cp -r + sha256sum": lambda: subprocess.run(
                f"cp -r '{src}' '{cp_dst}' && sha256sum '{cp_dst}'/* > /dev/null", shell=True, check=True),
            "ours: copy_part (verified)": ours,
            "ours: copy_part + verify_part": ours_plus_verify,
        }
        subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm
        times, _ = run_rounds(contenders, args.rounds, before=clean, sync=True)
        print(f"checkpoint: {nbytes / 2**30:.3f} GiB in {len(m.files)} files, {args.rounds} rounds, "
              f"parallelism {args.parallelism}, buffer {args.buffer_mib} MiB")
        print(f"manifest build (CRC32C of Tier 0, {args.parallelism} threads): {t_build:.2f} s "
              f"({nbytes / t_build / 1e9:.2f} GB/s)")
        base = table("Tier 0 -> Tier 1", times, "cp -r", nbytes=nbytes)
        print(load_line(load0))
        ours_med = statistics.median(times["ours: copy_part (verified)"])
        met = "MET" if ours_med <= 1.3 * base else "NOT MET"
        print(f"target: ours <= 1.3 x cp -r -> {ours_med / base:.2f} x, {met}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
