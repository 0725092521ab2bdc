"""Resume: each node loads its part from the cheapest good source, bad copies are marked and the
next tried, older checkpoints as the last resort. Real files, the real pipeline, a real catalog
on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.errors import BadInput, ConflictError
from tasks.resume import resume
from tests.kit.checkpoints import ckpt_dir, replica_states, truncate, write_checkpoint
from tests.kit.restore import commit_folder, on_node, promote, scenario_settings, tier0_dir, tier1_dir

RUN = "llm-r"


@pytest.fixture
def settings(settings_factory, db_url):
    return scenario_settings(settings_factory, db_url)


def save(settings, step: int, **kw) -> dict[str, bytes]:
    files = {"model.bin": os.urandom(300_000), "optim/state.bin": os.urandom(50_000)}
    commit_folder(settings, RUN, step, files, **kw)
    promote(settings, RUN, step, kw.get("part", 0), kw.get("parts", 1))
    return files


def tree(folder: Path | str) -> dict[str, bytes]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith("manifest")}


def test_no_checkpoint_yet_is_none_and_bad_input_is_refused(settings):
    assert resume(settings, "never-ran") is None
    save(settings, 100)
    with pytest.raises(BadInput, match="out of range"):
        resume(settings, RUN, part=1)
    with pytest.raises(BadInput, match="out of range"):
        resume(settings, RUN, part=3, parts=2)
    with pytest.raises(BadInput, match="invalid run name"):
        resume(settings, "../etc")


def test_this_nodes_tier0_copy_is_read_in_place(settings):
    save(settings, 100)
    newest = save(settings, 200)

    point = resume(settings, RUN)

    assert (point.step, point.path, point.note) == (200, str(tier0_dir(settings, RUN, 200)), None)
    assert [(p.part, p.tier, p.source, p.bytes_moved) for p in point.parts] == [(0, 0, "in place", 0)]
    assert tree(point.path) == newest


def test_another_node_reads_the_mounted_tier1_folder_in_place(settings):
    newest = save(settings, 100)
    point = resume(on_node(settings, "node-7"), RUN)
    assert point.path == str(tier1_dir(settings, RUN, 100)) and tree(point.path) == newest
    assert [(p.tier, p.source, p.bytes_moved) for p in point.parts] == [(1, "in place", 0)]


def test_corrupt_tier0_copy_is_marked_and_tier1_serves(settings):
    newest = save(settings, 100)
    truncate(tier0_dir(settings, RUN, 100) / "model.bin")

    point = resume(settings, RUN)

    assert point.path == str(tier1_dir(settings, RUN, 100)) and tree(point.path) == newest
    assert replica_states(settings, RUN, 100) == {(0, 0): "corrupt", (1, 0): "verified"}


def test_full_verify_reads_the_bytes_back(settings):
    save(settings, 100)
    model = tier0_dir(settings, RUN, 100) / "model.bin"
    data = bytearray(model.read_bytes())
    data[10] ^= 1
    model.write_bytes(bytes(data))

    assert resume(settings, RUN).path == str(tier0_dir(settings, RUN, 100))  # sizes only: not seen
    assert resume(settings, RUN, verify="full").path == str(tier1_dir(settings, RUN, 100))
    assert replica_states(settings, RUN, 100)[(0, 0)] == "corrupt"


def test_no_good_copy_of_the_newest_falls_back_and_says_so(settings):
    older = save(settings, 100)
    save(settings, 200)
    truncate(tier0_dir(settings, RUN, 200) / "model.bin")
    shutil.rmtree(tier1_dir(settings, RUN, 200))

    point = resume(settings, RUN)

    assert point.step == 100 and tree(point.path) == older
    assert point.note.startswith("fell back from step 200 to step 100")
    assert replica_states(settings, RUN, 200) == {(0, 0): "corrupt", (1, 0): "missing"}


def test_tier1_over_fsspec_is_fetched_into_this_nodes_tier0_and_recorded(settings_factory, db_url):
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1-{os.getpid()}-{id(db_url)}")
    newest = save(settings, 100)
    shutil.rmtree(tier0_dir(settings, RUN, 100))  # the node came back with an empty NVMe

    first = resume(settings, RUN)
    again = resume(settings, RUN)

    assert first.path == str(tier0_dir(settings, RUN, 100)) and tree(first.path) == newest
    assert [(p.tier, p.source, p.bytes_moved) for p in first.parts] == [(1, "fetched", 350_000)]
    assert [(p.tier, p.source, p.bytes_moved) for p in again.parts] == [(0, "in place", 0)]
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}


def test_a_node_whose_part_another_node_holds_fetches_beside_its_tier0(settings_factory, db_url):
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1b-{os.getpid()}-{id(db_url)}")
    newest = save(settings, 100)
    node7 = on_node(settings, "node-7")

    first = resume(node7, RUN)
    again = resume(node7, RUN)

    assert first.path == str(Path(settings.data_dir).absolute() / "resume" / RUN / "step-00000100")
    assert tree(first.path) == newest and again.path == first.path
    assert [(p.source, p.bytes_moved) for p in again.parts] == [("in place", 0)]


def test_into_a_folder_of_ones_choosing(settings, tmp_path):
    newest = save(settings, 100)
    point = resume(settings, RUN, to=tmp_path / "here")
    assert point.path == str(tmp_path / "here") and tree(point.path) == newest
    assert [(p.source, p.bytes_moved) for p in point.parts] == [("fetched", 350_000)]
    assert not [p for p in tmp_path.iterdir() if ".resume-" in p.name]
    again = resume(settings, RUN, to=tmp_path / "here")  # the job restarted: the folder is still good
    assert again.path == point.path and [(p.source, p.bytes_moved) for p in again.parts] == [("in place", 0)]
    (tmp_path / "here" / "model.bin").write_bytes(b"other")
    with pytest.raises(ConflictError, match="not empty"):
        resume(settings, RUN, to=tmp_path / "here")


def test_a_part_brings_the_index_another_part_holds(settings):
    node1 = on_node(settings, "node-1")
    for part, s in ((0, settings), (1, node1)):
        write_checkpoint(s.tier0_url, RUN, 100, part=part, parts=2, node=s.node, shard_bytes=32 << 10)
        with __import__("db.catalog", fromlist=["Catalog"]).Catalog(s.catalog_url) as cat:
            cat.ensure_run(RUN, actor="test")
        promote(s, RUN, 100, part, 2)

    point = resume(node1, RUN, part=1, parts=2)

    folder = Path(point.path)
    assert folder == tier0_dir(node1, RUN, 100)
    assert (folder / "model.safetensors.index.json").is_file()  # part 0's, fetched in beside part 1
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model-p01-00000.safetensors",
                                                                   "model-p01-00001.safetensors"]
    assert [(p.part, p.tier, p.source) for p in point.parts] == [(1, 0, "in place")]
    index = ckpt_dir(settings.tier0_url, RUN, 100) / "model.safetensors.index.json"
    assert point.parts[0].bytes_moved == index.stat().st_size


def cli(args, settings):
    from ckpt.cli import app

    env = {"CKPT_DATA_DIR": str(settings.data_dir), "CKPT_NODE": settings.node,
           "CKPT_CATALOG_URL": settings.catalog_url}
    return CliRunner().invoke(app, args, env=env)


def test_cli_prints_the_resume_point(settings):
    out = cli(["resume", "nothing-yet", "--json"], settings)
    assert out.exit_code == 0 and json.loads(out.stdout) == {"run": "nothing-yet", "step": None}
    out = cli(["resume", "nothing-yet"], settings)
    assert out.exit_code == 0 and out.stdout == ""
    save(settings, 100)
    out = cli(["resume", RUN, "--json", "--verify", "full"], settings)
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert (got["step"], got["path"]) == (100, str(tier0_dir(settings, RUN, 100)))
    assert got["parts"][0]["source"] == "in place"
    assert cli(["resume", RUN], settings).stdout == str(tier0_dir(settings, RUN, 100)) + "\n"
    assert cli(["resume", RUN, "--part", "5", "--parts", "2"], settings).exit_code != 0


def test_two_workers_of_one_node_resuming_at_once_fetch_once(settings_factory, db_url):
    import threading

    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1c-{os.getpid()}-{id(db_url)}")
    newest = save(settings, 100)
    shutil.rmtree(tier0_dir(settings, RUN, 100))
    barrier, points, errors = threading.Barrier(2), [], []

    def worker():
        barrier.wait()
        try:
            points.append(resume(settings, RUN))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    assert errors == [] and {p.path for p in points} == {str(tier0_dir(settings, RUN, 100))}
    assert tree(tier0_dir(settings, RUN, 100)) == newest
    assert sorted(p.parts[0].bytes_moved for p in points) == [0, 350_000]  # one fetched, the other waited for it
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}


def test_a_copy_a_sibling_re_verified_while_this_resume_read_it_is_not_marked_bad(settings, monkeypatch):
    """Worker A reads the Tier 0 row, then finds the files half there because worker B, which
    found the old copy gone, is fetching it afresh; B publishes a verified copy before A records
    its verdict. A's verdict was about the row it read, not B's copy: B's copy stays verified."""
    import tasks.resume.check as resume_mod  # where a resume checks a copy in place
    from core.errors import CorruptCheckpoint
    from tasks.copy import copy_between_tiers
    from tests.kit.checkpoints import open_catalog

    newest = save(settings, 100)
    real = resume_mod.registered_manifest
    raced = []

    def racing_read(cat, store, *args, **kw):
        if store.tier == 0 and not raced:  # B's whole repair lands while A is reading
            raced.append(True)
            with open_catalog(settings) as bcat:
                row = bcat.replicas(bcat.get_checkpoint(RUN, 100).id, 0)[0]
                bcat.transition(row.id, "missing", expected="verified", actor="worker-b", reason="gone")
            shutil.rmtree(tier0_dir(settings, RUN, 100))
            copy_between_tiers(settings, RUN, 100, 0, src_tier=1, dst_tier=0, node=settings.node, actor="worker-b")
            raise CorruptCheckpoint("model.bin: missing (read while worker B was writing it)")
        return real(cat, store, *args, **kw)

    monkeypatch.setattr(resume_mod, "registered_manifest", racing_read)

    point = resume(settings, RUN)

    assert raced and tree(point.path) == newest
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert resume(settings, RUN).path == str(tier0_dir(settings, RUN, 100))  # the next resume reads it in place


def two_part_checkpoint(settings, node1, step: int) -> None:
    from db.catalog import Catalog

    for part, s in ((0, settings), (1, node1)):
        write_checkpoint(s.tier0_url, RUN, step, part=part, parts=2, node=s.node, shard_bytes=32 << 10)
        with Catalog(s.catalog_url) as cat:
            cat.ensure_run(RUN, actor="test")
        promote(s, RUN, step, part, 2)


def test_pruning_a_part_from_tier0_takes_the_index_resume_brought_in_with_it(settings):
    from tasks.prune import prune_replica
    from tests.kit.checkpoints import open_catalog

    node1 = on_node(settings, "node-1")
    two_part_checkpoint(settings, node1, 100)
    folder = Path(resume(node1, RUN, part=1, parts=2).path)
    assert (folder / "model.safetensors.index.json").is_file()  # part 0's, brought in beside part 1
    outside = folder.parent / "keep-me.txt"
    outside.write_text("not the checkpoint's")
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors.index.json").symlink_to(outside)  # a link there is removed, never followed
    two_part_checkpoint(settings, node1, 200)  # step 100 is no longer the newest: Tier 0 may let it go

    with open_catalog(settings) as cat:
        mine = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id, 0) if r.node == "node-1")

    prune_replica(node1, mine.id, actor="test", reason="node-1's Tier 0 retention")

    assert not folder.exists() or not [p for p in folder.rglob("*") if not p.is_dir()]
    assert outside.read_text() == "not the checkpoint's"
    assert (tier0_dir(settings, RUN, 100) / "model.safetensors.index.json").is_file()  # node-0's own copy stays


def test_resume_folders_beside_tier0_are_bounded_to_the_newest_per_run(settings_factory, db_url, tmp_path):
    """A node whose part another node holds on Tier 0 fetches into ``<data_dir>/resume/<run>/``:
    once a newer resume of the run succeeds, the older steps' folders (and stage folders a killed
    resume left) go; a link there is removed, never followed; other runs' folders, newer steps'
    folders and a stage folder still being written are not touched."""
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1d-{os.getpid()}-{id(db_url)}")
    node7 = on_node(settings, "node-7")
    save(settings, 100)
    first = Path(resume(node7, RUN).path)
    base = first.parent
    old_stage = base / ".step-00000050.resume-dead0001"  # a resume killed mid-fetch, long ago
    old_stage.mkdir()
    (old_stage / "model.bin").write_bytes(b"x" * 10)
    os.utime(old_stage, (1, 1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.bin").write_bytes(b"keep")
    (base / "step-00000010").symlink_to(elsewhere)
    other_run = base.parent / "other-run" / "step-00000001"
    other_run.mkdir(parents=True)
    (base / "step-00000300").mkdir()  # newer than what this resume takes: a sibling may be loading it
    young_stage = base / ".step-00000070.resume-live0001"  # a sibling's fetch in flight: spared
    young_stage.mkdir()
    newest = save(settings, 200)

    second = resume(node7, RUN)

    assert Path(second.path) == base / "step-00000200" and tree(second.path) == newest
    assert sorted(p.name for p in base.iterdir()) == [young_stage.name, "step-00000200", "step-00000300"]
    assert (elsewhere / "precious.bin").read_bytes() == b"keep" and other_run.is_dir()
    assert [(p.source, p.bytes_moved) for p in resume(node7, RUN).parts] == [("in place", 0)]  # kept: reused


def test_a_folder_an_older_checkpoint_filled_is_not_taken_for_the_newer(settings, tmp_path):
    """Same model, same shapes: step 200's files have step 100's sizes. A ``to`` an earlier
    resume filled with step 100 must not be handed back as step 200."""
    here = tmp_path / "here"
    older = save(settings, 100)
    assert tree(resume(settings, RUN, to=here).path) == older
    newest = save(settings, 200)

    with pytest.raises(ConflictError, match="not empty"):
        resume(settings, RUN, to=here)
    assert tree(here) == older  # the user's folder is left as it was
    assert tree(resume(settings, RUN, to=tmp_path / "fresh").path) == newest


def test_this_nodes_resume_folder_holding_another_checkpoint_is_redone(settings_factory, db_url):
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1e-{os.getpid()}-{id(db_url)}")
    node7 = on_node(settings, "node-7")
    older = save(settings, 100)
    folder = Path(resume(node7, RUN).path)
    assert tree(folder) == older
    (folder / "manifest.json").write_text("{}")  # e.g. a step rewritten after a retirement, or a torn manifest

    point = resume(node7, RUN)

    assert point.path == str(folder) and tree(folder) == older
    assert [(p.source, p.bytes_moved) for p in point.parts] == [("fetched", 350_000)]


def test_a_resume_waits_for_a_claim_as_long_as_its_holder_keeps_renewing_it(settings_factory, db_url, monkeypatch):
    """A sibling's fetch of a big part outlasts any fixed wait: while it keeps renewing its lease
    the waiter waits (it gives up only on a holder gone silent); when the holder lets go, the
    waiter fetches the part itself. Waits are on the monotonic clock: a jumping wall clock is moot."""
    import threading
    import time as _time

    import tasks.resume.fetch as resume_mod  # the claimed fetch and its wait
    from tests.kit.checkpoints import open_catalog

    lease = 1.0
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1f-{os.getpid()}-{id(db_url)}",
                                 claim_lease_seconds=lease)
    monkeypatch.setattr(resume_mod, "CLAIM_WAIT_GRACE_S", 0.0)  # a silent holder is given up on after 2 leases
    newest = save(settings, 100)
    shutil.rmtree(tier0_dir(settings, RUN, 100))
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        row = cat.replicas(ck.id, 0)[0]
        cat.transition(row.id, "missing", expected="verified", actor="test", reason="the NVMe was wiped")
        held = cat.claim_copy(ck.id, 0, 0, row.url, node=settings.node, actor="worker-b", lease_seconds=lease)
    assert held.acquired
    stop = threading.Event()

    def holder():  # renews 3x longer than the waiter would wait for a silent holder, then lets go
        with open_catalog(settings) as bcat:
            until = _time.monotonic() + 6 * lease
            while _time.monotonic() < until and not stop.is_set():
                bcat.heartbeat(held.replica.id, held.replica.claim_token)
                _time.sleep(lease / 10)
            bcat.transition(held.replica.id, "missing", expected="copying", claim_token=held.replica.claim_token,
                            actor="worker-b", reason="worker b was stopped")

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        point = resume(settings, RUN)
    finally:
        stop.set()
        thread.join(timeout=60)

    assert tree(point.path) == newest and point.path == str(tier0_dir(settings, RUN, 100))
    assert [(p.source, p.bytes_moved) for p in point.parts] == [("fetched", 350_000)]
    assert replica_states(settings, RUN, 100)[(0, 0)] == "verified"


def test_a_sibling_workers_part_in_this_nodes_resume_folder_is_never_removed(settings_factory, db_url):
    """Two workers of one node resume different parts into the same scratch folder: the second
    may not wipe the first's (its trainer is loading it); it is told, in one line, instead."""
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1g-{os.getpid()}-{id(db_url)}")
    node1 = on_node(settings, "node-1")
    two_part_checkpoint(settings, node1, 100)
    node7 = on_node(settings, "node-7")
    first = Path(resume(node7, RUN, part=0, parts=2).path)
    before = tree(first)

    with pytest.raises(ConflictError, match="not empty"):
        resume(node7, RUN, part=1, parts=2)
    assert tree(first) == before


def test_a_folder_where_a_brought_in_file_goes_does_not_stop_the_prune(settings):
    from tasks.prune import prune_replica
    from tests.kit.checkpoints import open_catalog

    node1 = on_node(settings, "node-1")
    two_part_checkpoint(settings, node1, 100)
    folder = Path(resume(node1, RUN, part=1, parts=2).path)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors.index.json").mkdir()  # not a file the resume brought: left, never emptied
    (folder / "model.safetensors.index.json" / "mine.txt").write_text("someone's")
    two_part_checkpoint(settings, node1, 200)
    with open_catalog(settings) as cat:
        mine = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id, 0) if r.node == "node-1")

    prune_replica(node1, mine.id, actor="test", reason="node-1's Tier 0 retention")

    assert replica_states(settings, RUN, 100)[(0, 1)] == "pruned"
    assert (folder / "model.safetensors.index.json" / "mine.txt").read_text() == "someone's"
    assert not list(folder.glob("*.safetensors"))


def test_a_node_whose_tier0_claim_another_node_won_gets_a_folder_with_the_files(settings_factory, db_url,
                                                                                  monkeypatch):
    """Data parallel: every node loads part 0. The NVMe of node-0 (the part's Tier 0 home) was
    wiped; node-7 sees no verified Tier 0 copy, goes for the claim, but node-0 takes it first and
    fetches into its own NVMe. Node-7 must not be handed its own (empty) Tier 0 folder."""
    import tasks.resume.fetch as resume_mod  # the claimed fetch and its wait
    from tests.kit.checkpoints import open_catalog

    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1h-{os.getpid()}-{id(db_url)}")
    newest = save(settings, 100)
    shutil.rmtree(tier0_dir(settings, RUN, 100))
    with open_catalog(settings) as cat:
        row = cat.replicas(cat.get_checkpoint(RUN, 100).id, 0)[0]
        cat.transition(row.id, "missing", expected="verified", actor="test", reason="the NVMe was wiped")
    node7 = on_node(settings, "node-7")
    real, won = resume_mod.claimed_fetch, []

    def node0_first(s, *args, **kw):
        if s.node == "node-7" and not won:
            won.append(resume(settings, RUN))  # node-0 resumes too and wins the claim
        return real(s, *args, **kw)

    monkeypatch.setattr(resume_mod, "claimed_fetch", node0_first)

    point = resume(node7, RUN)

    assert won and won[0].path == str(tier0_dir(settings, RUN, 100)) and tree(won[0].path) == newest
    assert point.path != str(tier0_dir(node7, RUN, 100)) and tree(point.path) == newest


def test_a_to_folder_inside_a_tier_or_the_resume_folders_is_refused(settings):
    save(settings, 100)
    for inside in (tier1_dir(settings, RUN, 300), tier0_dir(settings, RUN, 300).parent / "mine",
                   Path(settings.data_dir) / "resume" / RUN / "step-00000050"):
        with pytest.raises(ConflictError, match="resume into a folder of your own"):
            resume(settings, RUN, to=inside)
        assert not inside.exists()


def test_a_node_reads_the_catalog_rows_of_its_own_part_not_every_parts(settings, tmp_path, monkeypatch):
    """At thousands of nodes every node resumes at once: each reads its own part's replica and
    file rows (and the index's, which part 0 holds), not the whole checkpoint's N times over."""
    import db.catalog

    parts = 6
    for part in range(parts):
        s = on_node(settings, f"node-{part}")
        write_checkpoint(s.tier0_url, RUN, 100, part=part, parts=parts, node=s.node, shard_bytes=16 << 10)
        with db.catalog.Catalog(s.catalog_url) as cat:
            cat.ensure_run(RUN, actor="test")
        promote(s, RUN, 100, part, parts)
    seen: dict[str, set[int]] = {"replica": set(), "file": set()}
    for kind, convert in (("replica", db.catalog.to_replica), ("file", db.catalog.to_file)):
        def counting(row, kind=kind, convert=convert):
            out = convert(row)
            seen[kind].add(out.part)
            return out

        monkeypatch.setattr(db.catalog, f"to_{kind}", counting)
    cold = on_node(settings, "node-cold")

    in_place = resume(cold, RUN, part=3, parts=parts)  # Tier 1 read where it lies
    fetched = resume(cold, RUN, part=4, parts=parts, to=tmp_path / "mine")  # copied into a folder

    assert in_place.path == str(tier1_dir(settings, RUN, 100))
    assert Path(fetched.path, "model.safetensors.index.json").is_file()
    assert seen == {"replica": {0, 3, 4}, "file": {0, 3, 4}}, seen


def test_a_fetch_stage_belongs_to_its_attempts_checkpoint(settings):
    """Attempt A and its relaunch B both saved step 100. A fetch of A's part onto Tier 1 is in
    flight (its claim live, its stage beside the folder) when B's part is claimed for a fetch
    there and when reconcile sweeps the dead stages: neither takes A's stage for B's, so A's stays."""
    import numpy as np

    from ckpt.client import CheckpointStager
    from flows.common import plain_steps
    from flows.promote import promote as promote_part
    from tasks.base import open_tier
    from tasks.claim import ClaimedCopy
    from tasks.resume import sweep_dead_stages
    from tasks.resume.stages import staged
    from tests.kit.checkpoints import open_catalog

    for attempt in ("A", "B"):
        with open_catalog(settings) as cat:
            cat.record_resume(RUN, attempt, None, actor="test")  # B's launch supersedes A's step 100
        with CheckpointStager(RUN, settings=settings, announce=False, attempt=attempt) as st:
            st.save(100, {"w": np.arange(64, dtype=np.float32) + ord(attempt)})
        promote_part(settings, RUN, 100, 0, 1, steps=plain_steps(), actor="test", attempt=attempt)

    def claim(cat, ck):
        row = cat.replicas(ck.id, 1)[0]
        if row.state == "verified":
            cat.transition(row.id, "missing", expected="verified", actor="test", reason="test: lost")
        held, _ = ClaimedCopy.take(cat, ck.id, 1, 0, row.url, node=None, actor=f"fetch-{ck.attempt}")
        assert held is not None
        return held

    with open_catalog(settings) as cat, open_tier(settings, 1) as tier1:
        ck_a, ck_b = cat.get_checkpoint(RUN, 100, "A"), cat.get_checkpoint(RUN, 100, "B")
        with claim(cat, ck_a) as held_a, staged(cat, tier1, ck_a, 0, held_a) as landing:
            landing.stage.mkdir(parents=True)
            (landing.stage / "w.bin").write_bytes(b"A's bytes, in flight")
            with claim(cat, ck_b) as held_b, staged(cat, tier1, ck_b, 0, held_b):
                assert (landing.stage / "w.bin").is_file()  # B's fetch left A's stage alone
            assert sweep_dead_stages(cat, tier1, [RUN], node=settings.node, actor="test") == 0
            assert (landing.stage / "w.bin").is_file()
