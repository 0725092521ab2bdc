"""Writer stall of the training-side client against plain safetensors saves, same run.

Full size by hand; CI runs only its ``--smoke`` form. For one checkpoint of ``--mb`` MB
(float32 layers of 4 MB, sharded at ``--shard-mb``), several rounds each of:
- baseline: ``safetensors.numpy.save_file`` of the same shards into a fresh folder (what a job
  without this project does; no checksum, no manifest, no fsync);
- baseline + fsync: the same, then fsync of every file (a durable local write);
- client foreground: ``CheckpointStager.save`` (CRC32C while writing, fsync, manifest, rename);
- client background: the stall of ``save(background=True)`` (host-memory snapshot only;
  its write then runs on a thread), for the first save (fresh memory) and from the second
  on (the snapshot buffers of the finished write are reused);
- the room check alone: what each save of tensors pays before it writes (``ensure_room``: the
  tensors' size and one ``statvfs`` of Tier 0), the mean of 100 calls per round.
Medians are printed with ratios against the plain baseline. Events and the catalog are off
(``announce=False``): they never run on the training thread anyway.

With torch installed, a second table for ``torch.distributed.checkpoint`` jobs (single process,
the same tensors as torch tensors), each the stall of the training loop:
- baseline: ``dcp.save`` (synchronous write, nothing committed or announced);
- ``dcp.async_save``: the call only (DCP's staging), its write then finishes on DCP's thread;
- ours: ``dcp.save`` + ``save(folder)`` (adopt the folder DCP wrote: CRC32C pass, manifest, rename);
- ours: ``async_save_and_commit`` (``ckpt.integrations.dcp``): the call only; DCP's write, then
  our commit and announcement, finish off the training thread before the next round.

    python benchmarks/client_stall.py --mb 512 --rounds 5
    python benchmarks/client_stall.py --smoke    # 8 MB, one round (no steady-state background row)
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

from benchmarks.common import Times, bench_parser, load_line, parse, ratio, table
from ckpt.client import CheckpointStager
from ckpt.integrations.dcp import async_save_and_commit
from ckpt.space import state_needed
from core.safetensors_writer import as_host_array, plan_shards
from core.settings import load_settings

SMOKE = {"mb": 8, "shard_mb": 4}


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


def room_check(stager: CheckpointStager, step: int, t: dict[str, np.ndarray], calls: int = 100) -> float:
    """Seconds per free-space check a save makes before writing (mean of ``calls``)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        stager.ensure_room(step, state_needed(t))
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = bench_parser(__doc__, rounds=5)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--dir", type=Path, default=None, help="Tier 0 folder (default: a temp dir)")
    ap.add_argument("--dcp", action=argparse.BooleanOptionalAction, default=True, help="the DCP table too")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-stall-"))
    t = tensors(args.mb)
    shard = args.shard_mb * 1_000_000
    settings = load_settings(data_dir=root / "data", node="bench", catalog_url=f"sqlite:///{root}/c.db")
    plain, fsynced, fore, first, back = ("safetensors save_file", "safetensors save_file + fsync",
                                         "ours: save", "ours: save(background), first save",
                                         "ours: save(background)")
    res: Times = {plain: [], fsynced: [], fore: [], first: [], back: []}
    room: list[float] = []
    step = 0
    fg = CheckpointStager("bench", settings=settings, shard_bytes=shard, announce=False)
    bg = CheckpointStager("bench", settings=settings, shard_bytes=shard, announce=False, background=True)
    try:
        for r in range(args.rounds):
            def save_fg() -> None:
                nonlocal step
                step += 1
                res[fore].append(fg.save(step, t).stall_seconds)
            ways = [lambda: res[plain].append(baseline(root / f"b{r}", t, shard, fsync=False)),
                    lambda: res[fsynced].append(baseline(root / f"f{r}", t, shard, fsync=True)), save_fg]
            for way in ways[r % 3:] + ways[:r % 3]:  # rotated: none always first
                os.sync()  # no writeback of the last contender's bytes during this one
                way()
            step += 1
            key = back if r else first
            res[key].append(bg.save(step, t).stall_seconds)  # steady state reuses the snapshot buffers
            bg.wait()  # training runs on; the write finishes before the next save
            room.append(room_check(fg, step, t))
            for p in root.glob("[bf]*"):
                shutil.rmtree(p)
            shutil.rmtree(root / "data" / "tier0", ignore_errors=True)
    finally:
        fg.close()
        bg.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(a.nbytes for a in t.values())
    table(f"writer stall, checkpoint {nbytes / 1e6:.0f} MB in {args.shard_mb} MB shards, {args.rounds} rounds",
          res, plain, nbytes=nbytes)
    # the headline figures: our durable save against a durable plain save, and what training waits for
    # with the background save (its steady state once there are two rounds)
    print(f"ratio: {fore} / {fsynced} = {ratio(res, fore, fsynced):.2f} x")
    print(f"ratio: {back if res[back] else first} / {plain} = {ratio(res, back if res[back] else first, plain):.2f} x")
    if args.rounds < 2:
        print(f"({back!r} from the second save on needs --rounds 2 or more)")
    print(f"the room check alone (part of every save above): median {statistics.median(room) * 1e6:.1f} us, "
          f"best {min(room) * 1e6:.1f} us, against {statistics.median(res[plain]) * 1e6:.0f} us for "
          f"{plain!r} (median)")
    med = statistics.median(res[fore]) / statistics.median(res[fsynced])
    best = min(res[fore]) / min(res[fsynced])
    print(load_line(load0))
    print(f"goal: {fore!r} <= 1.10 x {fsynced!r} -> {med:.2f} x median, {best:.2f} x best, "
          f"{'MET' if med <= 1.10 else 'NOT MET'}")
    if args.dcp:
        dcp_table(root, t, settings, args.rounds, cleanup=args.dir is None)


def dcp_table(root: Path, t: dict[str, np.ndarray], settings, rounds: int, *, cleanup: bool) -> None:
    """The stall of a DCP job: ``dcp.save``, ``dcp.async_save`` and ``async_save_and_commit``."""
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        print("(torch not installed: no DCP table)")
        return
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sd = {k: torch.from_numpy(v) for k, v in t.items()}
    sync, asyn, adopt, ours = ("dcp.save", "dcp.async_save (call)", "ours: dcp.save + save(folder)",
                               "ours: async_save_and_commit (call)")
    res: Times = {sync: [], asyn: [], adopt: [], ours: []}
    root.mkdir(parents=True, exist_ok=True)
    stager = CheckpointStager("bench-dcp", settings=settings, announce=False)
    try:
        for r in range(rounds):
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=str(root / f"d{r}"), no_dist=True)
            res[sync].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=str(root / f"a{r}"), no_dist=True)
            res[asyn].append(time.perf_counter() - t0)
            fut.result()
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=str(root / f"s{r}"), no_dist=True)
            stager.save(2 * r + 1, root / f"s{r}")
            res[adopt].append(time.perf_counter() - t0)
            pending = async_save_and_commit(sd, stager, 2 * r + 2)
            res[ours].append(pending.stall_seconds)
            pending.result()  # training runs on; write and commit finish before the next save
            for p in root.glob("[da]*"):
                shutil.rmtree(p)
            shutil.rmtree(root / "data" / "tier0", ignore_errors=True)
    finally:
        stager.close()
        if cleanup:
            shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(a.nbytes for a in t.values())
    table(f"DCP job stall, checkpoint {nbytes / 1e6:.0f} MB, single process, {rounds} rounds", res, sync,
          nbytes=nbytes)
    print(f"ratio (DCP): {ours} / {sync} = {ratio(res, ours, sync):.2f} x")


if __name__ == "__main__":
    main()
