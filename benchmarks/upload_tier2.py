"""Benchmark: upload a checkpoint part Tier 1 -> Tier 2 (S3) with ``copy_part`` beside boto3's
``upload_file`` with default settings, both against the same moto S3 server started here,
several rounds, medians, ratios, and client CPU seconds per GB (moto itself is slow, about
50-100 MB/s here, so wall time mostly measures moto; CPU per GB measures our client).

Ours per file: multipart with per-part CRC32C, full-object CRC32C checked client-side before
CompleteMultipartUpload (If-None-Match), then HeadObject(ChecksumMode=ENABLED) compared with
the manifest; manifest object last. boto3 ``upload_file``: no end-to-end check. Not in CI.

    .venv/bin/python benchmarks/upload_tier2.py [--files 4] [--file-mib 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt.local_stack import start_moto, stop_process
from core.manifest_build import build_manifest, write_manifest
from core.storage.fs import LocalStore
from core.storage.s3 import S3Store
from core.transfer import copy_part

RUN, STEP = "bench", 2000
PREFIX = f"{RUN}/step-{STEP:08d}"


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--parallelism", type=int, default=4)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")

    import boto3

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-s3-"))
    moto, endpoint = start_moto(work / "moto.log", bucket="bench")
    try:
        folder = work / PREFIX
        folder.mkdir(parents=True)
        for i in range(args.files):
            with open(folder / f"shard-{i:03d}.bin", "wb") as fh:
                fh.writelines(os.urandom(2**20) for _ in range(args.file_mib))
        m = build_manifest(folder, RUN, STEP)
        write_manifest(folder, m)
        nbytes = m.total_bytes
        plain = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        t1 = LocalStore(work, 1)
        ours_store = S3Store("s3://bench/ours", 2, endpoint_url=endpoint, multipart_threshold=args.chunk_mib * 2**20,
                             chunk_bytes=args.chunk_mib * 2**20, max_concurrency=args.concurrency)

        def ours():
            copy_part(t1, PREFIX, ours_store, PREFIX, m, parallelism=args.parallelism)

        def boto_defaults():
            for f in m.files:
                plain.upload_file(str(folder / f.path), "bench", f"plain/{PREFIX}/{f.path}")

        def clean():
            ours_store.delete_prefix(RUN)
            for page in plain.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="plain/"):
                for o in page.get("Contents", []):
                    plain.delete_object(Bucket="bench", Key=o["Key"])

        contenders = {"boto3 upload_file (defaults)": boto_defaults, "ours: copy_part -> S3 (verified)": ours}
        wall: dict[str, list[float]] = {k: [] for k in contenders}
        cpu: dict[str, list[float]] = {k: [] for k in contenders}
        for r in range(args.rounds):
            for name in (contenders if r % 2 == 0 else list(reversed(list(contenders)))):
                clean()
                c0, t0 = cpu_seconds(), time.perf_counter()
                contenders[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(cpu_seconds() - c0)
        base_w = statistics.median(wall["boto3 upload_file (defaults)"])
        base_c = statistics.median(cpu["boto3 upload_file (defaults)"])
        gb = nbytes / 1e9
        print(f"part: {nbytes / 2**20:.0f} MiB in {len(m.files)} files to moto at {endpoint}, {args.rounds} rounds; "
              f"ours: chunk {args.chunk_mib} MiB, {args.concurrency} parts in flight, {args.parallelism} files at once")
        print(f"{'contender':34} {'median s':>9} {'MB/s':>7} {'x boto3':>8} {'CPU s/GB':>9} {'x boto3':>8}")
        for name in contenders:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            print(f"{name:34} {w:9.2f} {nbytes / w / 1e6:7.1f} {w / base_w:8.2f} {c / gb:9.2f} {c / base_c:8.2f}")
        print(f"load average (1 min) at start/end: {load0:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        ours_store.close()
    finally:
        stop_process(moto)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
