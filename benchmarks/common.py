"""What every benchmark shares: the command line (``--smoke``, ``--rounds``, existing servers),
timed rounds with the contenders' order rotated, the medians-and-ratios table, test data.

The smoke convention: ``--smoke`` sets each script's tiny size and one round (flags given
explicitly still win), so the whole script runs in seconds and prints its table; the figures
of a smoke run mean nothing, the table's presence is the point (tests/integration/
test_benchmarks_smoke.py runs every script this way in ``make test``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckpt.local_stack import start_moto, start_prefect_server
from ckpt.processes import stop_process

ROOT = Path(__file__).resolve().parents[1]


# --- command line -------------------------------------------------------------------------------
def bench_parser(doc: str | None, *, rounds: int, api_url: bool = False, s3_endpoint: bool = False,
                 ) -> argparse.ArgumentParser:
    """A parser with the flags every benchmark has; the script adds its own sizes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds per contender")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny size and one round: checks the script runs, the figures mean nothing")
    if api_url:
        ap.add_argument("--api-url", default=None,
                        help="an existing Prefect server's API URL (default: start one, 20-30 s)")
    if s3_endpoint:
        ap.add_argument("--s3-endpoint", default=None,
                        help="an existing S3 endpoint, e.g. moto's (default: start moto's server)")
    return ap


def parse(ap: argparse.ArgumentParser, smoke: dict[str, Any], argv: list[str] | None = None) -> argparse.Namespace:
    """Parse; with ``--smoke`` the values in ``smoke`` (and one round) replace the defaults."""
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**{"rounds": 1, **smoke})
        args = ap.parse_args(argv)
        print("smoke run: tiny size, figures are not meaningful")
    return args


# --- servers ------------------------------------------------------------------------------------
@contextmanager
def prefect_api(api_url: str | None, home: Path) -> Iterator[str]:
    """``api_url`` when given, else a Prefect server (SQLite under ``home``) started here and
    stopped on exit; yields the API URL."""
    with prefect_server(api_url, home) as (url, _proc):
        yield url


@contextmanager
def prefect_server(api_url: str | None, home: Path, *, access_log: bool = False) -> Iterator[tuple[str, Any]]:
    """``prefect_api`` that also yields the server's process (None for ``api_url``: not ours).
    ``access_log``: the server logs one line per request (uvicorn's access log) to
    ``home/server.log``, for a benchmark that counts them."""
    if api_url:
        yield api_url, None
        return
    key, before = "PREFECT_SERVER_LOGGING_LEVEL", os.environ.get("PREFECT_SERVER_LOGGING_LEVEL")
    if access_log:
        os.environ[key] = "INFO"  # the server's environment is this one's, read as it starts
    try:
        proc, url = start_prefect_server(home, port=None, ui=False)
    finally:
        if access_log and before is None:
            del os.environ[key]
        elif access_log:
            os.environ[key] = before
    try:
        yield url, proc
    finally:
        stop_process(proc, grace=20.0)


@contextmanager
def s3_bucket(endpoint: str | None, log: Path, *, ranges_at_cost: bool = False) -> Iterator[tuple[str, str]]:
    """A fresh bucket on ``endpoint`` when given, else on moto's server started here and
    stopped on exit; yields (endpoint URL, bucket). Sets fake AWS credentials if none are set.
    ``ranges_at_cost``: the moto started here serves a ranged GET from the range's bytes alone
    (``benchmarks/moto_ranges.py``), as S3 does, not from a copy of the whole object."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    if endpoint:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        try:
            yield endpoint, bucket
        finally:  # someone else's server: leave it as found, or say what is left
            try:
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                    for obj in page.get("Contents", []):
                        client.delete_object(Bucket=bucket, Key=obj["Key"])
                client.delete_bucket(Bucket=bucket)
            except Exception as exc:  # noqa: BLE001 - the figures are printed already
                print(f"bucket {bucket} left on {endpoint}: {exc}")
        return
    server = (str(Path(__file__).with_name("moto_ranges.py")),) if ranges_at_cost else ("-m", "moto.server")
    proc, url = start_moto(log, bucket=bucket, server=server)
    try:
        yield url, bucket
    finally:
        stop_process(proc)


# --- timing -------------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """CPU of this process (all threads) and of its finished children (``cp``): steadier than
    wall time when other work shares the machine. A server started here still runs, so it is
    not counted."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(fn: Callable[[], object], *, sync: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``fn``; ``sync`` first so that no dirty pages of the last
    round are written back during this one."""
    if sync:
        subprocess.run(["sync"], check=True)
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


Times = dict[str, list[float]]


def run_rounds(contenders: dict[str, Callable[[], object]], rounds: int, *,
               before: Callable[[str], object] | None = None, sync: bool = False) -> tuple[Times, Times]:
    """Each contender once per round, the order rotated every round so that none always runs
    first (or right after another); ``before(name)`` runs untimed before each. Returns (wall
    seconds, CPU seconds) per contender."""
    names = list(contenders)
    wall: Times = {k: [] for k in names}
    cpu: Times = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if before:
                before(name)
            w, c = measure(contenders[name], sync=sync)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


# --- output -------------------------------------------------------------------------------------
def table(title: str, times: Times, base: str, *, nbytes: int | None = None, cpu: Times | None = None) -> float:
    """Print medians with ratios to the ``base`` contender's median (best-of-rounds and CPU s/GB
    beside them when given); returns the baseline median. Contenders without samples (a row
    that needs more rounds) are left out."""
    base_med, base_best = statistics.median(times[base]), min(times[base])
    head = f"{'contender':40} {'median s':>9} {'x base':>7} {'best s':>8} {'x base':>7}"
    if nbytes:
        head += f" {'MB/s':>8}"
    if cpu:
        base_cpu = statistics.median(cpu[base])
        head += f" {'CPU s/GB':>9} {'x base':>7}"
    print(f"\n{title} (baseline: {base})")
    print(head + "   rounds (s)")
    for name, ts in times.items():
        if not ts:
            continue
        med = statistics.median(ts)
        row = f"{name:40} {med:9.4f} {med / base_med:7.2f} {min(ts):8.4f} {min(ts) / base_best:7.2f}"
        if nbytes:
            row += f" {nbytes / med / 1e6:8.1f}"
        if cpu:
            c = statistics.median(cpu[name])
            row += f" {c / (nbytes / 1e9) if nbytes else c:9.2f} {c / base_cpu if base_cpu else 0:7.2f}"
        print(row + "   " + " ".join(f"{t:.3f}" for t in ts))
    return base_med


def ratio(times: Times, name: str, base: str) -> float:
    return statistics.median(times[name]) / statistics.median(times[base])


def load_line(load_at_start: float) -> str:
    return (f"load average (1 min) at start/end: {load_at_start:.1f}/{os.getloadavg()[0]:.1f} "
            f"on {os.cpu_count()} CPUs (other work on the machine skews these)")


# --- test data ----------------------------------------------------------------------------------
def write_shards(folder: Path, total_bytes: int, shards: int, *, seed: int = 0) -> None:
    """A Hugging Face sharded safetensors checkpoint: ``shards`` float32 files and the index
    (no manifest: the caller builds it, timed or not)."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    per = max(1, total_bytes // shards // 4)  # float32 elements per shard
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layer{i}.weight": rng.random(per, dtype=np.float32)}, str(folder / name))
        weight_map[f"layer{i}.weight"] = name
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": shards * per * 4}, "weight_map": weight_map}))
