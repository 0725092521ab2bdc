"""What a promotion costs in CPU outside its bytes: the same small milestone checkpoint promoted
Tier 0 -> Tier 1 -> Tier 2 (moto's S3 server) by the plain steps (``flows.common.plain_steps``,
no Prefect), with the per-process catalog engines, schema checks and S3 clients shared
("warm", how a long-lived worker runs), shared but cleared before the promotion (a flow-run
process that promotes once: its steps share them) and cleared before every step ("cold": a
new engine, a schema check and a boto3 client in every step that opens them, as before they
were shared), in the same run.

    .venv/bin/python benchmarks/promotion_cpu.py [--size-mib 16] [--shards 4] [--rounds 10]
        [--catalog-url postgresql+psycopg://...] [--s3-endpoint URL]
    .venv/bin/python benchmarks/promotion_cpu.py --smoke      # 1 MiB, one round

CPU seconds are this process's (all threads) plus its finished children's; moto's server, when
started here, is not counted (it still runs). The two copies alone (the transfer engine's
copy_part Tier 0 -> 1 and 1 -> 2, read-backs included, stores already open) are measured too
and subtracted: what is left is the promotion's CPU outside its copies. Retention is off so
every promotion does the same work. The machine's other load shows in the figures: compare
the two contenders of one run, not runs.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, measure, parse, run_rounds, s3_bucket, table, write_shards
from core.layout import checkpoint_prefix
from core.manifest_build import build_manifest, write_manifest
from core.settings import load_settings
from core.storage import open_store
from core.storage.s3 import forget_clients
from core.transfer import copy_part
from db.catalog import Catalog, forget_schema_checks, upgrade
from db.session import forget_engines
from flows.common import Steps, plain_steps
from flows.promote import promote

RUN, NODE = "bench", "bench-node"
SMOKE = {"size_mib": 1, "shards": 2}
COLD, WARM = "cold: new engine, check, client per step", "warm: shared per process"
ONCE = "shared, cleared before the promotion"  # a flow-run process that promotes once


def main() -> None:
    ap = bench_parser(__doc__, rounds=10, s3_endpoint=True)
    ap.add_argument("--size-mib", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--catalog-url", default=None, help="default: SQLite in a temporary folder")
    args = parse(ap, SMOKE)

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        with s3_bucket(args.s3_endpoint, work / "moto.log") as (endpoint, bucket):
            os.environ.update({
                "CKPT_DATA_DIR": str(work / "data"), "CKPT_NODE": NODE, "CKPT_TASK_RETRIES": "0",
                "CKPT_TIER2_URL": f"s3://{bucket}/tier2", "CKPT_S3_ENDPOINT_URL": endpoint,
                "CKPT_MILESTONES__EVERY_STEPS": "1",  # every checkpoint goes on to Tier 2
                **{f"CKPT_RETENTION_TIER{t}__ENABLED": "false" for t in range(3)},
            })
            if args.catalog_url:
                os.environ["CKPT_CATALOG_URL"] = args.catalog_url
            measure_rounds(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def forget_shared() -> None:
    """Today's cold start: no engine, schema check or S3 client survives from the last step."""
    forget_engines()
    forget_schema_checks()
    forget_clients()


def forgetting(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step``, starting cold."""

    def cold_step(*args: Any, **kwargs: Any) -> Any:
        forget_shared()
        return step(*args, **kwargs)

    return cold_step


def measure_rounds(args) -> None:
    settings = load_settings()
    upgrade(settings.catalog_url)
    with Catalog(settings.catalog_url) as cat:
        cat.ensure_run(RUN, actor="bench")
    size, steps = args.size_mib << 20, plain_steps()
    cold_steps = Steps(**{f.name: forgetting(getattr(steps, f.name)) for f in fields(Steps)})
    state = {"step": 0}

    def write_next(_name: str) -> None:  # untimed, before each contender
        state["step"] += 1
        folder = Path(settings.tier0_url) / checkpoint_prefix(RUN, state["step"])
        write_shards(folder, size, args.shards, seed=state["step"])
        write_manifest(folder, build_manifest(folder, RUN, state["step"], node=NODE))

    def promote_next(how: Steps = steps) -> None:
        result = promote(settings, RUN, state["step"], steps=how, node=NODE, actor="bench")
        assert result.durable and result.archive and result.archive.archived, result.summary()

    def cold() -> None:
        forget_shared()
        promote_next(cold_steps)

    def once() -> None:
        forget_shared()
        promote_next()

    write_next("warm-up")
    promote_next()  # imports, the S3 endpoint's checksum probe, first connections
    print(f"checkpoint: {args.size_mib} MiB in {args.shards} safetensors shards, Tier 0 -> 1 -> 2; "
          f"catalog {settings.catalog_url.split(':', 1)[0]}; {args.rounds} rounds")
    wall, cpu = run_rounds({COLD: cold, ONCE: once, WARM: promote_next}, args.rounds, before=write_next)
    table("CPU seconds per promotion", cpu, COLD)
    table("wall seconds per promotion", wall, COLD)
    bytes_cpu = byte_work_cpu(settings, size, args.shards, args.rounds)
    cold_ms, once_ms, warm_ms = (statistics.median(cpu[k]) * 1000 for k in (COLD, ONCE, WARM))
    print(f"\nthe same copies alone (copy_part Tier 0 -> 1 -> 2, stores open): {bytes_cpu * 1000:.0f} ms CPU")
    print(f"CPU outside the bytes: cold {cold_ms - bytes_cpu * 1000:.0f} ms, "
          f"cleared before the promotion {once_ms - bytes_cpu * 1000:.0f} ms, warm {warm_ms - bytes_cpu * 1000:.0f} ms "
          "per promotion (catalog, Tier 0 verify, format checks, what each step opens)")
    print(f"ratio: warm / cold = {warm_ms / cold_ms:.2f} x CPU per promotion; "
          f"cleared before the promotion / cold = {once_ms / cold_ms:.2f} x")


def byte_work_cpu(settings, size: int, shards: int, rounds: int) -> float:
    """Median CPU seconds of the same bytes copied by the transfer engine alone, stores open."""
    t0, t1, t2 = (open_store(settings.tier_url(t), t, settings) for t in range(3))
    try:
        got = []
        for r in range(rounds):
            prefix = checkpoint_prefix("bytes", r)
            folder = Path(settings.tier0_url) / prefix
            write_shards(folder, size, shards, seed=r)
            manifest = build_manifest(folder, "bytes", r, node=NODE)
            got.append(measure(lambda: (copy_part(t0, prefix, t1, prefix, manifest),
                                        copy_part(t1, prefix, t2, prefix, manifest)))[1])
        return statistics.median(got)
    finally:
        for store in (t0, t1, t2):
            store.close()


if __name__ == "__main__":
    main()
