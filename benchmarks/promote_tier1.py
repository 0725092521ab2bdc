"""Benchmark: promote a 1 GiB, 64-shard safetensors checkpoint Tier 0 -> Tier 1, verified,
beside ``cp -r`` of the same folder (the baseline), ``cp -r && sync`` and ``cp -r`` followed
by ``sha256sum`` of the copy, measured in the same run, several rounds, medians and ratios
(plus best-of-rounds, steadier when other work shares the machine).

What "ours" does per file: read once -> CRC32C against the manifest -> write to a staging
name -> fsync -> read back and compare -> link into place -> fsync the folder; manifest last.
``cp -r`` does none of the checks and no fsync. Not run in CI.

    .venv/bin/python benchmarks/promote_tier1.py [--gib 1] [--shards 64] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.manifest_build import build_manifest, write_manifest
from core.storage.fs import LocalStore
from core.transfer import copy_part, verify_part

RUN, STEP = "bench", 1000
PREFIX = f"{RUN}/step-{STEP:08d}"


def make_checkpoint(root: Path, total_bytes: int, shards: int) -> Path:
    folder = root / PREFIX
    folder.mkdir(parents=True)
    per = total_bytes // shards // 4  # float32 elements per shard
    rng = np.random.default_rng(0)
    wm = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layer{i}.weight": rng.random(per, dtype=np.float32)}, str(folder / name))
        wm[f"layer{i}.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return folder


def timed(fn) -> float:
    subprocess.run(["sync"], check=True)  # no dirty pages from the last round in this one
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--buffer-mib", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        t0_root, t1_root = work / "tier0", work / "tier1"
        src = make_checkpoint(t0_root, int(args.gib * 2**30), args.shards)
        t_build = time.perf_counter()
        m = build_manifest(src, RUN, STEP, parallelism=args.parallelism)
        t_build = time.perf_counter() - t_build
        write_manifest(src, m)
        nbytes = m.total_bytes
        t0, t1 = LocalStore(t0_root, 0), LocalStore(t1_root, 1)
        cp_dst = work / "cp"
        buf = args.buffer_mib * 2**20

        def ours():
            copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=args.parallelism, buffer_bytes=buf)

        def ours_plus_verify():
            ours()
            verify_part(t1, PREFIX, m, parallelism=args.parallelism, buffer_bytes=buf)

        contenders = {
            "cp -r": lambda: subprocess.run(["cp", "-r", str(src), str(cp_dst)], check=True),
            "cp -r && sync": lambda: subprocess.run(f"cp -r '{src}' '{cp_dst}' && sync", shell=True, check=True),
            "cp -r + sha256sum": lambda: subprocess.run(
                f"cp -r '{src}' '{cp_dst}' && sha256sum '{cp_dst}'/* > /dev/null", shell=True, check=True),
            "ours: copy_part (verified)": ours,
            "ours: copy_part + verify_part": ours_plus_verify,
        }
        times: dict[str, list[float]] = {k: [] for k in contenders}
        timed(lambda: subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL))  # warm
        for r in range(args.rounds):
            names = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in names:
                shutil.rmtree(cp_dst, ignore_errors=True)
                shutil.rmtree(t1_root, ignore_errors=True)
                times[name].append(timed(contenders[name]))
        base = statistics.median(times["cp -r"])
        print(f"checkpoint: {nbytes / 2**30:.2f} GiB in {len(m.files)} files, {args.rounds} rounds, "
              f"parallelism {args.parallelism}, buffer {args.buffer_mib} MiB")
        print(f"manifest build (CRC32C of Tier 0, {args.parallelism} threads): {t_build:.2f} s "
              f"({nbytes / t_build / 1e9:.2f} GB/s)")
        best = min(times["cp -r"])
        print(f"{'contender':34} {'median s':>9} {'GB/s':>7} {'x cp -r':>8} {'best s':>7} {'x cp -r':>8}   rounds")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:34} {med:9.3f} {nbytes / med / 1e9:7.2f} {med / base:8.2f} {min(ts):7.3f} "
                  f"{min(ts) / best:8.2f}   " + " ".join(f"{t:.2f}" for t in ts))
        print(f"load average (1 min) at start/end: {load0:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        met = statistics.median(times['ours: copy_part (verified)']) <= 1.3 * base
        print(f"target: ours <= 1.3 x cp -r -> {'MET' if met else 'NOT MET'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
