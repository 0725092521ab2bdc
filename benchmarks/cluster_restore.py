"""Cluster restore: N nodes back to training at once, each from its own part, against today's
path (every node restores the whole checkpoint) and plain tools, in the same run.

One checkpoint of N parts (HF safetensors, two shards per part, the index with part 0) is
promoted to every tier (Tier 0 on each simulated node, Tier 1 a local folder, Tier 2 moto's S3
server behind ``benchmarks/s3_shaper.py``: per-connection bandwidth and first-byte latency as
S3 has them; moto serving a ranged GET from the range's bytes, as S3 does, through
``benchmarks/moto_ranges.py``, or as it is with ``--moto-as-is``: the whole object read for
each range). N node processes are started once; per round, in an order rotated each round and reversed
every other (``round_order``), with the page cache written back before each contender (so that
the files one leaves unsynced, ``cp``'s and boto3's, are not written back in the next one's
time), each contender runs one job on every node, started together (each node prepares first: its
imports, catalog and S3 clients, as a running trainer has them, and the boto3 baseline its
client, so start-up is not timed; a contender's time is the common start to the last node
done):
- resume, Tier 0 intact: each node's own copy read in place (no bytes moved);
- resume, Tier 1 in place: a cold node (empty Tier 0), Tier 1 mounted here;
- N x cp of the part files from Tier 1 (the baseline of the two above);
- resume, Tier 2 through the proxy: a cold node without Tier 1, fetched into a scratch folder;
- boto3 download_file of each node's objects through the same proxy (the Tier 2 baseline), and
  the same with each file fsynced once downloaded (a resume's fetch returns its files on disk;
  download_file returns with them in the page cache, written back before the next contender,
  untimed);
- raw read per node: the same objects drained through the same proxy and dropped, read as a
  resume reads them (``tasks.drill_node.drain``: the same streams, the same ranged GETs): the
  bound; and the same with one GET per object, however large (the bound as it was measured
  before: on this S3 server a GET costs the store's one core about as much as its bytes, so
  fewer, larger GETs drain faster here, where on S3 one connection caps at ~90 MB/s);
- today: each node restores the whole checkpoint from Tier 2 through the proxy;
- resume, Tier 1 lost: Tier 1's copy removed and recorded missing before the round (untimed),
  then cold nodes with Tier 1 configured resume at once: each rehydrates its part on Tier 1
  from Tier 2 through the proxy (a claimed copy, read back) and loads it there; the index that
  part 0 holds is read from Tier 1 by the others, so each object is read from S3 once per
  cluster resume (printed with the GETs). Its time includes Tier 1's write and read-back;
- resume, Tier 2 with writeback at fsync only: the Tier 2 resume with early writeback switched
  off (``core/storage/writeback.py``): the disk starts on a fetched file only at its fsync.
Every resume loads its part with safetensors and checks it against the manifest; the Tier 2
resume's "fetch only" row is the same run timed to the end of the fetch (each file checked,
published), as the boto3 baseline is timed. The Tier 2-only nodes read Tier 2 alone (their
Tier 0 and Tier 1 narrowed away after the settings are loaded). The bound is
the bytes of the checkpoint over Tier 2's bandwidth as the N nodes get it, measured in the same
rounds: each node drains its objects raw through the proxy (the resume's streams and ranged
GETs, the bytes dropped: no check, no write, no catalog), all nodes at once (as ``ckpt drill`` measures
its bound: ``tasks.drill_node.drain``). The figure of one process reading every object alone
(``one_reader_seconds``) is printed beside it: here the N node processes share the cores
left to them, so N readers at once cannot reach it (on a cluster each node reads with its own
cores and NIC).

Cores: S3's server and the proxy run on a core of their own (the first this process may use),
the N node processes on the others, as on a cluster, where the store runs on machines of its
own: a node's work (checking, writing, loading) does not take the store's CPU, nor the
store's the nodes'. ``--shared-cores`` runs everything on every core (the measurement before
this split); with one core there is nothing to split. The output says where the proxy's
threads and the nodes ran, and how busy the store's side was during each contender (its CPU
seconds per second: 1.0 is its core full). It prints
the bytes read per tier, the S3 GETs and the bytes sent per object during the Tier 2 resume
(over the object's size: 1.00 is read once), how soon after the start each contender's GETs
reached S3 (each object's first GET, the last GET), and last:
``cluster restore: N nodes, tier 2 RTO X s, bound Y s (xR), whole-checkpoint-per-node Z s``
(R = bound / RTO: 1 reaches the bound).

    .venv/bin/python benchmarks/cluster_restore.py [--nodes 16] [--part-mib 64] [--rounds 3]
        [--bandwidth 90MB/s] [--first-byte 0.1] [--range-mib M] [--s3-endpoint URL] [--moto-as-is]
        [--shared-cores] [--only WORD,...]
    .venv/bin/python benchmarks/cluster_restore.py --smoke    # 2 nodes, 1 MiB parts, one round
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# light modules only up here: each node process runs this script too (--worker) and imports the
# catalog and the pipeline in ``prepare`` / ``child``; the parent imports what it alone needs in ``bench``
from benchmarks.common import bench_parser, cpu_seconds, load_line, parse, s3_bucket, table
from benchmarks.s3_shaper import S3_FIRST_BYTE_SECONDS, S3Shaper
from core.layout import checkpoint_prefix
from core.load_check import ManifestFile, load_and_check
from core.manifest_build import build_manifest, write_manifest
from core.settings import RetentionPolicy, Settings, load_settings
from core.sizing import parse_bandwidth
from core.storage.s3 import forget_clients
from tasks.drill_node import warm_up

RUN, STEP = "bench-cluster", 100
SMOKE = {"nodes": 2, "part_mib": 1.0}
DURABLE = "boto3 download_file + fsync (proxy)"  # on disk, as a resume's fetch leaves its files
RAW = "raw read per node, nothing kept (proxy)"  # the bound: Tier 2's bandwidth as the N nodes get it
RAW_WHOLE = "raw read, one GET per object (proxy)"  # the same without ranged GETs: the bound as measured before
REHYDRATE = "resume: Tier 1 lost, rehydrated from T2"  # each part published on Tier 1 once, loaded there
LATE = "resume: T2, writeback at fsync only"  # the Tier 2 resume, early writeback off (core/storage/writeback.py)
READY_TIMEOUT_S = 300.0


# --- the node processes ------------------------------------------------------------------------
def node_settings(spec: dict):
    """The node's settings; ``tier2_only``: a cold node that reads Tier 2 alone. A settings file
    cannot say that (an absent Tier 0 or Tier 1 URL is filled with a default folder under
    ``data_dir``, where such a node would look for the checkpoint's Tier 1 copy, not find it
    and mark it missing in the catalog), so the tiers are narrowed after loading, as
    ``tasks.drill_node.drill_settings`` does for a drill."""
    settings = Settings(**json.loads(Path(spec["settings"]).read_text()))
    if spec.get("tier2_only"):
        settings = settings.model_copy(update={"tier0_url": None, "tier1_url": None})
    return settings


def child(spec: dict) -> dict:
    """One node's work (after the common start); returns what it did."""
    settings = node_settings(spec)
    mode, part, dest = spec["mode"], spec["part"], Path(spec["dest"])
    if mode == "cp":
        subprocess.run(["cp", *spec["files"], str(dest)], check=True)
        return {"bytes": sum(os.path.getsize(f) for f in spec["files"])}
    if mode in ("boto3", "boto3+fsync"):
        client = _boto3_client[0]

        def download(key: str) -> None:
            path = str(dest / key.rsplit("/", 1)[-1])
            client.download_file(spec["bucket"], key, path)
            if mode == "boto3+fsync":  # on disk before the node counts it done, as a resume's fetch is
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        with ThreadPoolExecutor(settings.copy_parallelism) as pool:
            list(pool.map(download, spec["keys"]))
        return {"bytes": sum(p.stat().st_size for p in dest.iterdir())}
    if mode in ("raw", "raw-whole"):  # the tier's bandwidth as N nodes see it at once: each drains its objects
        from tasks.drill_node import drain  # deferred: start-up (node processes start light)

        if mode == "raw-whole":  # one GET per object, however large (as the bound was measured before)
            settings = settings.model_copy(update={"s3_ranged_threshold": 2**62})
        return {"bytes": drain(settings, 2, {k.split("/", 1)[1]: size for k, size in spec["keys"].items()})}
    if mode == "whole":
        from tasks.restore import restore_checkpoint  # deferred: start-up (node processes start light)

        restore_checkpoint(settings, RUN, dest / "whole", step=STEP, preference=(2,), fallback=False, actor="bench")
        return {"bytes": sum(p.stat().st_size for p in (dest / "whole").rglob("*") if p.is_file())}
    from db.catalog import Catalog  # deferred: start-up (node processes start light)
    from tasks.resume import resume, wide_files  # deferred: start-up (node processes start light)

    point = resume(settings, RUN, part=part, parts=spec["parts"], to=dest / "part" if spec.get("to") else None,
                   actor="bench")
    fetched_at, fetch_cpu = time.time(), cpu_seconds()
    assert point is not None and point.step == STEP, point
    with Catalog(settings.catalog_url) as cat:
        files = cat.files(cat.get_checkpoint(RUN, STEP).id)
    mine = [f for f in files if f.part == part] + wide_files(files, [part])
    checked = load_and_check(point.path, [ManifestFile(f.path, f.size, f.checksum) for f in mine], "hf-sharded")
    return {"bytes": checked.bytes, "tensors": checked.tensors, "fetched_at": fetched_at, "fetch_cpu": fetch_cpu,
            "parts": [[p.tier, p.source, p.bytes_moved] for p in point.parts]}


def worker_main(cpus: set[int] | None) -> None:
    """One node for the whole benchmark: it starts (imports) once, then runs one job per spec
    line: prepares it, prints ``ready``, waits for ``go`` (the common start), runs it and
    prints what it did as one JSON line. End of input (or anything but ``go``) ends it.
    ``cpus``: the cores the nodes run on (the storage side's are not theirs), set before any
    thread starts so that every thread and ``cp`` it starts inherits them."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    while line := sys.stdin.readline():
        spec = json.loads(line)
        prepare(spec)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":  # the benchmark was stopped before the start
            sys.exit(3)
        cpu0 = cpu_seconds()
        out = child(spec)
        out["done_at"] = time.time()
        out["cpu"] = cpu_seconds() - cpu0
        out["cores"] = sorted(os.sched_getaffinity(0))
        if "fetch_cpu" in out:
            out["fetch_cpu"] -= cpu0
        print(json.dumps(out), flush=True)


_boto3_client: list = []  # the boto3 baseline's client, made before the start


def prepare(spec: dict) -> None:
    """Before the start, for every job alike: no S3 client left from an earlier job, no garbage of
    one (a full collection of it, 0.1-0.35 s of CPU measured, would otherwise fall in whichever job
    crosses the collector's threshold), then what a
    running trainer has done before it resumes (``tasks.drill_node.warm_up``: its imports, its
    catalog client and its S3 client); the boto3 baseline makes its client here too."""
    import boto3

    from core.storage import writeback  # deferred: start-up (node processes start light)

    writeback.ENABLED = spec.get("early_writeback", True)  # every job's own: one switched off leaves it off for none
    forget_clients()
    gc.collect()  # the garbage of this process's earlier jobs is not the next job's to collect
    settings = node_settings(spec)
    _boto3_client.clear()
    if spec["mode"] in ("resume", "whole", "raw", "raw-whole"):
        warm_up(settings, RUN)
    elif spec["mode"].startswith("boto3"):
        _boto3_client.append(boto3.session.Session().client("s3", endpoint_url=settings.s3_endpoint_url,
                                                            region_name=settings.s3_region))


@dataclass
class Cluster:
    seconds: float  # common start -> last node done
    go: float  # time.time() of the common start
    results: list[dict]

    @property
    def cpu(self) -> float:
        """CPU seconds of the N node processes together (the proxy's and S3's not counted)."""
        return sum(r["cpu"] for r in self.results)

    @property
    def fetch_cpu(self) -> float:
        """``cpu`` up to the end of each node's fetch (a resume's load not counted)."""
        return sum(r.get("fetch_cpu", r["cpu"]) for r in self.results)

    def fetched(self) -> float:
        """Common start -> the last node's part fetched and checked against the manifest, before
        it is loaded (a resume's fetch alone, timed as the boto3 baseline is)."""
        return max(r.get("fetched_at", r["done_at"]) for r in self.results) - self.go


class Nodes:
    """N node processes, started once and reused by every contender and round (interpreter
    start-up and imports are paid once per node, never timed)."""

    def __init__(self, n: int, cpus: set[int] | None = None):
        argv = [sys.executable, __file__, "--worker", *([",".join(map(str, sorted(cpus)))] if cpus else [])]
        self.procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(n)]

    def run(self, specs: list[dict]) -> Cluster:
        """One job per node, all started together; a contender's time is the common start to
        the last node done."""
        for p, s in zip(self.procs, specs, strict=True):
            self._send(p, json.dumps(s))
        for p in self.procs:
            if (line := self._line(p)) != "ready":
                raise RuntimeError(f"a node process did not get ready: {line!r}")
        go = time.time()
        for p in self.procs:
            self._send(p, "go")
        results = []
        for p in self.procs:
            line = self._line(p)
            if not line:
                raise RuntimeError(f"a node process failed (exit {p.wait()})")
            results.append(json.loads(line))
        return Cluster(max(r["done_at"] for r in results) - go, go, results)

    @staticmethod
    def _send(p: subprocess.Popen, line: str) -> None:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()

    @staticmethod
    def _line(p: subprocess.Popen) -> str:
        assert p.stdout is not None
        return p.stdout.readline().strip()

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# --- setup ---------------------------------------------------------------------------------------
def write_part(folder: Path, part: int, parts: int, part_bytes: int) -> None:
    """Two float32 safetensors shards of this part; part 0 also writes the index of all parts."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    per = max(1, part_bytes // 2 // 4)
    rng = np.random.default_rng(part)
    for i in range(2):
        save_file({f"layer{part}.{i}.weight": rng.random(per, dtype=np.float32)},
                  str(folder / f"model-p{part:03d}-{i}.safetensors"))
    if part == 0:
        weight_map = {f"layer{p}.{i}.weight": f"model-p{p:03d}-{i}.safetensors" for p in range(parts) for i in range(2)}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": parts * 2 * per * 4}, "weight_map": weight_map}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main({int(c) for c in sys.argv[2].split(",")} if len(sys.argv) > 2 else None)
        return
    ap = bench_parser(__doc__, rounds=3, s3_endpoint=True)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--part-mib", type=float, default=64.0)
    ap.add_argument("--bandwidth", default="90MB/s", help="the proxy's per-connection bandwidth")
    ap.add_argument("--first-byte", type=float, default=None, help="the proxy's first-byte latency, s [0.1]")
    ap.add_argument("--parallelism", type=int, default=4, help="copy_parallelism of each node")
    ap.add_argument("--range-mib", type=float, default=None,
                    help="s3_range_bytes of each node, MiB (default: the setting's default)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: system temp)")
    ap.add_argument("--moto-as-is", action="store_true",
                    help="moto reads the whole object for each ranged GET, as it does by itself (default: "
                         "the range's bytes alone, as S3: benchmarks/moto_ranges.py)")
    ap.add_argument("--only", default=None,
                    help="comma-separated words: run only the contenders whose name holds one (and the ones "
                         "the summary needs: the Tier 2 resume, boto3 download_file, the raw read); a quick look, "
                         "not a figure to quote: each contender's time moves with the ones around it")
    ap.add_argument("--shared-cores", action="store_true",
                    help="run S3 and the proxy on the nodes' cores (default: on a core of their own)")
    args = parse(ap, SMOKE)
    args.storage_cpus, args.node_cpus = (None, None) if args.shared_cores else split_cores()
    if args.storage_cpus:  # before S3's server starts: it and the proxy's threads inherit it
        os.sched_setaffinity(0, args.storage_cpus)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-cluster-", dir=args.dir))
    try:
        with s3_bucket(args.s3_endpoint, work / "moto.log",
                       ranges_at_cost=not args.moto_as_is) as (endpoint, bucket):
            bench(args, work, endpoint, bucket)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def store_cpu() -> float:
    """CPU seconds so far of the store's side: this process (the proxy's threads; its own part,
    reading the nodes' lines, is small) and its children but the nodes: S3's server when started
    here (moto), read from ``/proc``."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    total = me.ru_utime + me.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                if b"moto" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def split_cores() -> tuple[set[int] | None, set[int] | None]:
    """(the storage side's cores, the nodes' cores): S3's server and the proxy on one core of
    their own, the node processes on the rest. On a cluster S3 runs on machines of its own and
    each node reads with its own cores, so a node's work (checking, writing, loading) does not
    slow the store it reads from; sharing every core here would charge S3's CPU to the nodes
    and the nodes' to S3 (``--shared-cores`` measures that way). (None, None) with one core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def bench(args, work: Path, endpoint: str, bucket: str) -> None:
    from db.catalog import Catalog, upgrade  # deferred: start-up (node processes start light)
    from flows.common import plain_steps  # deferred: start-up (node processes start light)
    from flows.promote import promote  # deferred: start-up (node processes start light)

    load0 = os.getloadavg()[0]
    n, part_bytes = args.nodes, int(args.part_mib * 2**20)
    base = load_settings(data_dir=work / "data", node="node-0", tier1_url=str(work / "tier1"),
                         tier2_url=f"s3://{bucket}/ckpt", s3_endpoint_url=endpoint,
                         copy_parallelism=args.parallelism,
                         **({"s3_range_bytes": int(args.range_mib * 2**20)} if args.range_mib else {}),
                         retention_tier0=RetentionPolicy(enabled=False),
                         retention_tier1=RetentionPolicy(enabled=False))
    upgrade(base.catalog_url)
    (work / "tier1").mkdir(parents=True, exist_ok=True)  # the mount point (a store never creates a root)
    with Catalog(base.catalog_url) as cat:
        cat.ensure_run(RUN, actor="bench")
    prefix = checkpoint_prefix(RUN, STEP)
    nodes = [base.model_copy(update={"node": f"node-{i}", "tier0_url": str(work / "tier0" / f"node-{i}")})
             for i in range(n)]
    t0 = time.perf_counter()
    for i, s in enumerate(nodes):
        folder = Path(s.tier0_url) / prefix
        write_part(folder, i, n, part_bytes)
        write_manifest(folder, build_manifest(folder, RUN, STEP, part=i, parts=n, kind="milestone", node=s.node))
        promote(s, RUN, STEP, i, n, steps=plain_steps(), actor="bench")
    tier1 = work / "tier1" / prefix
    nbytes = sum(p.stat().st_size for p in tier1.iterdir() if not p.name.startswith("manifest"))
    print(f"promoted {n} parts ({nbytes / 2**20:.1f} MiB) to tiers 0, 1 and 2 in {time.perf_counter() - t0:.1f} s")

    first_byte = S3_FIRST_BYTE_SECONDS if args.first_byte is None else args.first_byte
    with S3Shaper(endpoint, bandwidth=parse_bandwidth(args.bandwidth), first_byte=first_byte) as proxy:
        print(f"S3 through the shaping proxy: {args.bandwidth} per connection, {first_byte * 1000:.0f} ms to first "
              f"byte; {args.parallelism} streams per node, ranged GETs of {base.s3_range_bytes / 2**20:g} MiB from "
              f"{base.s3_ranged_threshold / 2**20:g} MiB up")
        server = "the proxy (S3 at --s3-endpoint runs where it was started)" if args.s3_endpoint else \
            "S3's server and the proxy"
        if not args.s3_endpoint:
            print("S3's server: moto, " + ("each ranged GET read from the whole object (--moto-as-is)"
                                           if args.moto_as_is else
                                           "each ranged GET served from the range's bytes (moto_ranges.py)"))
        print("cores: " + (f"{server} share them with the nodes" if args.storage_cpus is None else
                           f"{server} on {sorted(args.storage_cpus)}, the {n} node processes on "
                           f"{sorted(args.node_cpus)}"))
        shaped = base.model_copy(update={"s3_endpoint_url": proxy.url})
        run_bench(args, work, n, nbytes, nodes, shaped, bucket, proxy, tier1, prefix, load0,
                  lambda: one_reader_seconds(base, shaped, args.node_cpus))


def one_reader_seconds(base, shaped, cpus: set[int] | None) -> float:
    """Every object of the checkpoint drained through the proxy by this one process
    (``copy_parallelism`` streams per part at once, on the nodes' ``cpus``), timed: Tier 2 as
    one reader gets it."""
    from db.catalog import Catalog  # deferred: start-up (node processes start light)
    from tasks.drill_node import drain  # deferred: start-up (node processes start light)

    with Catalog(base.catalog_url) as cat:
        ck = cat.get_checkpoint(RUN, STEP)
        keys = {f"{checkpoint_prefix(RUN, STEP)}/{f.path}": f.size for f in cat.files(ck.id)}
    mine = os.sched_getaffinity(0)
    if cpus:  # the drain's threads inherit the nodes' cores from this thread; the proxy's keep its own
        os.sched_setaffinity(0, cpus)
    try:
        started = time.monotonic()
        drain(shaped, 2, keys, streams=ck.parts * shaped.copy_parallelism)
        return time.monotonic() - started
    finally:
        os.sched_setaffinity(0, mine)


def lose_tier1(settings, tier1: Path) -> None:
    """Tier 1's copy of the checkpoint gone and the catalog told so (as ``ckpt reconcile`` records
    a loss): the next resume of each node rehydrates its part there from Tier 2."""
    from db.catalog import Catalog  # deferred: start-up (node processes start light)

    shutil.rmtree(tier1, ignore_errors=True)
    with Catalog(settings.catalog_url) as cat:
        for rep in cat.replicas(cat.get_checkpoint(RUN, STEP).id, 1):
            if rep.state == "verified":
                cat.transition(rep.id, "missing", expected="verified", actor="bench", reason="bench: tier 1 lost")


def first_gets(get_times: list[tuple[float, str]], go: float) -> tuple[float, float, float]:
    """(median over the objects of each one's first GET, the last object's first GET, the last GET
    of all), in seconds after the common start ``go``: how soon the nodes' reads reach S3."""
    first: dict[str, float] = {}
    for t, key in get_times:
        first[key] = min(first.get(key, t), t)
    return (statistics.median(first.values()) - go, max(first.values()) - go,
            max(t for t, _k in get_times) - go)


def round_order(names: list[str], r: int) -> list[str]:
    """The contenders' order in round ``r``: rotated by ``r`` (none always first), and reversed
    every other round, so that no contender always runs right after the same other one: a
    contender follows another's load (its page cache, its sockets closing, the store's side
    catching up) in one round and precedes it in the next. Before this, the Tier 2 resume
    always ran right after the ``cp`` contender and right before boto3's."""
    order = names[::-1] if r % 2 else names
    return order[r % len(names):] + order[:r % len(names)]


def run_bench(args, work: Path, n: int, nbytes: int, nodes, shaped, bucket: str, proxy, tier1: Path, prefix: str,
              load0: float, bound_fn) -> None:
    from db.catalog import Catalog  # deferred: start-up (node processes start light)

    spec_dir = work / "specs"
    spec_dir.mkdir()

    def settings_file(name: str, s) -> str:
        p = spec_dir / f"{name}.json"
        p.write_text(s.model_dump_json())
        return str(p)

    with Catalog(shaped.catalog_url) as cat:
        files = cat.files(cat.get_checkpoint(RUN, STEP).id)
    own = {i: [f.path for f in files if f.part == i] for i in range(n)}
    sizes = {f.path: f.size for f in files}
    index = [f.path for f in files if f.path == "model.safetensors.index.json"]
    t0_files = [settings_file(f"t0-{i}", s) for i, s in enumerate(nodes)]
    cold_t1 = [settings_file(f"t1-{i}", s.model_copy(update={"node": f"cold-{i}",
                                                                "tier0_url": str(work / "cold" / f"{i}")}))
               for i, s in enumerate(nodes)]
    hydrating = [settings_file(f"h-{i}", shaped.model_copy(update={"node": f"hydrating-{i}",
                                                                  "tier0_url": str(work / "cold" / f"h{i}")}))
                 for i in range(n)]
    t2_only = settings_file("t2", shaped.model_copy(update={"tier0_url": None, "tier1_url": None, "node": "cold"}))
    dest = work / "dest"

    def specs(mode: str, **kw) -> list[dict]:
        out = []
        for i in range(n):
            d = dest / f"node-{i}"
            d.mkdir(parents=True, exist_ok=True)
            spec = {"mode": mode, "part": i, "parts": n, "dest": str(d), "settings": t2_only,
                    "tier2_only": kw.get("settings", t2_only) == t2_only} | kw
            if mode == "cp":
                spec["files"] = [str(tier1 / p) for p in own[i] + (index if i else [])]
            if mode.startswith(("boto3", "raw")):
                spec["keys"] = {f"ckpt/{prefix}/{p}": sizes[p] for p in own[i] + (index if i else [])}
                spec["bucket"] = bucket
            if mode == "resume":
                spec["settings"] = kw["settings"][i] if isinstance(kw["settings"], list) else kw["settings"]
            out.append(spec)
        return out

    contenders = {
        "resume: Tier 0 intact (in place)": lambda nodes_: nodes_.run(specs("resume", settings=t0_files)),
        "resume: Tier 1 in place": lambda nodes_: nodes_.run(specs("resume", settings=cold_t1)),
        f"{n} x cp of the part files (Tier 1)": lambda nodes_: nodes_.run(specs("cp")),
        "resume: Tier 2 via proxy (fetched)": lambda nodes_: nodes_.run(specs("resume", settings=t2_only, to=True)),
        "boto3 download_file per node (proxy)": lambda nodes_: nodes_.run(specs("boto3")),
        "today: whole checkpoint per node (T2)": lambda nodes_: nodes_.run(specs("whole")),
        RAW: lambda nodes_: nodes_.run(specs("raw")),
        RAW_WHOLE: lambda nodes_: nodes_.run(specs("raw-whole")),
        DURABLE: lambda nodes_: nodes_.run(specs("boto3+fsync")),
        REHYDRATE: lambda nodes_: nodes_.run(specs("resume", settings=hydrating)),
        LATE: lambda nodes_: nodes_.run(specs("resume", settings=t2_only, to=True, early_writeback=False)),
    }
    names = list(contenders)
    if args.only:
        words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        need = {names[3], names[4], RAW, RAW_WHOLE}
        for name in names:
            if name not in need and not any(w in name.lower() for w in words):
                del contenders[name]
    fetch_only = "  same resume, fetch only (no load)"
    times: dict[str, list[float]] = {k: [] for k in [*names[:4], fetch_only, *names[4:]]}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    store: dict[str, list[float]] = {k: [] for k in names}  # the store's side's CPU / the contender's time
    last: dict[str, Cluster] = {}
    arrivals: dict[str, list[tuple[float, float, float]]] = {k: [] for k in names}
    s3_reads: dict[str, tuple[dict[str, int], dict[str, int]]] = {}  # the last round's GETs, bytes per object
    with Nodes(n, args.node_cpus) as nodes_:
        for r in range(args.rounds):
            for name in round_order(list(contenders), r):
                shutil.rmtree(dest, ignore_errors=True)
                shutil.rmtree(work / "cold", ignore_errors=True)
                proxy.reset_counts()
                if name == REHYDRATE:
                    lose_tier1(shaped, tier1)
                os.sync()  # untimed: no contender's files are written back in another's time
                store0 = store_cpu()
                got = contenders[name](nodes_)
                store[name].append((store_cpu() - store0) / got.seconds)  # prepare's share too: an upper bound
                times[name].append(got.seconds)
                cpu[name].append(got.cpu)
                last[name] = got
                if name in (names[3], REHYDRATE):
                    s3_reads[name] = dict(proxy.gets), dict(proxy.get_bytes)
                if proxy.get_times:
                    arrivals[name].append(first_gets(proxy.get_times, got.go))
                if name == names[3]:
                    times[fetch_only].append(got.fetched())
                    cpu[fetch_only].append(got.fetch_cpu)
    shutil.rmtree(dest, ignore_errors=True)
    print("the store's side (proxy" + ("" if args.s3_endpoint else " + S3's server") + ") busy, CPU s per second of "
          "each contender (median; 1.0 is one core): " + ", ".join(f"{k.split(' (')[0]} {statistics.median(v):.2f}"
                                                                  for k, v in store.items() if v))
    node_cores = sorted({c for got in last.values() for r in got.results for c in r["cores"]})
    print(f"ran on: the proxy's threads {sorted(os.sched_getaffinity(proxy.thread_id))}, the node processes "
          f"{node_cores}")
    one_reader = bound_fn()
    bound = statistics.median(times[RAW])
    whole_gets = statistics.median(times[RAW_WHOLE])
    with Catalog(shaped.catalog_url) as cat:  # a resume that reads a copy marks it bad only when it is
        marked = [f"tier {r.tier} part {r.part}: {r.state}" for r in cat.replicas(cat.get_checkpoint(RUN, STEP).id)
                  if r.state != "verified"]

    t01 = {k: times[k] for k in names[:3] if times[k]}
    if names[2] in t01:
        table(f"{n} nodes resume at once from Tier 0 / Tier 1", t01, names[2], nbytes=nbytes)
    t2 = {k: times[k] for k in [names[3], fetch_only, *names[4:]] if times[k]}
    table(f"{n} nodes resume at once from Tier 2 through the proxy", t2, names[4], nbytes=nbytes,
          cpu={k: cpu[k] for k in t2})
    print("(a resume's time includes loading its part with safetensors and checking it; boto3 and the fetch-only "
          "row end when the files are written)")
    print("\nbytes read per tier (the last round of each resume):")
    for name in [k for k in names[:2] + names[3:4] + [REHYDRATE] if k in last]:
        moved: dict[str, int] = {}
        for res in last[name].results:
            for tier, source, b in res["parts"]:
                key = f"tier {tier} {source}"
                moved[key] = moved.get(key, 0) + (res["bytes"] if source == "in place" else b)
        loaded = sum(res["bytes"] for res in last[name].results)
        copied = sum(b for res in last[name].results for _t, _s, b in res["parts"])
        print(f"  {name:40} {', '.join(f'{k}: {v / 2**20:.1f} MiB' for k, v in sorted(moved.items()))}; "
              f"moved {copied / 2**20:.1f} MiB, loaded {loaded / 2**20:.1f} MiB, "
              f"{sum(res['tensors'] for res in last[name].results)} tensors")
    sizes = {p.name: p.stat().st_size for p in tier1.iterdir()}
    for name, what in ((names[3], "the Tier 2 resume (nodes sharing no tier: each reads the index itself)"),
                       (REHYDRATE, "the resume rehydrating Tier 1 (one cluster)")):
        if name not in s3_reads:
            continue
        gets, got_bytes = s3_reads[name]  # each object's GETs and the bytes they sent over its size: 1.0 is once
        reads = {k.rsplit("/", 1)[-1]: b / sizes[k.rsplit("/", 1)[-1]] for k, b in got_bytes.items()
                 if k.rsplit("/", 1)[-1] in sizes}  # the checkpoint's objects (not the tier's identity marker)
        again = sorted(f"{k} (x{v:.2f})" for k, v in reads.items() if v > 1.0)
        print(f"S3 during {what}: {len(gets)} objects, {sum(gets.values())} GETs (a large object's are "
              f"ranged); bytes sent per object / its size: min "
              f"{min(reads.values()):.2f}, max {max(reads.values()):.2f}; "
              f"read more than once: {', '.join(again) or 'none'}")
    print(f"copies the catalog no longer holds verified after the run: {len(marked)} ({', '.join(marked) or 'none'})")
    print("GETs reaching S3 after the common start (median of rounds, s): each object's first GET, its median "
          "over the objects / the last object's; the last GET of all")
    for name, got in arrivals.items():
        if got:
            print(f"  {name:40} first GET: median {statistics.median(a[0] for a in got):.2f}, last object "
                  f"{statistics.median(a[1] for a in got):.2f}; last GET {statistics.median(a[2] for a in got):.2f}")
    rto = statistics.median(times[names[3]])
    whole = statistics.median(times[names[5]]) if times[names[5]] else float("nan")
    boto = statistics.median(times[names[4]])
    fetch = statistics.median(times[fetch_only])
    durable = statistics.median(times[DURABLE]) if times[DURABLE] else float("nan")
    print(f"Tier 2 resume / boto3 download_file = {rto / boto:.2f} x with the load, {fetch / boto:.2f} x fetch only "
          f"(goal <= 1.0); fetch only / boto3 download_file + fsync = {fetch / durable:.2f} x (the resume's files are "
          f"on disk when it returns; download_file's may still be in the page cache); bound / RTO = "
          f"{bound / rto:.2f} (goal >= 0.8); bound: {nbytes / 2**20:.1f} MiB read raw through the proxy by the "
          f"{n} nodes at once, with the resume's requests, in {bound:.2f} s (median; with one GET per object "
          f"{whole_gets:.2f} s: x{whole_gets / rto:.2f} of the RTO; one process reading every object alone: "
          f"{one_reader:.2f} s, which the N node processes sharing this machine's cores cannot reach: "
          f"x{one_reader / rto:.2f})")
    print(load_line(load0))
    print(f"cluster restore: {n} nodes, tier 2 RTO {rto:.2f} s, bound {bound:.2f} s (x{bound / rto:.2f}), "
          f"whole-checkpoint-per-node {whole:.2f} s")


if __name__ == "__main__":
    main()
