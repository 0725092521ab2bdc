"""Benchmark: restore a 1 GiB, 64-shard checkpoint with ``restore_checkpoint`` (catalog lookup,
every file checked against the manifest while fetched, fsync, read back, atomic publish),
beside the plain copies of the same bytes, in the same run, several rounds, medians and ratios.

- from Tier 1 (a local folder) beside ``cp -r`` of the same folder (target: <= 1.3 x) and
  ``cp -r && sync`` (ours fsyncs every file before it publishes the folder; ``cp -r`` leaves
  the bytes in the page cache);
- from Tier 2 (moto's S3 server on loopback, started here) beside boto3 ``download_file`` of the
  same objects from the same endpoint, one object after the other (boto3's own ranged, threaded
  download of each) and 4 objects at a time (the parallelism our restore uses).

The checkpoint is written to Tier 0 and promoted through the real pipeline (as a milestone,
so it reaches Tier 2). moto's server is itself the bottleneck on Tier 2 (50-100 MB/s here),
so the Tier 2 ratio says how much we add on top of the same endpoint. Best-of-rounds and CPU
seconds per GB are printed beside the medians: both are steadier than a median of wall times
when other work shares the machine. Not run in CI.

    .venv/bin/python benchmarks/restore.py [--gib 1] [--shards 64] [--rounds 5] [--s3-rounds 3]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt.local_stack import start_moto, stop_process

RUN, STEP = "bench", 1000


def write_shards(folder: Path, total_bytes: int, shards: int) -> None:
    folder.mkdir(parents=True)
    per = total_bytes // shards // 4
    rng = np.random.default_rng(0)
    for i in range(shards):
        save_file({f"layer{i}.weight": rng.random(per, dtype=np.float32)},
                  str(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))


def cpu_seconds() -> float:
    """CPU of this process (all threads) and of its finished children (cp): steadier than wall
    time when other work shares the machine. moto's server is not counted (it still runs)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``fn``."""
    subprocess.run(["sync"], check=True)  # no dirty pages from the last round in this one
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def table(title: str, nbytes: int, times: dict[str, list[float]], cpu: dict[str, list[float]],
          base_name: str) -> float:
    base, best = statistics.median(times[base_name]), min(times[base_name])
    base_cpu = statistics.median(cpu[base_name])
    print(f"\n{title}")
    print(f"{'contender':40} {'median s':>9} {'MB/s':>8} {'x base':>7} {'best s':>7} {'x base':>7} "
          f"{'CPU s/GB':>9} {'x base':>7}   rounds (s)")
    for name, ts in times.items():
        med, med_cpu = statistics.median(ts), statistics.median(cpu[name])
        print(f"{name:40} {med:9.3f} {nbytes / med / 1e6:8.1f} {med / base:7.2f} {min(ts):7.3f} {min(ts) / best:7.2f} "
              f"{med_cpu / (nbytes / 1e9):9.2f} {med_cpu / base_cpu if base_cpu else 0:7.2f}   "
              + " ".join(f"{t:.2f}" for t in ts))
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="rounds from Tier 1")
    ap.add_argument("--s3-rounds", type=int, default=3, help="rounds from Tier 2 (moto is slow)")
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = ap.parse_args()

    import os

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(k, "testing")
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-restore-", dir=args.dir))
    moto, endpoint = start_moto(work / "moto.log", bucket="bench")
    try:
        import boto3

        from core.manifest_build import build_manifest, write_manifest
        from core.settings import RetentionPolicy, load_settings
        from core.storage.base import checkpoint_prefix
        from db.catalog import Catalog, upgrade
        from flows.common import plain_steps
        from flows.promote import promote
        from tasks.restore import restore_checkpoint

        settings = load_settings(data_dir=work / "data", node="bench-node", tier2_url="s3://bench/ckpt",
                                 s3_endpoint_url=endpoint, copy_parallelism=args.parallelism,
                                 retention_tier0=RetentionPolicy(enabled=False),
                                 retention_tier1=RetentionPolicy(enabled=False))
        upgrade(settings.catalog_url)
        prefix = checkpoint_prefix(RUN, STEP)
        src = Path(settings.tier0_url) / prefix
        write_shards(src, int(args.gib * 2**30), args.shards)
        write_manifest(src, build_manifest(src, RUN, STEP, kind="milestone", node=settings.node))
        with Catalog(settings.catalog_url) as cat:
            cat.ensure_run(RUN, actor="bench")
        t0 = time.perf_counter()
        promote(settings, RUN, STEP, steps=plain_steps(), actor="bench")
        print(f"promoted to tiers 1 and 2 in {time.perf_counter() - t0:.1f} s")
        tier1 = Path(settings.tier1_url) / prefix
        nbytes = sum(p.stat().st_size for p in tier1.iterdir())
        nfiles = len(list(tier1.iterdir()))
        print(f"checkpoint: {nbytes / 2**30:.2f} GiB in {nfiles} files (manifest included), "
              f"parallelism {args.parallelism}, buffer {settings.io_buffer_bytes >> 20} MiB")

        dest = work / "restored"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="ckpt/")
                for o in page.get("Contents", [])]

        def ours(tier: int):
            return lambda: restore_checkpoint(settings, RUN, dest, step=STEP, preference=(tier,), fallback=False)

        def download(key: str) -> None:
            client.download_file("bench", key, str(dest / key.rsplit("/", 1)[-1]))

        def boto_sequential():
            dest.mkdir()
            for key in keys:
                download(key)

        def boto_parallel():
            dest.mkdir()
            with ThreadPoolExecutor(args.parallelism) as pool:
                list(pool.map(download, keys))

        def run(contenders: dict, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
            times: dict[str, list[float]] = {k: [] for k in contenders}
            cpu: dict[str, list[float]] = {k: [] for k in contenders}
            for r in range(rounds):
                for name in (list(contenders) if r % 2 == 0 else list(reversed(contenders))):
                    shutil.rmtree(dest, ignore_errors=True)
                    wall, used = timed(contenders[name])
                    times[name].append(wall)
                    cpu[name].append(used)
            return times, cpu

        subprocess.run(["cat", *map(str, tier1.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm
        t1, c1 = run({"cp -r (Tier 1 folder)": lambda: subprocess.run(["cp", "-r", str(tier1), str(dest)], check=True),
                  "cp -r && sync": lambda: subprocess.run(f"cp -r '{tier1}' '{dest}' && sync", shell=True, check=True),
                  "ours: restore from Tier 1": ours(1)}, args.rounds)
        base1 = table("Tier 1 -> local folder", nbytes, t1, c1, "cp -r (Tier 1 folder)")
        med1 = statistics.median(t1["ours: restore from Tier 1"])
        r1, r1s = med1 / base1, med1 / statistics.median(t1["cp -r && sync"])
        print(f"target: restore from Tier 1 <= 1.3 x cp -r -> {r1:.2f} x, {'MET' if r1 <= 1.3 else 'NOT MET'} "
              f"({r1s:.2f} x cp -r && sync; ours is durable before it returns, cp -r is not)")

        t2, c2 = run({"boto3 download_file, one at a time": boto_sequential,
                  f"boto3 download_file, {args.parallelism} at a time": boto_parallel,
                  "ours: restore from Tier 2": ours(2)}, args.s3_rounds)
        base2 = table(f"Tier 2 (moto at {endpoint}) -> local folder", nbytes, t2, c2,
                      "boto3 download_file, one at a time")
        med_ours = statistics.median(t2["ours: restore from Tier 2"])
        med_par = statistics.median(t2[f"boto3 download_file, {args.parallelism} at a time"])
        print(f"ratios: ours / download_file one at a time = {med_ours / base2:.2f} x, "
              f"ours / download_file {args.parallelism} at a time = {med_ours / med_par:.2f} x")
    finally:
        stop_process(moto)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
