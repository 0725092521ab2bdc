"""Benchmark: upload a checkpoint part Tier 1 -> Tier 2 (S3) with ``copy_part`` beside boto3's
``upload_file`` with default settings, both against the same moto S3 server (started here unless ``--s3-endpoint``
names one), several rounds, medians, ratios, and client CPU seconds per GB (moto itself is slow, about
50-100 MB/s here, so wall time mostly measures moto; CPU per GB measures our client).

Ours per file: multipart with per-part CRC32C, full-object CRC32C checked client-side before
CompleteMultipartUpload (If-None-Match), then HeadObject(ChecksumMode=ENABLED) compared with
the manifest; manifest object last. boto3 ``upload_file``: no end-to-end check. Full size by hand;
CI runs only ``--smoke``.

    .venv/bin/python benchmarks/upload_tier2.py [--files 4] [--file-mib 64] [--rounds 3]
    .venv/bin/python benchmarks/upload_tier2.py --smoke [--s3-endpoint URL]    # 2 files of 1 MiB, one round
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, load_line, parse, ratio, run_rounds, s3_bucket, table
from core.manifest_build import build_manifest, write_manifest
from core.storage.local import LocalStore
from core.storage.s3 import S3Store
from core.transfer import copy_part

RUN, STEP = "bench", 2000
PREFIX = f"{RUN}/step-{STEP:08d}"
SMOKE = {"files": 2, "file_mib": 1, "chunk_mib": 5}  # 5 MiB: S3's smallest multipart part


def main() -> None:
    ap = bench_parser(__doc__, rounds=3, s3_endpoint=True)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--parallelism", type=int, default=4)
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-s3-"))
    try:
        with s3_bucket(args.s3_endpoint, work / "moto.log") as (endpoint, bucket):
            bench(args, work, endpoint, bucket)
        print(load_line(load0))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(args, work: Path, endpoint: str, bucket: str) -> None:
    import boto3

    folder = work / PREFIX
    folder.mkdir(parents=True)
    for i in range(args.files):
        with open(folder / f"shard-{i:03d}.bin", "wb") as fh:
            fh.writelines(os.urandom(2**20) for _ in range(args.file_mib))
    m = build_manifest(folder, RUN, STEP)
    write_manifest(folder, m)
    plain = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    t1 = LocalStore(work, 1)
    ours_store = S3Store(f"s3://{bucket}/ours", 2, endpoint_url=endpoint, multipart_threshold=args.chunk_mib * 2**20,
                         chunk_bytes=args.chunk_mib * 2**20, max_concurrency=args.concurrency)

    def ours():
        copy_part(t1, PREFIX, ours_store, PREFIX, m, parallelism=args.parallelism)

    def boto_defaults():
        for f in m.files:
            plain.upload_file(str(folder / f.path), bucket, f"plain/{PREFIX}/{f.path}")

    def clean(_name: str) -> None:
        ours_store.delete_prefix(RUN)
        for page in plain.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="plain/"):
            for o in page.get("Contents", []):
                plain.delete_object(Bucket=bucket, Key=o["Key"])

    base = "boto3 upload_file (defaults)"
    try:
        wall, cpu = run_rounds({base: boto_defaults, "ours: copy_part -> S3 (verified)": ours}, args.rounds,
                               before=clean)
    finally:
        ours_store.close()
    print(f"part: {m.total_bytes / 2**20:.0f} MiB in {len(m.files)} files to {endpoint}, {args.rounds} rounds; "
          f"ours: chunk {args.chunk_mib} MiB, {args.concurrency} parts in flight, {args.parallelism} files at once")
    table("Tier 1 -> Tier 2 upload", wall, base, nbytes=m.total_bytes, cpu=cpu)
    print(f"ratio: ours / boto3 upload_file = {ratio(wall, 'ours: copy_part -> S3 (verified)', base):.2f} x wall, "
          f"{ratio(cpu, 'ours: copy_part -> S3 (verified)', base):.2f} x client CPU")


if __name__ == "__main__":
    main()
