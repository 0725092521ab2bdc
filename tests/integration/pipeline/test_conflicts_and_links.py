"""Issue 9, items 4, 5, 7 and 8 and the audit of every deletion: a different checkpoint under a
promoted step is refused by content; a symlinked run folder under a tier root never lets one
run's repair touch another run's bytes; a repair keeps files another part lists; rot on Tier 0
condemns only that replica; every delete leaves an audit row. Real files, the plain pipeline,
catalogs on SQLite and PostgreSQL."""

from __future__ import annotations

import io
import os
import shutil

import pytest

from core.errors import ConflictError, PathEscape
from core.events import announcing
from db.catalog import Catalog
from tasks.restore import restore_checkpoint
from tasks.scrub import scrub
from tests.kit.checkpoints import expire_claims, flip_bit, replica_states
from tests.kit.pipeline import Recorder
from tests.kit.restore import commit_folder, on_node, promote, scenario_settings, tier0_dir, tier1_dir

RUN = "llm-c"


@pytest.fixture
def settings(settings_factory, db_url):
    return scenario_settings(settings_factory, db_url)


def save(settings, step: int, run: str = RUN, *, seed: bytes = b"") -> dict[str, bytes]:
    files = {"weights.bin": seed + os.urandom(300_000), "extra/opt.bin": os.urandom(20_000)}
    commit_folder(settings, run, step, files)
    return files


def resave(settings, step: int, run: str = RUN) -> dict[str, bytes]:
    """A re-save of the same step with different bytes (a rolled-back job, another node)."""
    shutil.rmtree(tier0_dir(settings, run, step))
    return save(settings, step, run)


def audit(settings, run: str, step: int, action: str) -> list:
    with Catalog(settings.catalog_url) as cat:
        return [e for e in cat.history(run, step) if e.action == action]


def folder_bytes(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- 5: conflicts are detected by content -------------------------------------------------------
def test_a_different_checkpoint_under_a_promoted_step_is_refused_loudly(settings, tmp_path):
    first = save(settings, 100)
    promote(settings, RUN, 100)
    resave(settings, 100)
    seen = Recorder()

    with announcing(seen), pytest.raises(ConflictError, match="different manifest"):
        promote(settings, RUN, 100)

    assert "rejected" in seen.names() and "promoted" not in seen.names()
    assert [e.to_state for e in audit(settings, RUN, 100, "reject")] == ["rejected"]
    assert folder_bytes(tier1_dir(settings, RUN, 100)).get("weights.bin") == first["weights.bin"]
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"  # the earlier copy stays intact
    restore_checkpoint(settings, RUN, tmp_path / "r", step=100, preference=(1,))
    assert (tmp_path / "r" / "weights.bin").read_bytes() == first["weights.bin"]


def test_a_different_checkpoint_is_refused_before_tier1_holds_the_first(settings):
    from tasks.register import register_stored_part

    save(settings, 100)
    register_stored_part(settings, RUN, 100, actor="test")  # registered, not yet copied
    resave(settings, 100)
    seen = Recorder()

    with announcing(seen), pytest.raises(ConflictError):
        promote(settings, RUN, 100)

    assert seen.names() == ["rejected"]
    assert len(audit(settings, RUN, 100, "reject")) == 1
    assert (1, 0) not in replica_states(settings, RUN, 100)  # nothing copied


def test_the_same_manifest_again_is_idempotent_and_a_late_duplicate_is_answered_after_pruning(settings):
    save(settings, 100)
    promote(settings, RUN, 100)
    seen = Recorder()

    with announcing(seen):
        again = promote(settings, RUN, 100)  # a duplicate event: identical manifest
        shutil.rmtree(tier0_dir(settings, RUN, 100))  # Tier 0 pruned: no manifest left there
        late = promote(settings, RUN, 100)

    assert [h.skipped for h in again.hops + late.hops] == [True, True]
    assert "rejected" not in seen.names() and "promoted" not in seen.names()
    assert audit(settings, RUN, 100, "reject") == []
    assert len(audit(settings, RUN, 100, "register")) == 1


# --- 4: a symlinked run folder inside a tier root ------------------------------------------------
def test_a_symlinked_run_folder_never_lets_one_runs_repair_touch_anothers_bytes(settings):
    a = save(settings, 100, "run-a")
    save(settings, 100, "run-b")
    promote(settings, "run-a", 100)
    promote(settings, "run-b", 100)
    flip_bit(tier1_dir(settings, "run-b", 100) / "weights.bin", 99)  # run-b's Tier 1 copy breaks
    run_a, run_b = tier1_dir(settings, "run-a", 100).parent, tier1_dir(settings, "run-b", 100).parent
    before = folder_bytes(run_a)
    shutil.rmtree(run_b)
    os.symlink(run_a.name, run_b)  # tier1/run-b -> run-a, behind the catalog's back

    scrub(settings, fraction=1.0)

    assert folder_bytes(run_a) == before  # run-a's only Tier 1 copy: untouched, nothing written through the link
    assert (run_a / tier1_dir(settings, "run-a", 100).name / "weights.bin").read_bytes() == a["weights.bin"]
    assert os.path.islink(run_b)
    assert replica_states(settings, "run-a", 100)[(1, 0)] == "verified"
    assert replica_states(settings, "run-b", 100)[(1, 0)] != "verified"
    again = scrub(settings, fraction=1.0)  # run-a's verified copy still matches its manifest
    assert not [b for b in again.bad if b.run == "run-a"]


def test_writes_and_deletes_through_a_symlinked_folder_raise_and_touch_nothing(settings):
    from core.layout import manifest_name
    from tasks.base import tier_store

    save(settings, 100, "run-a")
    promote(settings, "run-a", 100)
    run_a = tier1_dir(settings, "run-a", 100).parent
    os.symlink(run_a.name, run_a.parent / "run-b")
    before = folder_bytes(run_a)
    step_dir = tier1_dir(settings, "run-a", 100).name
    key = f"run-b/{step_dir}"

    with tier_store(settings, 1) as store:
        writes = [
            lambda: store.put_verified(f"{key}/new.bin", io.BytesIO(b"x"), 1, "0" * 8),
            lambda: store.delete(f"{key}/weights.bin"),
            lambda: store.delete_prefix(key),
            lambda: store.delete_part(key, manifest_name(0, 1), ["weights.bin"]),
            lambda: store.sweep_staging(key, older_than_s=0),
        ]
        for write in writes:
            with pytest.raises(PathEscape):
                write()
        # reading through a link that stays inside the root still works
        assert store.stat(f"{key}/weights.bin").size == len(before[f"{step_dir}/weights.bin"])
        assert store.read_small(f"{key}/extra/opt.bin") == before[f"{step_dir}/extra/opt.bin"]

    assert folder_bytes(run_a) == before


# --- 7: a repair keeps the paths another verified part lists -------------------------------------
def test_repairing_one_part_keeps_the_files_another_verified_part_lists(settings, monkeypatch):
    import core.transfer
    from core.errors import StorageUnavailable

    node1 = on_node(settings, "node-1")
    shared = b'{"layers": 2}'
    for part, s in ((0, settings), (1, node1)):
        commit_folder(s, RUN, 100, {"config.json": shared, f"w{part}.bin": os.urandom(200_000)},
                      part=part, parts=2)
    promote(settings, RUN, 100, 0, 2)
    promote(node1, RUN, 100, 1, 2)
    tier1 = tier1_dir(settings, RUN, 100)
    part1 = {k: v for k, v in folder_bytes(tier1).items() if k in ("config.json", "w1.bin")}
    flip_bit(tier1 / "w0.bin", 7)  # part 0's Tier 1 copy rots

    def copy_fails(*_a, **_k):  # the repair's copy fails after the bad copy was removed, so a
        raise StorageUnavailable("tier 1 went away")  # shared file it took is not written back
    monkeypatch.setattr(core.transfer, "copy_part", copy_fails)
    report = scrub(settings, fraction=1.0)
    assert [(r.part, r.ok) for r in report.repairs] == [(0, False)]
    assert {k: folder_bytes(tier1).get(k) for k in part1} == part1  # part 1's files, config.json too

    monkeypatch.undo()
    report = scrub(settings, fraction=1.0)
    assert [(r.part, r.ok) for r in report.repairs] == [(0, True)]
    assert {k: folder_bytes(tier1)[k] for k in part1} == part1
    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        assert {(r.part, r.state) for r in cat.replicas(ck.id, 1)} == {(0, "verified"), (1, "verified")}
    assert scrub(settings, fraction=1.0).bad == []


# --- 8: rot on Tier 0 during a re-promotion belongs to that replica ------------------------------
def test_rot_on_tier0_during_a_repromotion_marks_only_that_replica(settings, tmp_path):
    from core.errors import CorruptCheckpoint
    from tasks.verify import verify_replica

    save(settings, 100)
    promote(settings, RUN, 100)
    newest = save(settings, 200)
    promote(settings, RUN, 200)
    flip_bit(tier0_dir(settings, RUN, 200) / "weights.bin", 5)

    with pytest.raises(CorruptCheckpoint):
        verify_replica(settings, RUN, 200, tier=0, actor="test")  # the re-promotion's Tier 0 check

    assert replica_states(settings, RUN, 200) == {(0, 0): "corrupt", (1, 0): "verified"}
    with Catalog(settings.catalog_url) as cat:
        assert cat.get_checkpoint(RUN, 200).state != "corrupt"
    report = restore_checkpoint(settings, RUN, tmp_path / "r")
    assert (report.step, report.tiers, report.fell_back_from) == (200, [1], None)
    assert (tmp_path / "r" / "weights.bin").read_bytes() == newest["weights.bin"]


# --- every deletion is audited --------------------------------------------------------------------
def test_a_finishing_prune_is_audited(settings):
    from tasks.prune import prune_replica

    save(settings, 100)
    promote(settings, RUN, 100)
    save(settings, 200)
    promote(settings, RUN, 200)
    with Catalog(settings.catalog_url) as cat:
        rep = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id, 0))
        cat.begin_prune(rep.id, actor="test", reason="keep_last=1")  # a prune killed here
    expire_claims(settings)  # ...a lease ago
    prune_replica(settings, rep.id, actor="test", reason="keep_last=1")  # taken over, guard re-run, finished

    deletes = audit(settings, RUN, 100, "delete")
    assert len(deletes) == 1 and "tier0" in deletes[0].subject
    assert "taken over after its lease lapsed" in deletes[0].reason
    assert not tier0_dir(settings, RUN, 100).exists()


def test_scrubs_part_removal_is_audited(settings):
    save(settings, 100)
    promote(settings, RUN, 100)
    flip_bit(tier1_dir(settings, RUN, 100) / "weights.bin", 3)

    scrub(settings, fraction=1.0)

    deletes = audit(settings, RUN, 100, "delete")
    assert len(deletes) == 1 and "tier1" in deletes[0].subject
    assert "scrub repair" in deletes[0].reason and "corrupt" in deletes[0].reason


def test_a_staging_sweep_is_audited(settings):
    from core.layout import staging_name
    from tasks.copy import copy_to_tier1

    save(settings, 100)
    from tasks.register import register_stored_part
    register_stored_part(settings, RUN, 100, actor="test")
    with Catalog(settings.catalog_url) as cat:  # a copy to Tier 1 that died after staging a file
        ck = cat.get_checkpoint(RUN, 100)
        claim = cat.claim_copy(ck.id, 1, 0, "file:///t1", node=None, actor="test")
        cat.transition(claim.replica.id, "missing", actor="test", reason="copy died")
    staged = tier1_dir(settings, RUN, 100) / staging_name("weights.bin")
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b"half a copy")
    os.utime(staged, (0, 0))  # older than any lease

    copy_to_tier1(settings, RUN, 100, actor="test")

    assert not staged.exists()
    deletes = audit(settings, RUN, 100, "delete")
    assert [d.subject.split(":")[0] for d in deletes] == ["staging"]
    assert "copy that died" in deletes[0].reason
