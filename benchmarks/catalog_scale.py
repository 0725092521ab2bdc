"""Catalog at scale: query latency and registration throughput on SQLite and PostgreSQL.

Full size by hand; CI runs only its ``--smoke`` form. At ``--scale 1`` it fills a catalog with
10,000 runs x 100 steps (1,000,000 checkpoints, 8 files each, 8,000,000 file rows) whose lineage
chains are 50 edges deep where the queries walk them, then prints p50/p95 of catalog queries 1,
2, 4, 6 and 7 through the public ``Catalog`` API, and bulk registration throughput. Targets
(issue 2): every query < 50 ms p95, >= 2,000 registrations/s.

Ratios are against baselines measured in the same run:
- queries: ``get_checkpoint`` (one primary-key lookup through the same API, transaction and
  connection pool), so "x4.0" means the query costs four trivial catalog calls;
- registration: one ``register_part`` per transaction (what an agent does per part) against
  ``register_many`` (one transaction per batch, what a backfill does).

The fill goes straight into the tables (Core executemany) so that 1M checkpoints take minutes,
not hours; what is timed goes through the API only. The fill shape, per run: every step
verified on Tier 1 except the newest two (still only on Tier 0, so query 6 has work), the
newest three on Tier 0, every 10th step a milestone archived on Tier 2, ``follows`` edges down
the run, and every run after the first resumed from step 50 of the previous run of its group
(so ancestors of step 50 walk 49 ``follows`` edges, one ``resumed_from`` and onwards: depth 50
with ``max_depth=50``).

    python benchmarks/catalog_scale.py --scale 0.01            # 100 runs, seconds
    python benchmarks/catalog_scale.py --scale 1 --backend pg  # the issue's size
    python benchmarks/catalog_scale.py --smoke                 # 2 runs on SQLite, one call per query
    python benchmarks/catalog_scale.py --scale 1 --cache /var/tmp/ckpt-bench  # fill once, reuse after

With ``--cache DIR`` the filled catalog is kept (SQLite: a file in DIR; PostgreSQL: a database
``ckpt_bench_cache_<scale>``) and later runs start from a copy of it (the runs' writes never
reach the cache). A cached catalog is upgraded to the current schema like any existing one, so
a cache filled before a migration also exercises that migration on a full catalog.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text

from benchmarks.common import bench_parser, parse
from benchmarks.filled_tier import NODES, FilledTier
from core.errors import CopyInProgress
from core.manifest import FileEntry, Manifest
from core.retention import Rules, plan
from core.settings import MilestonePolicy, RetentionPolicy, Settings, load_settings
from db import register
from db.catalog import Catalog, upgrade
from db.rows import checkpoints, files, lineage, parts, replicas, runs
from flows.common import Steps
from flows.reconcile import reconcile_once
from tasks.retention import plan_retention

STEPS, FILES, GROUP = 100, 8, 20  # steps per run, files per checkpoint, runs per resume chain
SMOKE = {"scale": 0.0001, "backend": "sqlite", "registrations": 20, "batch": 10, "reconcile_rounds": 1,
         "changed": 2}
PG_ADMIN = os.environ.get("CKPT_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


# --- fill ---------------------------------------------------------------------------------------
def fill(cat: Catalog, n_runs: int, *, chunk: int = 50) -> float:
    """Insert ``n_runs`` runs straight into the tables; returns seconds."""
    t0 = time.perf_counter()
    now = datetime.now(UTC)
    for first in range(0, n_runs, chunk):
        rows = _chunk_rows(range(first, min(first + chunk, n_runs)), now)
        with cat.engine.begin() as conn:
            for table, values in rows:
                if not values:
                    continue
                if conn.dialect.name == "postgresql":
                    _copy(conn, table, values)
                else:
                    conn.execute(table.insert(), values)
        done = min(first + chunk, n_runs)
        if done % max(chunk, n_runs // 10) == 0 or done == n_runs:
            rate = done * STEPS / (time.perf_counter() - t0)
            print(f"  filled {done}/{n_runs} runs ({rate:,.0f} checkpoints/s)", flush=True)
    with cat.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            for table in ("runs", "checkpoints", "checkpoint_files", "replicas"):
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                                  f"(SELECT max(id) FROM {table}))"))
    if cat.engine.dialect.name == "postgresql":
        # what autovacuum does for a real catalog. A SQLite catalog has no statistics (nothing
        # runs ANALYZE; and through the catalog's engine, whose connections always BEGIN, an
        # ANALYZE here was rolled back unseen): its queries are measured as they plan without.
        with cat.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
    return time.perf_counter() - t0


def _copy(conn, table, values: list[dict]) -> None:
    """PostgreSQL COPY: the fill's 8M file rows at COPY speed instead of INSERT speed."""
    cols = list(values[0])
    cur = conn.connection.dbapi_connection.cursor()
    with cur.copy(f"COPY {table.name} ({', '.join(cols)}) FROM STDIN") as copy:
        for v in values:
            copy.write_row([json.dumps(v[c]) if isinstance(v[c], dict) else v[c] for c in cols])


def _cid(run: int, step_idx: int) -> int:
    return run * STEPS + step_idx + 1


def _chunk_rows(run_range, now):
    out = {t: [] for t in ("runs", "ckpts", "parts", "files", "reps", "edges")}
    for r in run_range:
        parent = None if r % GROUP == 0 else (f"run-{r - 1:05d}", 50 * 10)
        out["runs"].append(dict(id=r + 1, name=f"run-{r:05d}", project="bench", created_at=now, tags={},
                                parent_run=parent and parent[0], parent_step=parent and parent[1],
                                parent_relation="resumed_from" if parent else None))
        for i in range(STEPS):
            cid, step = _cid(r, i), (i + 1) * 10
            on_t1, on_t0, milestone = i < STEPS - 2, i >= STEPS - 3, (i + 1) % 10 == 0
            mask = (1 if on_t0 else 0) | (2 if on_t1 else 0) | (4 if milestone else 0)
            at = now - timedelta(minutes=(STEPS - i) * 10)
            out["ckpts"].append(dict(
                id=cid, run_id=r + 1, step=step, kind="milestone" if milestone else "step", state="committed",
                format="safetensors", parts=1, parts_registered=1, total_bytes=FILES * 2**30, file_count=FILES,
                metrics={"loss": random.random()}, tags={}, created_at=at, committed_at=at,
                writer_stall_seconds=1.0, verified_tiers=mask, milestone_marks=1 if milestone else 0))
            out["parts"].append(dict(checkpoint_id=cid, part=0, node="node-0", manifest_digest=uuid.uuid4().hex,
                                     bytes=FILES * 2**30, file_count=FILES, registered_at=at))
            out["files"] += [dict(checkpoint_id=cid, part=0, path=f"model-{f:05d}.safetensors", size=2**30,
                                  algorithm="crc32c", checksum=f"{random.getrandbits(32):08x}") for f in range(FILES)]
            # Tier 0: node-(r % NODES) holds the third newest; the newest two, never promoted, are
            # on a node whose agent is down (so node-0's reconcile has nothing to promote)
            node = f"node-{r % NODES}" if on_t1 else f"down-{r % NODES}"
            for tier, present in ((0, on_t0), (1, on_t1), (2, milestone)):
                if present:
                    out["reps"].append(dict(checkpoint_id=cid, tier=tier, part=0, url=f"t{tier}://run-{r}/{step}",
                                            state="verified", bytes=FILES * 2**30, verified_at=at, created_at=at,
                                            updated_at=at, checked_at=at, node=node if tier == 0 else None))
            if i > 0:
                out["edges"].append(dict(child_id=cid, parent_id=cid - 1, relation="follows", created_at=at))
            elif parent:
                out["edges"].append(dict(child_id=cid, parent_id=_cid(r - 1, 49), relation="resumed_from",
                                         created_at=at))
    return [(runs, out["runs"]), (checkpoints, out["ckpts"]), (parts, out["parts"]), (files, out["files"]),
            (replicas, out["reps"]), (lineage, out["edges"])]


# --- timing -------------------------------------------------------------------------------------
def timed(fn, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def run_queries(cat: Catalog, n_runs: int, samples: int) -> list[tuple[str, float, float]]:
    rnd = random.Random(7)
    name = lambda: f"run-{rnd.randrange(n_runs):05d}"  # noqa: E731
    step = lambda: rnd.randrange(1, STEPS + 1) * 10  # noqa: E731
    rules = Rules(policies={0: RetentionPolicy(keep_last=3), 1: RetentionPolicy(keep_last=10)})
    cases = [
        ("baseline get_checkpoint", lambda: cat.get_checkpoint(name(), step())),
        ("1 newest_verified", lambda: cat.newest_verified(name())),
        ("1 newest_verified durable, follow", lambda: cat.newest_verified(name(), durable_only=True,
                                                                         follow_resumed=True)),
        ("2 locations", lambda: cat.locations(name(), step())),
        ("4 ancestors depth 50", lambda: _check(cat.ancestors(name(), 500, max_depth=50), 50)),
        ("6 under_replicated (run)", lambda: cat.under_replicated(run=name())),
        ("6 under_replicated (all, first 100)", lambda: cat.under_replicated(limit=100)),
        ("7 retention_facts (run)", lambda: cat.retention_facts(run=name())),
        ("7 retention_facts + plan (run)", lambda: plan(cat.retention_facts(run=name()), rules, cat.clock())),
        ("reconcile: milestones to archive (all)", lambda: cat.milestone_backlog(MilestonePolicy())),
    ]
    results = []
    for label, fn in cases:
        fn()  # warm
        xs = timed(fn, samples)
        results.append((label, pct(xs, 50), pct(xs, 95)))
    return results


def _check(edges, want_max: int) -> None:
    assert edges and max(e.depth for e in edges) <= want_max


def registration(cat: Catalog, n: int, batch: int) -> dict[str, float]:
    """Registrations/s: ``one`` (one ``register_part`` per transaction, what an agent does per
    part; ``statements``: what the client sent for each, BEGIN/COMMIT not counted), ``many``
    (``register_many``), ``floor`` (a bare committed one-row INSERT per transaction) and, on
    PostgreSQL, ``each``: the same registrations a statement per table (the path before the
    one-statement form, SQLite's path), in alternating rounds with ``one``."""
    from sqlalchemy import event

    with cat.engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_commit (id INTEGER)"))
    t = time.perf_counter()
    for i in range(n):
        with cat.engine.begin() as conn:
            conn.execute(text("INSERT INTO bench_commit (id) VALUES (:i)"), {"i": i})
    out = {"floor": n / (time.perf_counter() - t)}
    tag = uuid.uuid4().hex[:6]

    def manifests(run: str, count: int):
        cat.ensure_run(run)
        return [Manifest(run=run, step=s, files=tuple(FileEntry(f"model-{f:05d}.safetensors", 2**30, f"{f:08x}")
                                                      for f in range(FILES)), format="safetensors")
                for s in range(count)]

    one_statement = register._insert_new_pg
    variants = {"one": one_statement}
    if cat.engine.dialect.name == "postgresql":
        variants["each"] = register._insert_new_each
    sent, spent = [0], dict.fromkeys(variants, 0.0)

    def count(*_args) -> None:
        sent[0] += 1

    rounds = 4
    event.listen(cat.engine, "before_cursor_execute", count)
    try:
        for r in range(rounds):
            for label in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                register._insert_new_pg = variants[label]
                todo = manifests(f"reg-{label}-{r}-{tag}", n // rounds)
                before, t = sent[0], time.perf_counter()
                for m in todo:
                    cat.register_part(m, actor="bench")
                spent[label] += time.perf_counter() - t
                if label == "one":
                    out["statements"] = (sent[0] - before) / len(todo)
    finally:
        register._insert_new_pg = one_statement
        event.remove(cat.engine, "before_cursor_execute", count)
    out |= {label: rounds * (n // rounds) / secs for label, secs in spent.items()}
    bulk = manifests(f"reg-bulk-{tag}", n)
    t = time.perf_counter()
    for i in range(0, n, batch):
        cat.register_many(bulk[i:i + batch], actor="bench")
    out["many"] = n / (time.perf_counter() - t)
    return out


# --- reconcile ----------------------------------------------------------------------------------
def reconcile_cost(url: str, n_runs: int, rounds: int, k: int, top: int = 3,
                   ) -> tuple[list[tuple[str, float, float, float, float]], list[tuple[float, str]]]:
    """One reconcile pass of ``node-0`` over the filled catalog with both tiers present
    (``FilledTier``): (label, queries per pass, p50 s, p95 s, median s spent in SQL) with nothing
    changed and with
    ``k`` Tier 1 copies of the pass's slice vanished; and the ``top`` statements by SQL time per
    quiet pass (seconds, text). The pipeline's steps are held
    (``CopyInProgress``): what is timed is reconcile's own work, not copies."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def hold(*_a, **_kw):
        raise CopyInProgress("benchmark: reconcile's own cost only, no copies")

    FilledTier.n_runs, FilledTier.steps, FilledTier.files, FilledTier.vanished = n_runs, STEPS, FILES, set()
    work = Path(tempfile.mkdtemp(prefix="ckpt-reconcile-"))
    settings = load_settings(data_dir=work, node="node-0", catalog_url=url, tier0_url="ckptbench://t0",
                             tier1_url="ckptbench://t1")
    steps = Steps(**{f.name: hold for f in fields(Steps)} | {"plan_retention": plan_retention})
    seen: list[float] = []  # seconds of each SQL statement, as the client waited for it
    started: list[float] = []
    by_statement: collections.Counter[str] = collections.Counter()  # seconds per statement text

    def start(*_args) -> None:
        started.append(time.perf_counter())

    def done(_conn, _cursor, statement, *_args) -> None:
        seen.append(time.perf_counter() - started.pop())
        by_statement[statement] += seen[-1]

    def one_pass() -> tuple[float, int, int, float]:
        before, t = len(seen), time.perf_counter()
        report = reconcile_once(settings, steps=steps, actor="bench", grace_seconds=60)
        bad = report.promoted + report.adopted + report.failed + report.skipped
        assert not bad, f"reconcile found work in the filled catalog: {bad[:3]}"
        return time.perf_counter() - t, len(seen) - before, len(report.missing), sum(seen[before:])

    event.listen(Engine, "before_cursor_execute", start)
    event.listen(Engine, "after_cursor_execute", done)
    try:
        quiet = [one_pass() for _ in range(rounds)]
        quiet_statements = by_statement.copy()
        changed = []
        with Catalog(url) as cat:
            for _ in range(rounds):  # k copies of the coming Tier 1 slice vanish behind the catalog's back
                page = cat.verified_page(1, after_id=cat.sweep_cursor("reconcile-vanished:tier1"),
                                         limit=settings.reconcile_check_limit)
                FilledTier.vanished = {(c.replica.run, c.replica.step) for c in page[::max(1, len(page) // k)][:k]}
                changed.append(one_pass())
                assert changed[-1][2] == len(FilledTier.vanished), "a vanished copy was not found"
    finally:
        event.remove(Engine, "before_cursor_execute", start)
        event.remove(Engine, "after_cursor_execute", done)
        FilledTier.vanished = set()
        shutil.rmtree(work, ignore_errors=True)
    out = []
    for label, passes in (("nothing changed", quiet), (f"{k} copies vanished", changed)):
        secs = [p[0] for p in passes]
        out.append((label, statistics.median(p[1] for p in passes), pct(secs, 50), pct(secs, 95),
                    statistics.median(p[3] for p in passes)))
    return out, [(sql / rounds, " ".join(stmt.split())) for stmt, sql in quiet_statements.most_common(top)]


# --- backends -----------------------------------------------------------------------------------
def sqlite_url(workdir: Path) -> str:
    """A fresh folder per run: two runs at once (or a test beside a manual run) do not share a file."""
    return f"sqlite:///{Path(tempfile.mkdtemp(prefix='ckpt-catalog-scale-', dir=workdir)) / 'catalog_scale.db'}"


def pg_url(template: str | None = None) -> tuple[str, callable]:
    """A new database (a copy of ``template`` when given) and the function that drops it."""
    name = f"ckpt_bench_{uuid.uuid4().hex[:8]}"
    _pg_admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pg_admin(sql: str) -> list[tuple]:
    import psycopg

    with psycopg.connect(PG_ADMIN.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []


class Cache:
    """The filled catalog of one size, kept between runs (``--cache``): a run restores a copy
    of it instead of filling, or fills and saves one."""

    def __init__(self, folder: Path, scale: float) -> None:
        self.file = folder / f"catalog_scale-{scale:g}.db"
        self.database = f"ckpt_bench_cache_{scale:g}".replace(".", "_")

    def sqlite_restore(self, url: str) -> bool:
        if not self.file.exists():
            return False
        shutil.copyfile(self.file, url[len("sqlite:///"):])
        return True

    def pg_template(self) -> str | None:
        found = _pg_admin(f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'")
        return self.database if found else None

    def save(self, url: str) -> None:
        if url.startswith("sqlite"):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(url[len("sqlite:///"):], self.file.with_suffix(".tmp"))
            self.file.with_suffix(".tmp").rename(self.file)
        else:
            _pg_admin(f'CREATE DATABASE "{self.database}" TEMPLATE "{url.rsplit("/", 1)[1]}"')
        where = self.file if url.startswith("sqlite") else self.database
        print(f"  saved the filled catalog for later runs (--cache): {where}")


def bench_backend(label: str, url: str, args, *, cache: Cache | None = None, restored: bool = False) -> None:
    n_runs = max(2, round(10_000 * args.scale))
    t = time.perf_counter()
    rev = upgrade(url)
    if restored:
        print(f"  restored the filled catalog from the cache; upgrade to {rev}: {time.perf_counter() - t:.1f} s")
    cat = Catalog(url)
    try:
        print(f"\n== {label}: {n_runs:,} runs x {STEPS} steps = {n_runs * STEPS:,} checkpoints, "
              f"{n_runs * STEPS * FILES:,} files (load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs)", flush=True)
        if not restored:
            secs = fill(cat, n_runs)
            print(f"  fill: {secs:.0f} s ({n_runs * STEPS / secs:,.0f} checkpoints/s, direct inserts)")
            if cache is not None:
                cat.close()  # no connection may hold the file (SQLite's WAL folded in) or the database
                cache.save(url)
                cat = Catalog(url)
        results = run_queries(cat, n_runs, args.rounds)
        base95 = results[0][2]
        print(f"  {'query':40s} {'p50 ms':>8s} {'p95 ms':>8s} {'x baseline':>10s} {'vs 50 ms':>9s}")
        for q, p50, p95 in results:
            print(f"  {q:40s} {p50 * 1e3:8.2f} {p95 * 1e3:8.2f} {p95 / base95:10.1f} "
                  f"{'ok' if p95 < 0.050 else 'SLOW':>9s}")
        passes, top = reconcile_cost(url, n_runs, args.reconcile_rounds, args.changed)
        limit = Settings.model_fields["reconcile_check_limit"].default
        print(f"  reconcile pass on node-0 (checks {limit:,} verified copies per tier per pass, in rotation):")
        for label, queries, p50, p95, sql in passes:
            print(f"    {label:28s} {queries:5.0f} queries, {sql * 1e3:7.1f} ms in SQL; pass p50 {p50 * 1e3:7.1f} ms, "
                  f"p95 {p95 * 1e3:7.1f} ms (the rest: listing the checked copies' folders, Python)")
        print("    costliest statements of a quiet pass (ms per pass):")
        for sql, stmt in top:
            print(f"    {sql * 1e3:9.1f}  {stmt[:150]}")
        reg = registration(cat, args.registrations, args.batch)
        one = reg["one"]
        print(f"  registration, 8 files each: one per transaction {one:,.0f}/s ({reg['statements']:.1f} statements "
              f"each; the baseline of what follows); register_many x{args.batch} {reg['many']:,.0f}/s = "
              f"x{reg['many'] / one:.1f}; target 2,000/s: {'ok' if max(one, reg['many']) >= 2000 else 'MISSED'}")
        if "each" in reg:
            print(f"    the same a statement per table (as before; alternating rounds): {reg['each']:,.0f}/s = "
                  f"x{reg['each'] / one:.2f}")
        print(f"    a bare committed one-row INSERT per transaction (the commit's floor): {reg['floor']:,.0f}/s = "
              f"x{reg['floor'] / one:.2f}")
        print(f"  (load average at the end {os.getloadavg()[0]:.1f}: other work on the machine skews these)")
    finally:
        cat.close()


def main() -> None:
    ap = bench_parser(__doc__.split("\n\n")[0], rounds=200)  # a round: one timed call per query
    ap.add_argument("--samples", dest="rounds", type=int, default=argparse.SUPPRESS, help="same as --rounds")
    ap.add_argument("--scale", type=float, default=0.01, help="fraction of 10,000 runs (1 = the issue's size)")
    ap.add_argument("--backend", choices=("sqlite", "pg", "both"), default="both")
    ap.add_argument("--registrations", type=int, default=4000, help="manifests registered for throughput")
    ap.add_argument("--batch", type=int, default=500, help="register_many batch size")
    ap.add_argument("--reconcile-rounds", type=int, default=10, help="reconcile passes timed per case")
    ap.add_argument("--changed", type=int, default=10, help="copies that vanish before each 'changed' pass")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    ap.add_argument("--cache", type=Path, default=None,
                    help="keep the filled catalog here (PostgreSQL: a database) and start later runs from a copy")
    args = parse(ap, SMOKE)
    cache = Cache(args.cache, args.scale) if args.cache else None
    if args.backend in ("sqlite", "both"):
        url = sqlite_url(args.workdir)
        try:
            restored = cache is not None and cache.sqlite_restore(url)
            bench_backend("SQLite", url, args, cache=cache, restored=restored)
        finally:
            if not os.environ.get("CKPT_BENCH_KEEP"):
                shutil.rmtree(Path(url[len("sqlite:///"):]).parent, ignore_errors=True)
    if args.backend in ("pg", "both"):
        template = cache.pg_template() if cache else None
        url, drop = pg_url(template)
        try:
            bench_backend("PostgreSQL", url, args, cache=cache, restored=template is not None)
        finally:
            drop()  # also on Ctrl-C; a killed run leaves a ckpt_bench_* database to drop by hand


if __name__ == "__main__":
    main()
