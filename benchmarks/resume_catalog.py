"""A node's resume at cluster scale, the catalog's side: one part of an N-part checkpoint resumed
where it lies on Tier 1, on SQLite and PostgreSQL catalogs, N from a small job to thousands of
nodes.

When a large job restarts, every node calls ``resume_point`` at once, and each reads the
catalog: its part's copies (Tier 0, 1, 2), its files and the checkpoint-wide files (the HF
index) it needs to load. What one node reads should not grow with N, or N nodes make the
catalog serve N x N rows at the worst moment. Per backend and N, the checkpoint (N parts of 8
files, part 0 also the index) is registered and recorded verified on Tier 1 and Tier 2 (straight
into the tables, so thousands of parts take seconds), the resumed parts' files and manifests
are put on a local Tier 1 (the others exist in the catalog alone: the resume checks only its
own), then a cold node resumes a different part each round, timed (wall and CPU of this process:
the catalog's client side; PostgreSQL's server CPU is not in it).

Baselines in the same run: the same resume of the smallest N (the growth with N is the figure:
x1.0 is flat), and ``every part's rows``: one read of all the checkpoint's replica and file
rows through the same API, as each node's resume read them, several times, before it read its
own part's alone.

    .venv/bin/python benchmarks/resume_catalog.py [--parts 16,1024,4096] [--rounds 5] [--backend both]
    .venv/bin/python benchmarks/resume_catalog.py --smoke
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.catalog_scale import pg_url, sqlite_url
from benchmarks.common import bench_parser, cpu_seconds, load_line, parse, table
from core.formats import HF_INDEX
from core.layout import checkpoint_prefix
from core.manifest import FileEntry, Manifest
from core.manifest_build import write_manifest
from core.settings import RetentionPolicy, load_settings
from db.catalog import Catalog, upgrade
from db.rows import replicas
from tasks.resume import resume

RUN, STEP, FILES, FILE_BYTES = "bench-resume-catalog", 1000, 8, 4096
SMOKE = {"parts": "4,16", "backend": "sqlite"}


def manifest(part: int, parts: int) -> Manifest:
    entries = [FileEntry(path=f"model-p{part:05d}-{i}.safetensors", size=FILE_BYTES, checksum=f"{part * 16 + i:08x}")
               for i in range(FILES)]
    if part == 0:
        entries.append(FileEntry(path=HF_INDEX, size=FILE_BYTES, checksum="0badc0de"))
    return Manifest(run=RUN, step=STEP, files=tuple(entries), format="hf-sharded", part=part, parts=parts,
                    node=f"node-{part}", created_at="2026-12-04T00:00:00Z")


def fill(url: str, parts: int, tier1: Path, resumed: list[int]) -> None:
    """The checkpoint registered and verified on Tiers 1 and 2; the ``resumed`` parts (and part 0's
    index) on Tier 1's disk with their manifests."""
    upgrade(url)
    now = datetime.now(UTC)
    with Catalog(url) as cat:
        cat.ensure_run(RUN, actor="bench")
        cat.register_many([manifest(p, parts) for p in range(parts)], actor="bench")
        ck = cat.get_checkpoint(RUN, STEP)
        with cat.engine.begin() as conn:
            conn.execute(replicas.insert(), [
                dict(checkpoint_id=ck.id, tier=tier, part=p, url=f"t{tier}://{RUN}/{STEP}/{p}", state="verified",
                     bytes=FILES * FILE_BYTES, verified_at=now, created_at=now, updated_at=now, checked_at=now)
                for tier in (1, 2) for p in range(parts)])
    folder = tier1 / checkpoint_prefix(RUN, STEP)
    folder.mkdir(parents=True, exist_ok=True)
    for p in sorted({0, *resumed}):
        m = manifest(p, parts)
        for f in m.files:
            (folder / f.path).write_bytes(b"\0" * f.size)
        write_manifest(folder, m)


def whole_rows(url: str) -> None:
    with Catalog(url) as cat:
        ck = cat.get_checkpoint(RUN, STEP)
        cat.replicas(ck.id)
        cat.files(ck.id)


def bench(label: str, url: str, parts: int, rounds: int, work: Path) -> dict[str, list[float]]:
    tier1 = work / f"tier1-{label}-{parts}"
    resumed = [(parts // 2 + 7 * r) % parts for r in range(rounds)]  # a different part each round
    t0 = time.perf_counter()
    fill(url, parts, tier1, resumed)
    print(f"  {label}, {parts} parts: registered and recorded in {time.perf_counter() - t0:.1f} s", flush=True)
    settings = load_settings(data_dir=work / f"data-{label}-{parts}", node="cold", catalog_url=url,
                             tier0_url=str(work / f"cold-{label}-{parts}"), tier1_url=str(tier1),
                             retention_tier0=RetentionPolicy(enabled=False),
                             retention_tier1=RetentionPolicy(enabled=False))
    out: dict[str, list[float]] = {"wall": [], "cpu": [], "whole": []}
    resume(settings, RUN, part=resumed[0], parts=parts)  # warm: imports, the engine, the first connection
    for part in resumed:
        c0, w0 = cpu_seconds(), time.perf_counter()
        point = resume(settings, RUN, part=part, parts=parts)
        out["wall"].append(time.perf_counter() - w0)
        out["cpu"].append(cpu_seconds() - c0)
        assert point is not None and point.path == str(tier1 / checkpoint_prefix(RUN, STEP)), point
        assert [(p.part, p.source, p.bytes_moved) for p in point.parts] == [(part, "in place", 0)], point.parts
        w0 = time.perf_counter()
        whole_rows(url)
        out["whole"].append(time.perf_counter() - w0)
    return out


def own(parts: int) -> str:
    return f"resume, {parts} parts"


def whole(parts: int) -> str:
    return f"  every part's rows, {parts} parts"


def main() -> None:
    ap = bench_parser(__doc__, rounds=5)
    ap.add_argument("--parts", default="16,1024,4096", help="checkpoint sizes in parts (nodes), comma-separated")
    ap.add_argument("--backend", choices=("sqlite", "pg", "both"), default="both")
    args = parse(ap, SMOKE)
    sizes = sorted(int(x) for x in args.parts.split(","))
    if sizes[0] < 1:
        ap.error("--parts: every size must be at least 1")
    load0 = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-resume-catalog-"))
    try:
        backends = ["sqlite", "pg"] if args.backend == "both" else [args.backend]
        print(f"a cold node resumes one part in place from Tier 1; {args.rounds} rounds per size, a different part "
              "each round; ms per resume (this process's wall and CPU)")
        for backend in backends:
            times: dict[str, list[float]] = {}
            cpu: dict[str, float] = {}
            for parts in sizes:
                url, drop = (sqlite_url(work), lambda: None) if backend == "sqlite" else pg_url()
                try:
                    got = bench(backend, url, parts, args.rounds, work)
                finally:
                    drop()
                times[own(parts)], times[whole(parts)] = got["wall"], got["whole"]
                cpu[f"{parts} parts"] = statistics.median(got["cpu"]) * 1e3
            table(f"{backend}: one node's resume by the checkpoint's parts", times, own(sizes[0]))
            print("CPU ms per resume (median): " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
            last, base = (statistics.median(times[own(n)]) for n in (sizes[-1], sizes[0]))
            print(f"{backend}: resume catalog: {sizes[-1]} parts, {last * 1e3:.1f} ms per node "
                  f"(x{last / base:.2f} of {sizes[0]} parts), every part's rows "
                  f"{statistics.median(times[whole(sizes[-1])]) * 1e3:.1f} ms")
        print(load_line(load0))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
