"""Several ranks of one node resume the same checkpoint at once (8 GPUs a node is the norm):
each rank is a process of its own calling ``resume`` all at the same moment, on a node whose
Tier 0 does not hold the checkpoint, with Tier 1 not mounted here (on S3: fetched, never read in
place). The ranks resume every part (``strategy.resume_path()`` of the sharded strategies) or
the node's own part (``resume_point(part=node_rank, parts=nodes)``). Every rank gets a folder
that loads and holds what was saved, read the moment its resume returned, and the node reads
each object once. Real processes, a real catalog on SQLite and PostgreSQL, S3 on moto behind a
recording proxy."""

from __future__ import annotations

import hashlib
import multiprocessing
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.kit.checkpoints import open_catalog, write_checkpoint
from tests.kit.restore import on_node, promote, scenario_settings, tier0_dir
from tests.kit.s3_proxy import S3Proxy

RUN = "llm-ranks"
RANKS = 4
pytestmark = pytest.mark.timeout(240)


def tree(folder: Path | str) -> dict[str, str]:
    """Each data file of ``folder`` (manifests aside) by the digest of its bytes."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith("manifest")}


def rank(settings, run, part, parts, barrier, results) -> None:
    """One rank: resume at the barrier's signal, then load the folder it was given at once."""
    from safetensors.numpy import load_file

    from tasks.resume import resume

    barrier.wait()
    try:
        point = resume(settings, run, part=part, parts=parts)
        for shard in Path(point.path).glob("*.safetensors"):
            load_file(str(shard))
        results.put(("ok", point.path, tree(point.path)))
    except Exception as exc:  # reported to the test, which shows it
        results.put(("error", f"{type(exc).__name__}: {exc}", {}))


def resume_at_once(settings, run: str, part: int | None, parts: int | None,
                   ranks: int) -> list[tuple[str, str, dict[str, str]]]:
    """``ranks`` processes of one node resume ``run`` at the same moment; what each got."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=rank, args=(settings, run, part, parts, barrier, results)) for _ in range(ranks)]
    for p in procs:
        p.start()
    got = [results.get(timeout=200) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


@pytest.fixture
def proxy(s3_endpoint):
    p = S3Proxy(s3_endpoint)
    yield p
    p.close()


def data_gets(proxy: S3Proxy) -> Counter:
    """GETs of checkpoint data (manifests aside) per tier prefix and file."""
    return Counter((r.key.split("/")[1], r.key.rsplit("/", 1)[-1]) for r in proxy.seen
                   if r.method == "GET" and "step-" in r.key and "manifest" not in r.key)


def saved_on_two_nodes(settings, run: str) -> tuple[object, dict[str, str], dict[int, list[str]]]:
    """A two-part milestone (part 0 saved on node-0, part 1 on node-1), promoted to every tier;
    node-1's settings, every file of the checkpoint by digest, and each part's files."""
    node1 = on_node(settings, "node-1")
    saved, files = {}, {}
    for part, s in ((0, settings), (1, node1)):
        write_checkpoint(s.tier0_url, run, 100, part=part, parts=2, node=s.node, kind="milestone",
                         shard_bytes=1 << 20)  # a fetch long enough for every rank to meet it
        with open_catalog(s) as cat:
            cat.ensure_run(run, actor="test")
        promote(s, run, 100, part, 2)
        files[part] = list(tree(tier0_dir(s, run, 100)))
        saved.update(tree(tier0_dir(s, run, 100)))
    shutil.rmtree(tier0_dir(node1, run, 100))  # node-1 came back with an empty NVMe (a replaced node)
    return node1, saved, files


def lose_tier1(settings, run: str) -> None:
    """Tier 1's copy is gone and the catalog knows it (as reconcile records a vanished copy)."""
    from tasks.base import open_tier

    with open_catalog(settings) as cat, open_tier(settings, 1) as t1:
        ck = cat.get_checkpoint(run, 100)
        assert t1.delete_prefix(run) > 0
        for rep in cat.replicas(ck.id, 1):
            cat.transition(rep.id, "missing", expected="verified", actor="test", reason="test: tier 1 lost")


# every (parts wanted, source) on PostgreSQL, a cluster's catalog; one of them on SQLite (the
# turns are the node's flock, not the catalog's: the full matrix on both cost a minute and a half)
@pytest.mark.parametrize(("db_url", "want", "source"), [
    pytest.param("postgres", want, source, marks=pytest.mark.postgres, id=f"postgres-{want}-{source}")
    for want in ("every part", "own part") for source in ("tier1", "tier2")
] + [pytest.param("sqlite", "every part", "tier2", id="sqlite-every part-tier2")], indirect=["db_url"])
def test_ranks_of_one_node_resuming_at_once_each_get_the_checkpoint_read_once(
        settings_factory, db_url, s3_bucket, proxy, source, want):
    """Node-1 was replaced (its NVMe is empty) and Tier 1 is not mounted on it; with ``tier2``
    Tier 1 lost the checkpoint too. Its ranks all resume at once: each gets the checkpoint, and
    the node reads each object as often as one rank resuming alone does (the baseline, a
    checkpoint of another run saved and lost the same way)."""
    settings = scenario_settings(settings_factory, db_url, s3_endpoint=proxy.url, s3_bucket=s3_bucket,
                                 tier1_url=f"s3://{s3_bucket}/tier1")
    part, parts = (None, None) if want == "every part" else (1, 2)
    reads = {}
    for run, ranks in ((f"{RUN}-alone", 1), (RUN, RANKS)):
        node1, saved, files = saved_on_two_nodes(settings, run)
        if source == "tier2":
            lose_tier1(settings, run)
        wanted = sorted(saved) if part is None else sorted({*files[1], "model.safetensors.index.json"})
        proxy.seen.clear()

        got = resume_at_once(node1, run, part, parts, ranks)

        assert [g[1] for g in got if g[0] != "ok"] == []
        assert [g[2] for g in got] == [{k: saved[k] for k in wanted}] * ranks  # read as soon as each got it
        assert len({g[1] for g in got}) == 1  # one folder for the node
        reads[ranks] = data_gets(proxy)
    assert reads[RANKS] == reads[1] and reads[1]  # the node fetched once


def dies_mid_fetch(settings, run, fetching, go) -> None:
    """A rank whose fetch is killed once its first data file has landed, still in its turn."""
    import os
    import signal

    from core.storage.stage import RestoreStage
    from tasks.resume import resume

    real = RestoreStage.put_written

    def put(self, key, write, size, crc):
        info = real(self, key, write, size, crc)
        if key.endswith(".safetensors"):
            fetching.set()
            go.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)
        return info

    RestoreStage.put_written = put
    resume(settings, run)


def test_a_rank_killed_mid_fetch_holds_up_none_of_its_siblings(settings_factory, db_url, s3_bucket, s3_endpoint):
    """The rank whose turn it is to fetch is killed with a file of the checkpoint fetched and the
    others of its node resuming too: they go on at once (no lease to wait out: the kernel ended
    the dead rank's turn), and each gets the whole checkpoint."""
    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
                                 tier1_url=f"s3://{s3_bucket}/tier1", claim_lease_seconds=600.0)
    node1, saved, _ = saved_on_two_nodes(settings, RUN)
    ctx = multiprocessing.get_context("spawn")
    fetching, go = ctx.Event(), ctx.Event()
    dying = ctx.Process(target=dies_mid_fetch, args=(node1, RUN, fetching, go))
    dying.start()
    assert fetching.wait(120)
    barrier, results = ctx.Barrier(RANKS - 1), ctx.Queue()
    procs = [ctx.Process(target=rank, args=(node1, RUN, None, None, barrier, results)) for _ in range(RANKS - 1)]
    for p in procs:
        p.start()
    go.set()
    dying.join(60)
    got = [results.get(timeout=200) for _ in procs]
    for p in procs:
        p.join(timeout=60)

    assert dying.exitcode == -9
    assert [g[1] for g in got if g[0] != "ok"] == []
    assert [g[2] for g in got] == [saved] * (RANKS - 1)
