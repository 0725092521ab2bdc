"""Benchmark: the whole Tier 0 -> Tier 1 hop a user waits for (register the part in the catalog,
check Tier 0, copy with fsync and read-back, record both copies, mark complete: ``tasks.hop.
tier1_hop``) beside ``cp -r && sync`` of the same folder, in the same rounds, medians and best
rounds, with the Tier 0 bytes each promotion read.

Contenders (the order rotated every round; Tier 1, the cp target and the catalog fresh before
each, untimed; the same Tier 0 part every time):
- ``cp -r && sync``: the baseline (no check at all, durable at the end);
- ``cp -r``: no fsync;
- ``whole hop (one Tier 0 read)``: ``tier1_hop`` as the pipeline runs it, the copy being the
  Tier 0 verify (``tasks.copy.promote_part``);
- ``whole hop, Tier 1 direct I/O``: the same with ``tier1_direct_io`` (written and read back
  with O_DIRECT: the read-back reads the disk, not the page cache);
- ``whole hop, verify then copy (before)``: the same steps with Tier 0 verified by a pass of
  its own before the copy (``verify_replica`` + ``copy_to_tier1``), as promotions ran before.
Tier 0 bytes read are counted on every store the pipeline opens there (``benchmarks.tier_reads``:
reads and kernel copies). ``--gib 16`` runs one 16 GiB part (one round by default): the output
says whether the page cache can hold the source, i.e. whether Tier 0 reads hit the media.

    .venv/bin/python benchmarks/promote_tier1.py [--gib 1] [--shards 64] [--rounds 5] [--dir /tmp]
    .venv/bin/python benchmarks/promote_tier1.py --gib 16 --shards 64 --rounds 1
    .venv/bin/python benchmarks/promote_tier1.py --smoke    # 4 MiB, 4 shards, one round
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, load_line, parse, run_rounds, table, write_shards
from benchmarks.tier_reads import counting_tier_reads
from core.layout import checkpoint_prefix
from core.manifest_build import build_manifest, write_manifest
from core.settings import Settings
from db.catalog import Catalog, upgrade
from tasks.copy import copy_to_tier1
from tasks.hop import tier1_hop
from tasks.record import mark_complete
from tasks.register import register_stored_part
from tasks.verify import verify_replica

RUN, STEP, NODE = "bench", 1000, "bench-node"
SMOKE = {"gib": 4 / 1024, "shards": 4}
BASE, FUSED, BEFORE = "cp -r && sync", "whole hop (one Tier 0 read)", "whole hop, verify then copy (before)"
DIRECT = "whole hop, Tier 1 direct I/O"


class HopBench:
    """One part on a Tier 0 folder under ``work`` and what promoting it again and again needs:
    ``fresh()`` empties Tier 1 and opens a new catalog (engines are cached per URL),
    ``promote()`` is ``tier1_hop`` as the pipeline runs it."""

    def __init__(self, work: Path, gib: float, shards: int, parallelism: int, **settings: object):
        self.work, self.t1_root = work, work / "tier1"
        self.src = work / "tier0" / checkpoint_prefix(RUN, STEP)
        write_shards(self.src, int(gib * 2**30), shards)
        self.manifest = build_manifest(self.src, RUN, STEP, node=NODE, parallelism=parallelism)
        write_manifest(self.src, self.manifest)
        self.settings = Settings(data_dir=work / "data", node=NODE, tier0_url=str(work / "tier0"),
                                 tier1_url=str(self.t1_root), task_retries=0, copy_parallelism=parallelism,
                                 **settings)
        self._n = 0

    def fresh(self, **settings: object) -> None:
        shutil.rmtree(self.t1_root, ignore_errors=True)
        self.t1_root.mkdir(parents=True)  # the mount point, empty (a store never creates it)
        self._n += 1
        url = f"sqlite:///{self.work / f'catalog-{self._n}.db'}"
        self.settings = self.settings.model_copy(update={"catalog_url": url, **settings})
        upgrade(url)
        with Catalog(url) as cat:
            cat.ensure_run(RUN, actor="bench")

    def promote(self) -> None:
        assert tier1_hop(self.settings, RUN, STEP, node=NODE, actor="bench").durable


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = bench_parser(__doc__, rounds=5)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        cp_dst = work / "cp"
        hop = HopBench(work, args.gib, args.shards, args.parallelism)
        src, m, nbytes = hop.src, hop.manifest, hop.manifest.total_bytes

        def fresh(_name: str) -> None:
            shutil.rmtree(cp_dst, ignore_errors=True)
            hop.fresh()

        reads: dict[str, list[int]] = {FUSED: [], DIRECT: [], BEFORE: []}
        data_files = {f.path for f in m.files}

        def counted(name: str, fn):
            def run() -> None:
                with counting_tier_reads(0) as seen:
                    fn()
                reads[name].append(sum(n for k, n in seen.items() if k in data_files))
            return run

        def before() -> None:
            settings = hop.settings
            register_stored_part(settings, RUN, STEP, node=NODE, actor="bench")
            verify_replica(settings, RUN, STEP, tier=0, node=NODE, actor="bench")
            copy_to_tier1(settings, RUN, STEP, node=NODE, actor="bench")
            assert mark_complete(settings, RUN, STEP, 1, actor="bench")

        def direct() -> None:
            plain = hop.settings
            hop.settings = plain.model_copy(update={"tier1_direct_io": True})
            try:
                hop.promote()
            finally:
                hop.settings = plain

        contenders = {
            BASE: lambda: subprocess.run(f"cp -r '{src}' '{cp_dst}' && sync", shell=True, check=True),
            "cp -r": lambda: subprocess.run(["cp", "-r", str(src), str(cp_dst)], check=True),
            FUSED: counted(FUSED, hop.promote),
            DIRECT: counted(DIRECT, direct),
            BEFORE: counted(BEFORE, before),
        }
        fresh("warm-up")
        hop.promote()  # imports, the catalog's first connection, the source in the page cache (if it fits)
        avail = mem_available()
        times, _ = run_rounds(contenders, args.rounds, before=fresh, sync=True)

        print(f"checkpoint: {nbytes / 2**30:.3f} GiB in {len(m.files)} files, {args.rounds} rounds, "
              f"copy parallelism {args.parallelism}; catalog SQLite; scratch {work}")
        fits = nbytes * 2 < avail  # the source and the Tier 1 copy both stay cached
        where = "Tier 0 reads come from memory, as right after a save" if fits else "Tier 0 reads go to the disk"
        print(f"page cache: {avail / 2**30:.1f} GiB available -> the source {'fits' if fits else 'does NOT fit'}"
              f" beside its copy ({where})")
        base = table("whole Tier 0 -> Tier 1 hop", times, BASE, nbytes=nbytes)
        print("\nTier 0 bytes read per promotion (data files; the format check reads a few KB of headers)")
        for name, got in reads.items():
            med = statistics.median(got)
            print(f"{name:40} {med / 2**20:10.1f} MiB  = {med / nbytes:.3f} x checkpoint bytes")
        print(load_line(load0))
        fused_med = statistics.median(times[FUSED])
        met = "MET" if fused_med <= 1.0 * base else "NOT MET"
        print(f"goal: whole hop <= 1.0 x cp -r && sync -> {fused_med / base:.2f} x median, "
              f"{min(times[FUSED]) / min(times[BASE]):.2f} x best, {met}; "
              f"Tier 0 read {statistics.median(reads[FUSED]) / nbytes:.3f} x checkpoint bytes (goal 1.0)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
