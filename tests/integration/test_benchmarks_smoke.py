"""Every script in benchmarks/ runs in its smoke form (``--smoke``: tiny size, one round) and
prints its table of medians and ratios, so a benchmark that no longer runs fails ``make test``
instead of waiting for the next person who measures. The figures of a smoke run mean nothing;
the tests check that the table is there: its header, the baseline row at ratio 1.00, every
contender's row with a ratio, and the script's ratio line.

The scripts run as child processes (as a person runs them) against the session's moto and
Prefect servers (``--s3-endpoint``, ``--api-url``), so none starts a server of its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.require import require_module

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds per script; a smoke run takes 1-25 s on an idle 2-core machine

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def run_benchmark(script: str, *args: str) -> str:
    """Run ``benchmarks/<script>.py --smoke *args``; return its stdout after checking it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_") and k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--smoke", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout


def table_ratios(out: str, base: str) -> dict[str, float]:
    """The ``x base`` ratio of every row of the table whose baseline is ``base``
    (the layout of ``benchmarks.common.table``)."""
    lines = out.splitlines()
    title = next((i for i, line in enumerate(lines) if line.endswith(f"(baseline: {base})")), None)
    assert title is not None, f"no table with baseline {base!r} in:\n{out}"
    header = lines[title + 1].split()
    assert header[:4] == ["contender", "median", "s", "x"], lines[title + 1]
    rows = {}
    for line in lines[title + 2:]:
        if not re.match(r".{40} +\d+\.\d+ +\d+\.\d+ ", line):
            break
        rows[line[:40].strip()] = float(line[40:].split()[1])
    assert rows.get(base) == 1.0, f"baseline row {base!r} missing or not at 1.00:\n{out}"
    return rows


def assert_rows(out: str, base: str, contenders: list[str]) -> None:
    rows = table_ratios(out, base)
    assert set(contenders) <= set(rows), f"rows {sorted(rows)} lack some of {contenders}:\n{out}"
    assert all(r > 0 for r in rows.values()), rows


def test_writeback():
    out = run_benchmark("writeback")
    assert_rows(out, "no early writeback (fsync writes all)",
                ["early writeback every 1 MiB", "early writeback every 4 MiB"])
    assert re.search(r"early writeback every 1 MiB: fsync \d+\.\d{3} s against \d+\.\d{3} s without", out), out


def test_promote_tier1():
    out = run_benchmark("promote_tier1")
    assert_rows(out, "cp -r && sync", ["cp -r", "whole hop (one Tier 0 read)", "whole hop, Tier 1 direct I/O",
                                       "whole hop, verify then copy (before)"])
    assert re.search(r"goal: whole hop <= 1\.0 x cp -r && sync -> \d+\.\d\d x median", out), out
    # the fused promotion reads Tier 0 once, the one before it twice
    assert re.search(r"whole hop \(one Tier 0 read\) .* = 1\.0\d\d x checkpoint bytes", out), out
    assert re.search(r"whole hop, Tier 1 direct I/O .* = 1\.0\d\d x checkpoint bytes", out), out
    assert re.search(r"verify then copy \(before\) .* = 2\.0\d\d x checkpoint bytes", out), out


def ratio_line(out: str, pattern: str) -> float:
    """The figure of the ``ratio...: <pattern> = N.NN x`` line (``pattern`` is literal text)."""
    found = re.search(rf"^ratio[^:]*: {re.escape(pattern)} = (\d+\.\d\d) x$", out, re.MULTILINE)
    assert found, f"no ratio line {pattern!r} in:\n{out}"
    return float(found.group(1))


def test_client_stall():
    out = run_benchmark("client_stall")
    rows = table_ratios(out, "safetensors save_file")
    assert_rows(out, "safetensors save_file", ["safetensors save_file + fsync", "ours: save",
                                               "ours: save(background), first save"])
    durable = ratio_line(out, "ours: save / safetensors save_file + fsync")
    assert durable > 0
    assert abs(durable - rows["ours: save"] / rows["safetensors save_file + fsync"]) < 0.05 * durable + 0.02, out
    stall = ratio_line(out, "ours: save(background), first save / safetensors save_file")  # one smoke round
    assert abs(stall - rows["ours: save(background), first save"]) <= 0.011, out
    assert_rows(out, "dcp.save", ["dcp.async_save (call)", "ours: dcp.save + save(folder)",
                                  "ours: async_save_and_commit (call)"])
    dcp = ratio_line(out, "ours: async_save_and_commit (call) / dcp.save")
    assert abs(dcp - table_ratios(out, "dcp.save")["ours: async_save_and_commit (call)"]) <= 0.011, out
    assert re.search(r"^load average \(1 min\) at start/end: [\d.]+/[\d.]+ on \d+ CPUs", out, re.MULTILINE), out


def test_catalog_scale():
    out = run_benchmark("catalog_scale")
    assert re.search(r"query +p50 ms +p95 ms +x baseline", out), out
    assert re.search(r"baseline get_checkpoint +[\d.]+ +[\d.]+ +1\.0 ", out), out
    for query in ("1 newest_verified", "2 locations", "4 ancestors depth 50", "6 under_replicated (run)",
                  "7 retention_facts + plan (run)"):
        assert re.search(re.escape(query) + r" +[\d.]+ +[\d.]+ +\d+\.\d ", out), (query, out)
    assert re.search(r"register_many x10 [\d,]+/s = x\d+\.\d", out), out
    for case in ("nothing changed", "2 copies vanished"):  # reconcile's cost per pass
        assert re.search(re.escape(case) + r" +\d+ queries, +[\d.]+ ms in SQL; pass p50 +[\d.]+ ms", out), (case, out)


def test_upload_tier2(s3_endpoint):
    out = run_benchmark("upload_tier2", "--s3-endpoint", s3_endpoint)
    assert_rows(out, "boto3 upload_file (defaults)", ["ours: copy_part -> S3 (verified)"])
    assert re.search(r"ratio: ours / boto3 upload_file = \d+\.\d\d x wall", out), out


def test_promotion_cpu(s3_endpoint):
    out = run_benchmark("promotion_cpu", "--s3-endpoint", s3_endpoint)
    assert_rows(out, "cold: new engine, check, client per step", ["warm: shared per process",
                                                                  "shared, cleared before the promotion"])
    assert re.search(r"CPU outside the bytes: cold -?\d+ ms, cleared before the promotion -?\d+ ms, "
                     r"warm -?\d+ ms ", out), out
    assert re.search(r"ratio: warm / cold = \d+\.\d\d x CPU per promotion; "
                     r"cleared before the promotion / cold = \d+\.\d\d x", out), out


def test_agent_cpu():
    out = run_benchmark("agent_cpu")  # its own server: the server's side is measured too
    assert_rows(out, "ours: the agent as it ships", [])
    assert re.search(r"agent CPU per promotion: \d+\.\d{3} s \(best \d+\.\d{3}\)", out), out
    requests = re.search(r"^API requests per promotion \(the runner's polls left out\), ours: the agent as it ships: "
                         r"(\d+\.\d) \(events websockets opened: (\d+\.\d)\)$", out, re.MULTILINE)
    assert requests and float(requests.group(1)) > 0, out[-1500:]  # its checkpoint's run talks to the server


def test_restore(s3_endpoint):
    out = run_benchmark("restore", "--s3-endpoint", s3_endpoint)
    assert_rows(out, "cp -r (Tier 1 folder)", ["cp -r && sync", "ours: restore from Tier 1"])
    assert_rows(out, "boto3 download_file, one at a time", ["boto3 download_file, 4 at a time",
                                                            "ours: restore from Tier 2"])
    assert re.search(r"ratios: ours / download_file one at a time = \d+\.\d\d x", out), out
    assert "'Connection pool is full' warnings during the Tier 2 rounds: 0" in out, out


@pytest.mark.prefect
def test_prefect_overhead(prefect_server):
    out = run_benchmark("prefect_overhead", "--api-url", prefect_server)
    assert_rows(out, "plain functions", ["flow", "flow, no heartbeat"])
    assert re.search(r"overhead of 'flow': [+-]\d+ ms per promotion", out), out
    assert re.search(r"goal: flow <= 1\.10 x plain functions: 'flow, no heartbeat' .* \d+\.\d\d x", out), out


@pytest.mark.prefect
def test_event_latency(prefect_server):
    out = run_benchmark("event_latency", "--api-url", prefect_server)
    assert_rows(out, "agent: emit -> verified on Tier 1", ["agent: emit -> durable (run done)"])
    assert re.search(r"goal: emit -> verified on Tier 1 <= 2 s median \(4 MB\): \d+\.\d\d s", out), out


def test_trainer_stall():
    require_module("transformers")
    require_module("lightning")
    out = run_benchmark("trainer_stall")
    assert_rows(out, "Trainer save (no callback)", ["ours: Trainer save + TieringCallback"])
    assert_rows(out, "ModelCheckpoint, TorchCheckpointIO", ["ours: TieringCheckpointIO"])
    assert re.search(r"ratio \(HF Trainer\): ours / Trainer save \(no callback\) = \d+\.\d\d x", out), out
    assert re.search(r"ratio \(Lightning\): ours / ModelCheckpoint, TorchCheckpointIO = \d+\.\d\d x", out), out


def test_training_interference():
    """One smoke run, with a core left to the node where there are two (``--threads``: the
    cores the loop's matmuls use; the default, all of them, is the same code)."""
    require_module("torch", "the torch extra")
    cores = os.cpu_count() or 1
    out = run_benchmark("training_interference", *(["--threads", str(cores - 1)] if cores >= 2 else []))
    if cores >= 2:
        assert f"matmuls on {cores - 1} threads" in out, out
        assert re.search(rf"with 1 of {cores} cores free of the loop, that is \d+\.\d% of the loop's cores", out), out
    assert re.search(r"alone \(baseline\) +\d+\.\d", out), out
    for prio in ("nice 10, I/O best-effort 7", "nice 0, I/O unchanged"):
        for mode in ("direct I/O", "buffered"):
            assert re.search(rf"beside a promotion, {prio}, {mode} .* -?\d+\.\d%", out), out
            assert re.search(rf"beside training, {prio}, {mode} +\d+\.\d{{3}}", out), out
    for mode in ("direct I/O", "buffered"):
        assert re.search(rf"quiet, no training, {mode} \(baseline\) +\d+\.\d{{3}}", out), out
        assert re.search(rf"promotion CPU, quiet, {mode} .*: \d+\.\d{{3}} s \(user \d+\.\d{{3}}, "
                         r"system \d+\.\d{3}\) .* that is \d+\.\d% of the loop's cores, the least it loses", out), out
    assert re.search(r"goal \(nice 10, I/O best-effort 7, buffered\): training slowdown <= 5 % -> -?\d+\.\d%, "
                     r"(MET|NOT MET); promotion <= 1\.5 x quiet -> \d+\.\d\d x", out), out


def test_training_interference_refuses_more_threads_than_cores():
    require_module("torch", "the torch extra")
    cores = os.cpu_count() or 1
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "training_interference.py"), "--smoke",
                           "--threads", str(cores + 1)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"--threads {cores + 1}: out of range" in proc.stderr, proc.stderr


def test_agent_memory():
    out = run_benchmark("agent_memory")
    assert re.search(r"bare interpreter \(baseline\) +\d+\.\d", out), out
    assert re.search(r"part process \(ready to copy\) +\d+\.\d", out), out
    assert re.search(r"goal: agent \+ its part process <= 150 MB -> \d+ \+ \d+ = \d+ MB", out), out
    assert re.search(r"spawned part process \(baseline\) \(\d processes\) +\d+\.\d", out), out
    # the agent, its zygote and the part forked from the zygote
    assert re.search(r"part process from the zygote \(3 processes\) +\d+\.\d", out), out
    assert re.search(r"forked, the group holds \d+ MB \((distinct frames|PSS);", out), out
    assert re.search(r"part process from the zygote +\d+\.\d{3} +\d+\.\d{3} +\d+\.\d\d", out), out
    assert "torch/numpy not imported: yes" in out, out  # an agent never needs them


def test_cluster_restore(s3_endpoint):
    out = run_benchmark("cluster_restore", "--s3-endpoint", s3_endpoint)
    assert_rows(out, "2 x cp of the part files (Tier 1)", ["resume: Tier 0 intact (in place)",
                                                           "resume: Tier 1 in place"])
    assert_rows(out, "boto3 download_file per node (proxy)", ["resume: Tier 2 via proxy (fetched)",
                                                              "today: whole checkpoint per node (T2)"])
    assert_rows(out, "boto3 download_file per node (proxy)", ["raw read per node, nothing kept (proxy)"])
    assert "moved 0.0 MiB" in out
    # every shard's bytes come from S3 once; only the index, which every node needs and no shared
    # tier holds in this run, is read once per node (as the boto3 baseline reads it)
    again = re.search(r"bytes sent per object / its size: min 1\.00, max \d+\.\d\d; read more than once: (.*)", out)
    assert again and again.group(1) == "model.safetensors.index.json (x2.00)", out[-1500:]
    # with Tier 1 lost and rehydrated, the cluster reads every object from S3 once, the index too
    once = re.search(r"S3 during the resume rehydrating Tier 1 \(one cluster\): (\d+) objects, .*; bytes sent per "
                     r"object / its size: min (\d+\.\d\d), max (\d+\.\d\d); read more than once: (.*)", out)
    assert once and once.groups()[1:] == ("1.00", "1.00", "none"), out[-2000:]
    assert re.search(r"resume: Tier 1 lost, rehydrated from T2\s+tier 2 fetched: 2\.0 MiB; moved 2\.0 MiB", out), \
        out[-2000:]
    assert "same resume, fetch only (no load)" in out
    # the store's side (here the proxy) and the nodes on cores of their own, where there are two
    ran = re.search(r"ran on: the proxy's threads \[([\d, ]+)\], the node processes \[([\d, ]+)\]", out)
    assert ran, out[-1500:]
    proxy_cores, node_cores = ({int(c) for c in g.split(", ")} for g in ran.groups())
    if len(os.sched_getaffinity(0)) >= 2:
        assert not proxy_cores & node_cores, ran.group(0)
        assert "the 2 node processes on" in out, out[-1500:]
    # every copy is good: no node may mark one bad because it reads another tier than it has
    assert "copies the catalog no longer holds verified after the run: 0 (none)" in out, out[-1500:]
    assert re.fullmatch(r"cluster restore: 2 nodes, tier 2 RTO \d+\.\d\d s, bound \d+\.\d\d s \(x\d+\.\d\d\), "
                        r"whole-checkpoint-per-node \d+\.\d\d s", out.strip().splitlines()[-1]), out[-500:]


def test_resume_catalog():
    out = run_benchmark("resume_catalog")
    assert_rows(out, "resume, 4 parts", ["resume, 16 parts", "every part's rows, 16 parts"])
    assert re.search(r"^sqlite: resume catalog: 16 parts, \d+\.\d ms per node \(x\d+\.\d\d of 4 parts\), "
                     r"every part's rows \d+\.\d ms$", out, re.MULTILINE), out[-1500:]


def test_dedup(s3_endpoint):
    out = run_benchmark("dedup", "--s3-endpoint", s3_endpoint)
    assert re.search(r"^bytes saved (\d+), bytes restored \1: equal$", out, re.MULTILINE), out[-1500:]
    for how in ("frozen= named", "found by the stager"):
        assert re.search(rf"^stager, {how}: tier 1 \d+\.\d{{3}} GiB, tier 2 \d+\.\d{{3}} GiB \(x\d+\.\d\d of the bound",
                         out, re.MULTILINE), out[-1500:]
    assert_rows(out, "write, hashing as written (before)",
                ["write, hashing as written (now)", "write, tensors hashed first (now)"])
    assert re.fullmatch(r"dedup: 4 checkpoints, tier 1 \d+\.\d{3} GiB, tier 2 \d+\.\d{3} GiB, bound \d+\.\d{3} GiB "
                        r"\(x\d+\.\d\d\), durable per checkpoint \d+\.\d\d s vs plain \d+\.\d\d s",
                        out.strip().splitlines()[-1]), out[-500:]


def test_prune_contents():
    out = run_benchmark("prune_contents")
    assert_rows(out, "before: then a sweep of every content", ["now: the tombstone's own contents"])
    assert re.fullmatch(r"prune_contents: 200 other contents, prune \d+\.\d\d ms vs before \d+\.\d\d ms \(median\)",
                        out.strip().splitlines()[-1]), out[-500:]
