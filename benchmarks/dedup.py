"""Benchmark: a fine-tune saving a frozen base and a small adapter, every checkpoint a milestone
(promoted to Tier 1 and archived to Tier 2 through the real pipeline), beside the plain path in
the same run: the same checkpoints with every byte changed at each save, which nothing can share,
so each is copied and uploaded whole, as before content was shared. The fine-tune is saved three
ways, each a site of its own: as two files (a framework's folder: base and adapter files), and
as tensors through ``CheckpointStager``, once told the base's names (``frozen=``) and once not
(it finds the unchanged tensors itself from its second save on, so it holds one base more: the
first save's, mixed with its adapter).

Each run has a site of its own (catalog, tiers, Tier 2 prefix). Printed: the bytes each tier
holds for the fine-tune (Tier 1: each inode under its root once, as the file system counts it;
Tier 2: every object under its prefix, shared contents and pointers included), the bound
``base + N x adapter``, the median time to durable per checkpoint after the first (the promote
call, archive included) of both runs, and whether every checkpoint restores to the bytes it
saved. The last line is the result:

    dedup: N checkpoints, tier 1 X GiB, tier 2 Y GiB, bound Z GiB (xR), durable per checkpoint A s vs plain B s

R is the larger tier's bytes over the bound (for the two files). Before it, the pretraining
case (every byte new): one file of the base's size copied to Tier 1 and uploaded to Tier 2 by
the stores with content sharing and without it, ``--rounds`` rounds with the order rotated,
medians and ratios; and the stager's write of ``--pretrain-mib`` of tensors that all changed
since its previous save (fsync included, as a save does) against the write before this change
(a copy of its loop is kept here): as a pretraining run's saves write now (each tensor hashed
as written, the shards' CRC32Cs combined from the tensors'), and as a save that hashes its
tensors first (a run's second save, a fine-tune's saves: what finds the unchanged tensors),
at least 5 rounds.
Full size by hand; CI runs only ``--smoke``.

    .venv/bin/python benchmarks/dedup.py [--base-mib 256] [--adapter-mib 4] [--checkpoints 20] [--pretrain-mib 1024]
    .venv/bin/python benchmarks/dedup.py --smoke [--s3-endpoint URL]    # 1 MiB base, 4 checkpoints
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.common import bench_parser, load_line, parse, ratio, run_rounds, s3_bucket, table
from ckpt.client import DEFAULT_SHARD_BYTES, CheckpointStager
from core import checksum, safetensors_writer as stw
from core.layout import checkpoint_prefix
from core.manifest_build import build_manifest, write_manifest
from core.settings import RetentionPolicy, load_settings
from core.storage.local import LocalStore
from core.storage.s3 import S3Store
from db.catalog import Catalog, upgrade
from flows.common import plain_steps
from flows.promote import promote
from tasks.restore import restore_checkpoint

FINE_TUNE, PLAIN = "finetune", "plain"  # each a run, and a site of its own
NAMED, FOUND = "finetune-named", "finetune-found"  # through the stager, with frozen= and without
SMOKE = {"base_mib": 1.0, "adapter_mib": 1 / 16, "checkpoints": 4, "pretrain_mib": 8.0}
MiB, GiB = 1 << 20, 1 << 30
TENSOR_BYTES = 16 * MiB  # the base's and the pretraining model's tensors


def main() -> None:
    ap = bench_parser(__doc__, rounds=3, s3_endpoint=True)
    ap.add_argument("--base-mib", type=float, default=256.0, help="the frozen base, saved unchanged every time")
    ap.add_argument("--adapter-mib", type=float, default=4.0, help="the adapter, new bytes at every save")
    ap.add_argument("--checkpoints", type=int, default=20)
    ap.add_argument("--pretrain-mib", type=float, default=1024.0, help="the pretraining model the stager writes")
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = parse(ap, SMOKE)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-dedup-", dir=args.dir) as tmp, \
            s3_bucket(args.s3_endpoint, Path(tmp) / "moto.log") as (endpoint, bucket):
        bench(args, Path(tmp), endpoint, bucket)


def save(settings, run: str, step: int, files: dict[str, bytes]) -> None:
    """Commit a milestone on Tier 0: the files, then the manifest built from them."""
    folder = Path(settings.tier0_url) / checkpoint_prefix(run, step)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    write_manifest(folder, build_manifest(folder, run, step, kind="milestone", node=settings.node))


def durable_times(settings, run: str, checkpoints: int,
                  files: Callable[[int], dict[str, bytes]]) -> tuple[list[float], int]:
    """Save and promote ``checkpoints`` milestones of ``run``; each promote call's seconds
    (the checkpoint durable on Tier 2 when it returns) and the bytes saved."""
    times, saved = [], 0
    for i in range(checkpoints):
        step = (i + 1) * 100
        content = files(i)
        saved += sum(map(len, content.values()))
        save(settings, run, step, content)
        t0 = time.perf_counter()
        result = promote(settings, run, step, steps=plain_steps(), actor="bench")
        times.append(time.perf_counter() - t0)
        assert result.durable, f"{run}/{step} did not become durable"
    return times, saved


def stager_times(settings, run: str, checkpoints: int, base: dict[str, np.ndarray], adapter_bytes: int, *,
                 name_frozen: bool) -> list[float]:
    """Save ``checkpoints`` milestones of ``run`` through the stager (the base's tensors and an
    adapter of new values), each promoted; each promote call's seconds."""
    rng, times = np.random.default_rng(1), []
    with CheckpointStager(run, settings=settings, announce=False, frozen=base if name_frozen else ()) as stager:
        for i in range(checkpoints):
            step = (i + 1) * 100
            stager.save(step, {**base, "adapter": rng.standard_normal(adapter_bytes // 4, dtype=np.float32)},
                        milestone=True)
            t0 = time.perf_counter()
            result = promote(settings, run, step, steps=plain_steps(), actor="bench")
            times.append(time.perf_counter() - t0)
            assert result.durable, f"{run}/{step} did not become durable"
    return times


def write_hashing_as_written(folder: str, arrays: dict[str, tuple[np.ndarray, str]]) -> None:
    """The stager's write before it hashed tensors first (a copy): each shard's CRC32C over its
    bytes as they are written, fsync of every shard, the index."""
    def write_shard(path: str, names: list[str]) -> tuple[int, str]:
        crc, size = 0, 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            def put(view: memoryview) -> None:
                nonlocal crc, size
                while view:
                    n = os.write(fd, view)
                    crc = checksum.update(crc, view[:n])
                    size += n
                    view = view[n:]

            put(memoryview(stw._header(names, arrays)))
            for name in names:
                data = arrays[name][0].data.cast("B")
                for start in range(0, len(data), checksum.DEFAULT_BUFFER_BYTES):
                    put(data[start:start + checksum.DEFAULT_BUFFER_BYTES])
        finally:
            os.close(fd)
        return size, checksum.to_hex(crc)

    groups = stw.plan_shards(arrays, DEFAULT_SHARD_BYTES)
    os.makedirs(folder)
    paths, weight_map = [], {}
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        paths.append(os.path.join(folder, fname))
        write_shard(paths[-1], names)
        weight_map.update(dict.fromkeys(names, fname))
    stw.fsync_all(paths)
    with open(os.path.join(folder, stw.INDEX_NAME), "xb") as fh:
        total = sum(a.nbytes for a, _ in arrays.values())
        fh.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode())
        fh.flush()
        os.fsync(fh.fileno())


def pretraining_save(args, work: Path) -> tuple[float, float]:
    """The stager's write of a model whose every tensor changed since the previous save, as
    before (hashing as written, the kept copy) and now: a pretraining run's saves hash as they
    write, per tensor; its second save (the first comparison) and a fine-tune's saves hash the
    tensors first. The ratios now / before of the medians (as written, hashed first)."""
    rng = np.random.default_rng(2)
    count = max(1, int(args.pretrain_mib * MiB) // TENSOR_BYTES)
    per = min(TENSOR_BYTES, int(args.pretrain_mib * MiB)) // 4
    arrays = {f"layers.{i}.weight": stw.as_host_array(rng.standard_normal(per, dtype=np.float32))
              for i in range(count)}
    nbytes = sum(a.nbytes for a, _ in arrays.values())
    out = str(work / "pretraining-save")
    threads = load_settings().copy_parallelism  # the stager's

    def every_tensor_changes(_name: str) -> None:
        shutil.rmtree(out, ignore_errors=True)
        for a, _ in arrays.values():
            a[0] += 1

    before, now = "write, hashing as written (before)", "write, hashing as written (now)"
    first = "write, tensors hashed first (now)"
    contenders = {
        before: lambda: write_hashing_as_written(out, arrays),
        now: lambda: stw.write_sharded(out, arrays, shard_bytes=DEFAULT_SHARD_BYTES),
        first: lambda: stw.write_sharded(out, arrays, shard_bytes=DEFAULT_SHARD_BYTES,
                                         crcs=stw.tensor_crcs(arrays, threads=threads)),
    }
    load = os.getloadavg()[0]
    wall, cpu = run_rounds(contenders, 1 if args.smoke else max(5, args.rounds), before=every_tensor_changes, sync=True)
    table(f"pretraining save: {count} tensors, {nbytes / MiB:g} MiB, every tensor changed, fsync "
          f"(hashed first on {threads} threads)", wall, before, nbytes=nbytes, cpu=cpu)
    print(load_line(load))
    shutil.rmtree(out, ignore_errors=True)
    return ratio(wall, now, before), ratio(wall, first, before)


def tier1_bytes(root: Path) -> int:
    """What the Tier 1 root holds on its file system (content store included): each inode once."""
    seen: dict[tuple[int, int], int] = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def tier2_bytes(endpoint: str, bucket: str, prefix: str) -> int:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return sum(o["Size"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
               for o in page.get("Contents", []))


def restored_bytes(settings, run: str, checkpoints: int, work: Path) -> int:
    """Restore every checkpoint of ``run`` (nearest tier) and count the bytes that came back."""
    total = 0
    for i in range(checkpoints):
        dest = work / "restored"
        restore_checkpoint(settings, run, dest, step=(i + 1) * 100, fallback=False, actor="bench")
        total += sum(p.stat().st_size for p in dest.rglob("*") if p.is_file() and p.name != "manifest.json")
        shutil.rmtree(dest)
    return total


def pretraining(args, work: Path, endpoint: str, bucket: str, size: int) -> tuple[float, float]:
    """The stores with and without sharing, each given a file of new bytes (written before each
    timed call, untimed): the ratios shared / plain of the median copy to Tier 1 and upload to
    Tier 2 (every file big enough to share)."""
    root = work / "pretraining"
    source = root / "source.bin"
    for name in ("plain", "shared"):
        (root / name).mkdir(parents=True)
    s3 = {"endpoint_url": endpoint, "range_bytes": min(size, 8 * MiB), "ranged_threshold": size}
    stores = {"tier 1, plain": LocalStore(root / "plain", 1),
              "tier 1, shared": LocalStore(root / "shared", 1, shared_content=True),
              "tier 2, plain": S3Store(f"s3://{bucket}/pretraining-plain", 2, **s3),
              "tier 2, shared": S3Store(f"s3://{bucket}/pretraining-shared", 2, shared_content=True, **s3)}
    calls = iter(range(1 << 30))
    crc = [""]

    def new_bytes(_name: str) -> None:
        data = os.urandom(size)
        source.write_bytes(data)
        crc[0] = checksum.hash_bytes(data)

    def put(store: LocalStore | S3Store) -> Callable[[], object]:
        def one() -> object:
            with open(source, "rb", buffering=0) as fh:
                return store.put_verified(f"file-{next(calls)}.bin", fh, size, crc[0])
        return one

    for tier in (1, 2):
        names = [f"tier {tier}, plain", f"tier {tier}, shared"]
        wall, _ = run_rounds({n: put(stores[n]) for n in names}, args.rounds, before=new_bytes)
        table(f"pretraining, tier {tier}: one file of {size / MiB:g} MiB, every byte new", wall, names[0], nbytes=size)
        if tier == 1:
            r1 = ratio(wall, names[1], names[0])
    for store in stores.values():
        store.close()
    return r1, ratio(wall, names[1], names[0])


def site(work: Path, name: str, endpoint: str, bucket: str):
    """Settings of a site of its own (catalog, tiers, Tier 2 prefix), with the run registered:
    what each tier holds is then the run's alone, content stores included."""
    settings = load_settings(data_dir=work / name, node="bench-node", tier2_url=f"s3://{bucket}/{name}",
                             s3_endpoint_url=endpoint, retention_tier0=RetentionPolicy(keep_last=1),
                             retention_tier1=RetentionPolicy(enabled=False),
                             retention_tier2=RetentionPolicy(enabled=False))
    upgrade(settings.catalog_url)
    with Catalog(settings.catalog_url) as cat:
        cat.ensure_run(name, actor="bench")
    return settings


def bench(args, work: Path, endpoint: str, bucket: str) -> None:
    n, base_bytes, adapter_bytes = args.checkpoints, int(args.base_mib * MiB), int(args.adapter_mib * MiB)
    ours, theirs = site(work, FINE_TUNE, endpoint, bucket), site(work, PLAIN, endpoint, bucket)
    named, found = site(work, NAMED, endpoint, bucket), site(work, FOUND, endpoint, bucket)
    load = os.getloadavg()[0]
    base = os.urandom(base_bytes)

    ft, saved = durable_times(ours, FINE_TUNE, n,
                              lambda i: {"base.bin": base, "adapter.bin": os.urandom(adapter_bytes)})
    plain, _ = durable_times(theirs, PLAIN, n,
                             lambda i: {"base.bin": os.urandom(base_bytes), "adapter.bin": os.urandom(adapter_bytes)})
    per = min(TENSOR_BYTES, base_bytes) // 4  # float32 tensors of the base's bytes
    weights = np.frombuffer(base, dtype=np.float32)
    tensors = {f"base.{i:03d}": weights[start:start + per] for i, start in enumerate(range(0, len(weights), per))}
    stager = {NAMED: stager_times(named, NAMED, n, tensors, adapter_bytes, name_frozen=True),
              FOUND: stager_times(found, FOUND, n, tensors, adapter_bytes, name_frozen=False)}

    pre1, pre2 = pretraining(args, work, endpoint, bucket, base_bytes)
    pre_save = pretraining_save(args, work)
    t1 = tier1_bytes(Path(ours.tier1_url))
    t2 = tier2_bytes(endpoint, bucket, f"{FINE_TUNE}/")
    bound = base_bytes + n * adapter_bytes
    back = restored_bytes(ours, FINE_TUNE, n, work)
    a, b = statistics.median(ft[1:] or ft), statistics.median(plain[1:] or plain)
    print(f"fine-tune durable per checkpoint (s): {' '.join(f'{t:.2f}' for t in ft)}")
    print(f"plain durable per checkpoint (s):     {' '.join(f'{t:.2f}' for t in plain)}")
    for run in (NAMED, FOUND):
        print(f"{run} durable per checkpoint (s): {' '.join(f'{t:.2f}' for t in stager[run])}")
    print(f"plain run holds: tier 1 {tier1_bytes(Path(theirs.tier1_url)) / GiB:.3f} GiB, "
          f"tier 2 {tier2_bytes(endpoint, bucket, f'{PLAIN}/') / GiB:.3f} GiB")
    print(f"bytes saved {saved}, bytes restored {back}: {'equal' if back == saved else 'DIFFERENT'}")
    print(f"targets: bytes per tier <= 1.1 x bound, durable after the first <= 0.2 x plain -> "
          f"{max(t1, t2) / bound:.2f} x, {a / b:.2f} x")
    for run, settings, how in ((NAMED, named, "frozen= named"), (FOUND, found, "found by the stager")):
        s1, s2 = tier1_bytes(Path(settings.tier1_url)), tier2_bytes(endpoint, bucket, f"{run}/")
        d = statistics.median(stager[run][1:] or stager[run])
        print(f"stager, {how}: tier 1 {s1 / GiB:.3f} GiB, tier 2 {s2 / GiB:.3f} GiB "
              f"(x{max(s1, s2) / bound:.2f} of the bound, x{max(s1, s2) / (bound + base_bytes):.2f} of the bound "
              f"+ one base), durable per checkpoint {d:.2f} s (x{d / b:.2f} of plain)")
    print(f"pretraining (every byte new): sharing costs x{pre1:.3f} on tier 1, x{pre2:.3f} on tier 2 "
          "of the stores without it (target: <= 1.02)")
    print(f"pretraining save (every tensor changes): x{pre_save[0]:.3f} of the write before (target: <= 1.02); "
          f"a save that hashes its tensors first (a run's second, a fine-tune's) x{pre_save[1]:.3f}")
    print(load_line(load))
    print(f"dedup: {n} checkpoints, tier 1 {t1 / GiB:.3f} GiB, tier 2 {t2 / GiB:.3f} GiB, "
          f"bound {bound / GiB:.3f} GiB (x{max(t1, t2) / bound:.2f}), "
          f"durable per checkpoint {a:.2f} s vs plain {b:.2f} s")


if __name__ == "__main__":
    main()
