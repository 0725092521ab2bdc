"""Benchmark: restore a 1 GiB, 64-shard checkpoint with ``restore_checkpoint`` (catalog lookup,
every file checked against the manifest while fetched, fsync, read back, atomic publish),
beside the plain copies of the same bytes, in the same run, several rounds, medians and ratios.

- from Tier 1 (a local folder) beside ``cp -r`` of the same folder (target: <= 1.3 x) and
  ``cp -r && sync`` (ours fsyncs every file before it publishes the folder; ``cp -r`` leaves
  the bytes in the page cache);
- from Tier 2 (moto's S3 server on loopback, started here unless ``--s3-endpoint`` names one)
  beside boto3 ``download_file`` of the same objects from the same endpoint, one object after
  the other (boto3's own ranged, threaded download of each) and 4 objects at a time (the
  parallelism our restore uses).

The checkpoint is written to Tier 0 and promoted through the real pipeline (as a milestone,
so it reaches Tier 2). moto's server is itself the bottleneck on Tier 2 (50-100 MB/s here),
so the Tier 2 ratio says how much we add on top of the same endpoint. Best-of-rounds and CPU
seconds per GB are printed beside the medians: both are steadier than a median of wall times
when other work shares the machine. Full size by hand; CI runs only ``--smoke``.

    .venv/bin/python benchmarks/restore.py [--gib 1] [--shards 64] [--rounds 5] [--s3-rounds 3]
    .venv/bin/python benchmarks/restore.py --smoke [--s3-endpoint URL]    # 4 MiB, 4 shards, one round
"""

from __future__ import annotations

import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, parse, run_rounds, s3_bucket, table, write_shards
from core.layout import checkpoint_prefix
from core.manifest_build import build_manifest, write_manifest
from core.settings import RetentionPolicy, load_settings
from db.catalog import Catalog, upgrade
from flows.common import plain_steps
from flows.promote import promote
from tasks.restore import restore_checkpoint

RUN, STEP = "bench", 1000
SMOKE = {"gib": 4 / 1024, "shards": 4, "s3_rounds": 1}


def main() -> None:
    ap = bench_parser(__doc__, rounds=5, s3_endpoint=True)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--s3-rounds", type=int, default=3, help="rounds from Tier 2 (moto is slow)")
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = parse(ap, SMOKE)

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-restore-", dir=args.dir))
    try:
        with s3_bucket(args.s3_endpoint, work / "moto.log") as (endpoint, bucket):
            bench(args, work, endpoint, bucket)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class PoolFull(logging.Handler):
    """Counts urllib3's "Connection pool is full, discarding connection" warnings: each is a
    connection opened beyond the client's pool and thrown away after one request."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "Connection pool is full" in record.getMessage()


def bench(args, work: Path, endpoint: str, bucket: str) -> None:
    import boto3
    from botocore.config import Config

    settings = load_settings(data_dir=work / "data", node="bench-node", tier2_url=f"s3://{bucket}/ckpt",
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
    print(f"checkpoint: {nbytes / 2**30:.3f} GiB in {nfiles} files (manifest included), "
          f"parallelism {args.parallelism}, buffer {settings.io_buffer_bytes >> 20} MiB")

    dest = work / "restored"
    # download_file runs up to 10 ranged GETs per object (TransferConfig's default), so
    # ``parallelism`` objects at a time need that many connections, not botocore's default 10
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=Config(max_pool_connections=10 * args.parallelism))
    pool_full = PoolFull()
    logging.getLogger("urllib3.connectionpool").addHandler(pool_full)
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="ckpt/")
            for o in page.get("Contents", [])]

    def ours(tier: int):
        return lambda: restore_checkpoint(settings, RUN, dest, step=STEP, preference=(tier,), fallback=False)

    def download(key: str) -> None:
        client.download_file(bucket, key, str(dest / key.rsplit("/", 1)[-1]))

    def boto_sequential():
        dest.mkdir()
        for key in keys:
            download(key)

    def boto_parallel():
        dest.mkdir()
        with ThreadPoolExecutor(args.parallelism) as pool:
            list(pool.map(download, keys))

    def clean(_name: str) -> None:
        shutil.rmtree(dest, ignore_errors=True)

    subprocess.run(["cat", *map(str, tier1.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm
    t1, c1 = run_rounds({
        "cp -r (Tier 1 folder)": lambda: subprocess.run(["cp", "-r", str(tier1), str(dest)], check=True),
        "cp -r && sync": lambda: subprocess.run(f"cp -r '{tier1}' '{dest}' && sync", shell=True, check=True),
        "ours: restore from Tier 1": ours(1)}, args.rounds, before=clean, sync=True)
    base1 = table("Tier 1 -> local folder", t1, "cp -r (Tier 1 folder)", nbytes=nbytes, cpu=c1)
    med1 = statistics.median(t1["ours: restore from Tier 1"])
    r1, r1s = med1 / base1, med1 / statistics.median(t1["cp -r && sync"])
    print(f"target: restore from Tier 1 <= 1.3 x cp -r -> {r1:.2f} x, {'MET' if r1 <= 1.3 else 'NOT MET'} "
          f"({r1s:.2f} x cp -r && sync; ours is durable before it returns, cp -r is not)")

    parallel = f"boto3 download_file, {args.parallelism} at a time"
    t2, c2 = run_rounds({"boto3 download_file, one at a time": boto_sequential, parallel: boto_parallel,
                         "ours: restore from Tier 2": ours(2)}, args.s3_rounds, before=clean, sync=True)
    base2 = table(f"Tier 2 ({endpoint}) -> local folder", t2, "boto3 download_file, one at a time",
                  nbytes=nbytes, cpu=c2)
    med_ours = statistics.median(t2["ours: restore from Tier 2"])
    print(f"ratios: ours / download_file one at a time = {med_ours / base2:.2f} x, "
          f"ours / download_file {args.parallelism} at a time = {med_ours / statistics.median(t2[parallel]):.2f} x")
    print(f"'Connection pool is full' warnings during the Tier 2 rounds: {pool_full.count}")


if __name__ == "__main__":
    main()
