"""Checkpoints in several parts (one per node), prunes racing promotions, and reconcile."""

from __future__ import annotations

import threading

import pytest

from core.errors import PruneRefused
from core.events import announcing
from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import ckpt_dir, open_catalog, published_files, replica_states, write_checkpoint
from tests.kit.pipeline import Recorder, pipeline_settings
from tests.kit.restore import on_node

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url)


def tier0_replica_id(settings, run, step, part=0):
    cat = open_catalog(settings)
    try:
        ck = cat.get_checkpoint(run, step)
        return next(r.id for r in cat.replicas(ck.id, 0) if r.part == part)
    finally:
        cat.close()


# --- several parts ------------------------------------------------------------------------
def test_two_node_checkpoint_is_durable_once_when_its_last_part_lands(settings):
    node1 = on_node(settings, "node-1")
    write_checkpoint(settings.tier0_url, RUN, 100, part=0, parts=2, node="node-0")
    write_checkpoint(node1.tier0_url, RUN, 100, part=1, parts=2, node="node-1")
    events = Recorder()

    with announcing(events):
        first = promote(settings, RUN, 100, 0, 2, steps=plain_steps())
    assert not first.durable
    cat = open_catalog(settings)
    try:
        assert cat.locations(RUN, 100) == [] or all(loc.tier != 1 for loc in cat.locations(RUN, 100))
    finally:
        cat.close()

    with announcing(events):
        second = promote(node1, RUN, 100, 1, 2, steps=plain_steps())

    assert second.durable
    assert events.names().count("durable") == 1
    tier1 = published_files(settings.tier1_url, RUN, 100)
    assert "manifest.part-00000-of-00002.json" in tier1 and "manifest.part-00001-of-00002.json" in tier1
    assert {p for p in tier1 if p.endswith(".safetensors")} == {
        "model-p00-00000.safetensors", "model-p00-00001.safetensors",
        "model-p01-00000.safetensors", "model-p01-00001.safetensors"}
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (0, 1): "verified",
                                                   (1, 0): "verified", (1, 1): "verified"}
    cat = open_catalog(settings)
    try:
        tier1_loc = next(loc for loc in cat.locations(RUN, 100) if loc.tier == 1)
        assert len(tier1_loc.urls) == 2
    finally:
        cat.close()


def test_pruning_one_part_on_tier0_deletes_only_that_node_s_files(settings):
    node1 = on_node(settings, "node-1")
    for step in (100, 200):
        write_checkpoint(settings.tier0_url, RUN, step, part=0, parts=2, node="node-0")
        write_checkpoint(node1.tier0_url, RUN, step, part=1, parts=2, node="node-1")
        promote(settings, RUN, step, 0, 2, steps=plain_steps())
        promote(node1, RUN, step, 1, 2, steps=plain_steps())
    from tasks.prune import prune_replica

    prune_replica(settings, tier0_replica_id(settings, RUN, 100, part=0))

    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()  # node-0's folder held part 0 alone
    assert "manifest.part-00001-of-00002.json" in published_files(node1.tier0_url, RUN, 100)
    assert len(published_files(settings.tier1_url, RUN, 100)) == 7  # 2 manifests, 4 shards, the index
    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruned"
    assert replica_states(settings, RUN, 100)[(0, 1)] == "verified"


def test_two_parts_on_one_node_pruned_leave_no_folder_behind(settings):
    """Both parts of a checkpoint saved on one node share its step folder on Tier 0: the first
    prune leaves the other part whole, the second leaves no empty folder (they used to pile up)."""
    for step in (100, 200):  # (the newest checkpoint of a run keeps its Tier 0 copy)
        for part in (0, 1):
            write_checkpoint(settings.tier0_url, RUN, step, part=part, parts=2, node=settings.node)
            promote(settings, RUN, step, part, 2, steps=plain_steps())
    folder = ckpt_dir(settings.tier0_url, RUN, 100)
    from tasks.prune import prune_replica

    prune_replica(settings, tier0_replica_id(settings, RUN, 100, part=0))
    assert "manifest.part-00001-of-00002.json" in published_files(settings.tier0_url, RUN, 100)
    assert "manifest.part-00000-of-00002.json" not in published_files(settings.tier0_url, RUN, 100)
    prune_replica(settings, tier0_replica_id(settings, RUN, 100, part=1))

    assert not folder.exists()
    assert folder.parent.is_dir()  # the run's folder stays: later steps land there
    assert replica_states(settings, RUN, 100) == {(0, 0): "pruned", (0, 1): "pruned",
                                                  (1, 0): "verified", (1, 1): "verified"}
    assert len(published_files(settings.tier0_url, RUN, 200)) == 7  # the next step untouched


def test_a_folder_still_being_written_is_not_removed(tmp_path):
    """A copy into the same folder holds its staging file there: the folder stays; and a copy
    whose folder went between its mkdir and its first write makes it again."""
    import io

    from core import checksum
    from core.storage.local import LocalStore

    store = LocalStore(tmp_path / "t1", 1)
    (tmp_path / "t1" / "ck" / "sub").mkdir(parents=True)
    (tmp_path / "t1" / "ck" / ".ckpt-staging-1-a").write_bytes(b"x")
    assert not store.remove_empty("ck")
    assert (tmp_path / "t1" / "ck").is_dir() and not (tmp_path / "t1" / "ck" / "sub").exists()
    (tmp_path / "t1" / "ck" / ".ckpt-staging-1-a").unlink()
    (tmp_path / "t1" / "other").mkdir()
    (tmp_path / "t1" / "ck" / "link").symlink_to(tmp_path / "t1" / "other")
    assert not store.remove_empty("ck")  # a link is not an empty folder: never removed, never followed
    assert (tmp_path / "t1" / "other").is_dir()
    (tmp_path / "t1" / "ck" / "link").unlink()
    assert store.remove_empty("ck") and not (tmp_path / "t1" / "ck").exists()

    import core.storage.local as local

    real = local._mkdirs

    def raced(root, path):  # the folder is made, then a prune removes it before the staging file opens
        out = real(root, path)
        if not getattr(raced, "done", False):
            raced.done = True
            store.remove_empty("ck2")
        return out

    local._mkdirs = raced
    try:
        store.put_verified("ck2/f", io.BytesIO(b"abc"), 3, checksum.hash_bytes(b"abc"))
    finally:
        local._mkdirs = real
    assert raced.done and (tmp_path / "t1" / "ck2" / "f").read_bytes() == b"abc"


# --- prune racing promote ----------------------------------------------------------------
def test_tier0_copy_cannot_be_pruned_before_its_tier1_copy_is_verified(settings):
    from tasks.copy import copy_to_tier1
    from tasks.prune import prune_replica
    from tasks.register import register_stored_part
    from tasks.verify import verify_replica

    write_checkpoint(settings.tier0_url, RUN, 100)
    write_checkpoint(settings.tier0_url, RUN, 200)
    promote(settings, RUN, 200, steps=plain_steps())  # 100 is no longer the newest
    register_stored_part(settings, RUN, 100)
    verify_replica(settings, RUN, 100, tier=0)
    rid = tier0_replica_id(settings, RUN, 100)

    with pytest.raises(PruneRefused):
        prune_replica(settings, rid)  # no other copy yet
    cat = open_catalog(settings)
    try:  # a copy in flight (claimed, not verified) does not count either
        ck = cat.get_checkpoint(RUN, 100)
        claim = cat.claim_copy(ck.id, 1, 0, "x", node=None, actor="other-worker")
        assert claim.acquired
        with pytest.raises(PruneRefused):
            prune_replica(settings, rid)
        cat.transition(claim.replica.id, "missing", expected="copying", actor="other-worker",
                       claim_token=claim.replica.claim_token, reason="gave up")
    finally:
        cat.close()
    assert published_files(settings.tier0_url, RUN, 100)

    copy_to_tier1(settings, RUN, 100)
    prune_replica(settings, rid)
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()


def test_retention_looping_during_promotions_never_loses_a_checkpoint(settings):
    tight = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1)})
    steps = list(range(1, 7))
    for s in steps:
        write_checkpoint(settings.tier0_url, RUN, s, shard_bytes=256 << 10)
    stop = threading.Event()
    errors: list[BaseException] = []

    def prune_loop():
        from flows.retention import run_retention

        while not stop.is_set():
            try:
                run_retention(tight, run=RUN, steps=plain_steps())
            except BaseException as exc:  # the test reports it
                errors.append(exc)

    pruner = threading.Thread(target=prune_loop)
    pruner.start()
    try:
        for s in steps:
            promote(settings, RUN, s, steps=plain_steps())
    finally:
        stop.set()
        pruner.join(30)
    assert errors == []
    for s in steps:
        states = replica_states(settings, RUN, s)
        assert states[(1, 0)] == "verified"
        assert ckpt_dir(settings.tier1_url, RUN, s).is_dir()
        assert states[(0, 0)] in ("verified", "pruned")
    assert replica_states(settings, RUN, steps[-1])[(0, 0)] == "verified"


# --- reconcile -----------------------------------------------------------------------------
def test_reconcile_promotes_a_checkpoint_whose_event_was_lost(settings):
    write_checkpoint(settings.tier0_url, RUN, 100)

    report = reconcile_once(settings, steps=plain_steps())

    assert report.promoted == [f"{RUN}/100 part 0"]
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    # what the reconcile run's artifact shows in the UI: the promotion, as a promote run would
    assert [{k: p[k] for k in ("run", "step", "part", "tiers", "durable")} for p in report.promotions] == [
        {"run": RUN, "step": 100, "part": 0, "tiers": "0 -> 1", "durable": True}]
    assert report.promotions[0]["files"] > 0 and report.promotions[0]["bytes"] > 0
    assert {r["action"] for r in report.rows()} == {"promoted"}
    assert reconcile_once(settings, steps=plain_steps()).promoted == []  # nothing left


def test_reconcile_marks_vanished_copies_missing_and_copies_them_again(settings):
    write_checkpoint(settings.tier0_url, RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    (ckpt_dir(settings.tier1_url, RUN, 100) / "model-00002-of-00002.safetensors").unlink()

    report = reconcile_once(settings, steps=plain_steps())

    assert report.missing and "model-00002-of-00002.safetensors vanished" in report.missing[0]
    assert report.promoted == [f"{RUN}/100 part 0"]
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert (ckpt_dir(settings.tier1_url, RUN, 100) / "model-00002-of-00002.safetensors").is_file()


def test_reconcile_adopts_a_tier1_checkpoint_the_catalog_lost(settings_factory, db_url, tmp_path):
    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    # a fresh catalog (restored from an old backup): Tier 1 holds a checkpoint it never saw
    fresh = pipeline_settings(settings_factory, f"sqlite:///{tmp_path / 'fresh.db'}",
                              tier0_url=str(tmp_path / "empty-tier0"), tier1_url=settings.tier1_url)

    report = reconcile_once(fresh, steps=plain_steps())

    assert report.adopted == [f"{RUN}/100 part 0"]
    assert replica_states(fresh, RUN, 100) == {(1, 0): "verified"}


def test_reconcile_promotes_new_runs_and_leaves_corrupt_checkpoints_alone(settings):
    from tests.kit.checkpoints import flip_bit, shard_paths

    write_checkpoint(settings.tier0_url, "stranger", 1)
    write_checkpoint(settings.tier0_url, RUN, 100)
    flip_bit(shard_paths(settings.tier0_url, RUN, 100)[0])
    first = reconcile_once(settings, steps=plain_steps())
    assert any("CorruptCheckpoint" in f for f in first.failed)

    again = reconcile_once(settings, steps=plain_steps())

    assert again.failed == [] and again.promoted == []
    assert "stranger/1 part 0" in first.promoted  # a run seen first here is created
    assert any(f"{RUN}/100" in s and "corrupt" in s for s in again.skipped)
    assert published_files(settings.tier1_url, RUN, 100) == []


def test_each_node_s_reconcile_prunes_its_own_tier0_under_retention(settings):
    """Retention after a promotion runs on the node that completed the checkpoint; the other
    node's NVMe copies are pruned by that node's own reconcile, never the newest one."""
    settings = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1)})
    node1 = on_node(settings, "node-1")
    for step in (100, 200, 300):
        write_checkpoint(settings.tier0_url, RUN, step, part=0, parts=2, node="node-0")
        write_checkpoint(node1.tier0_url, RUN, step, part=1, parts=2, node="node-1")
        promote(node1, RUN, step, 1, 2, steps=plain_steps())
        promote(settings, RUN, step, 0, 2, steps=plain_steps())  # completes it: retention runs on node-0
    before = {s: replica_states(settings, RUN, s)[(0, 1)] for s in (100, 200, 300)}
    assert before == {100: "verified", 200: "verified", 300: "verified"}  # node-0 can't delete node-1's NVMe

    report = reconcile_once(node1, steps=plain_steps())

    after = {s: replica_states(settings, RUN, s)[(0, 1)] for s in (100, 200, 300)}
    assert after == {100: "pruned", 200: "pruned", 300: "verified"}
    assert sorted(report.pruned) == [f"tier 0 {RUN}/100 part 1", f"tier 0 {RUN}/200 part 1"]
    assert not ckpt_dir(node1.tier0_url, RUN, 100).exists() or not any(ckpt_dir(node1.tier0_url, RUN, 100).iterdir())
    assert ckpt_dir(node1.tier0_url, RUN, 300).is_dir()
    for s in (100, 200, 300):  # Tier 1 keeps every part
        assert replica_states(settings, RUN, s)[(1, 1)] == "verified"


def test_deleting_one_part_leaves_a_file_another_live_part_also_lists(settings):
    """Two nodes may both list e.g. config.json in one shared checkpoint folder: removing one
    part's files must not take the other part's copy with it."""
    from core.manifest_build import build_manifest, write_manifest
    from tasks.base import delete_part, open_catalog, open_tier

    node1 = on_node(settings, "node-1")
    for part, s in ((0, settings), (1, node1)):
        write_checkpoint(s.tier0_url, RUN, 100, part=part, parts=2, node=s.node)
        folder = ckpt_dir(s.tier0_url, RUN, 100)
        (folder / "config.json").write_text('{"layers": 2}')
        (folder / f"manifest.part-{part:05d}-of-00002.json").unlink()
        write_manifest(folder, build_manifest(folder, RUN, 100, part=part, parts=2, node=s.node, fmt="hf-sharded"))
    promote(settings, RUN, 100, 0, 2, steps=plain_steps())
    promote(node1, RUN, 100, 1, 2, steps=plain_steps())
    tier1 = ckpt_dir(settings.tier1_url, RUN, 100)
    assert (tier1 / "config.json").is_file()

    with open_catalog(settings.catalog_url) as cat, open_tier(settings, 1) as store:
        delete_part(cat, store, RUN, 100, 0, 2, reason="test", actor="test", token="t0", check=lambda: None)

    assert (tier1 / "config.json").read_text() == '{"layers": 2}'  # part 1 still lists it
    assert not (tier1 / "model-p00-00000.safetensors").exists()  # part 0's own files went
    assert not (tier1 / "manifest.part-00000-of-00002.json").exists()  # uncommitted first
    assert (tier1 / "model-p01-00000.safetensors").is_file()


def test_a_verify_overtaken_by_a_prune_does_not_record_the_pruned_copy_verified(settings, monkeypatch):
    """verify reads a good Tier 0 part; before it records the verdict, retention prunes that
    copy. The catalog must not end with a 'verified' replica whose files are gone."""
    import core.transfer
    from tasks.prune import prune_replica
    from tasks.verify import verify_replica

    for step in (100, 200):
        write_checkpoint(settings.tier0_url, RUN, step)
        promote(settings, RUN, step, steps=plain_steps())
    rep_id = tier0_replica_id(settings, RUN, 100)
    original = core.transfer.verify_part

    def read_then_get_overtaken(*args, **kw):
        report = original(*args, **kw)
        prune_replica(settings, rep_id)  # retention wins the race after the read
        return report

    monkeypatch.setattr(core.transfer, "verify_part", read_then_get_overtaken)
    verify_replica(settings, RUN, 100, tier=0)

    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruned"
    tier0_dir = ckpt_dir(settings.tier0_url, RUN, 100)
    assert not tier0_dir.exists() or not any(tier0_dir.iterdir())
