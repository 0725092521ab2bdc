"""Writer stall of the training-side client against plain safetensors saves, same run.

Not part of CI. For one checkpoint of ``--mb`` MB (float32 layers of 4 MB, sharded at
``--shard-mb``), several rounds each of:
- baseline: ``safetensors.numpy.save_file`` of the same shards into a fresh folder (what a job
  without this project does; no checksum, no manifest, no fsync);
- baseline + fsync: the same, then fsync of every file (a durable local write);
- client foreground: ``CheckpointStager.save`` (CRC32C while writing, fsync, manifest, rename);
- client background: the stall of ``save(background=True)`` (host-memory snapshot only;
  its write then runs on a thread), for the first save (fresh memory) and from the second
  on (the snapshot buffers of the finished write are reused).
Medians are printed with ratios against the plain baseline. Events and the catalog are off
(``announce=False``): they never run on the training thread anyway.

    python benchmarks/client_stall.py --mb 512 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from safetensors.numpy import save_file

from ckpt.client import CheckpointStager
from core.safetensors_writer import as_host_array, plan_shards
from core.settings import load_settings


def tensors(mb: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i}": rng.standard_normal(1_000_000, dtype=np.float32) for i in range(max(1, mb // 4))}


def baseline(folder: Path, t: dict[str, np.ndarray], shard_bytes: int, fsync: bool) -> float:
    folder.mkdir(parents=True)
    groups = plan_shards({k: as_host_array(v) for k, v in t.items()}, shard_bytes)
    t0 = time.perf_counter()
    for i, names in enumerate(groups):
        path = folder / f"model-{i:05d}.safetensors"
        save_file({n: t[n] for n in names}, str(path))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="Tier 0 folder (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-stall-"))
    t = tensors(args.mb)
    shard = args.shard_mb * 1_000_000
    settings = load_settings(data_dir=root / "data", node="bench", catalog_url=f"sqlite:///{root}/c.db")
    res: dict[str, list[float]] = {"baseline": [], "baseline+fsync": [], "client": [],
                                   "client-background (first save)": [], "client-background": []}
    step = 0
    fg = CheckpointStager("bench", settings=settings, shard_bytes=shard, announce=False)
    bg = CheckpointStager("bench", settings=settings, shard_bytes=shard, announce=False, background=True)
    try:
        for r in range(args.rounds):
            res["baseline"].append(baseline(root / f"b{r}", t, shard, fsync=False))
            res["baseline+fsync"].append(baseline(root / f"f{r}", t, shard, fsync=True))
            step += 1
            res["client"].append(fg.save(step, t).stall_seconds)
            step += 1
            key = "client-background" if r else "client-background (first save)"
            res[key].append(bg.save(step, t).stall_seconds)  # steady state reuses the snapshot buffers
            bg.wait()  # training runs on; the write finishes before the next save
            for p in root.glob("[bf]*"):
                shutil.rmtree(p)
            shutil.rmtree(root / "data" / "tier0", ignore_errors=True)
    finally:
        fg.close()
        bg.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(res["baseline"])
    mb = sum(a.nbytes for a in t.values()) / 1e6
    print(f"checkpoint {mb:.0f} MB in {args.shard_mb} MB shards, {args.rounds} rounds, medians:")
    for name, xs in res.items():
        m = statistics.median(xs)
        print(f"  {name:<31} {m * 1000:8.1f} ms  {mb / m / 1000:6.2f} GB/s  x{m / base:5.2f} of baseline")


if __name__ == "__main__":
    main()
