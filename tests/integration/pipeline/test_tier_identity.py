"""A tier proves it is itself before any verdict: a root that is missing, shows no identity
marker (a mount that is not there shows the node's own empty folder) or another marker is
unavailable: nothing is written there, nothing is marked missing or corrupt, nothing is pruned
on its strength; once the mount is back everything proceeds. Real files, the real pipeline, a
real catalog on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core import events
from core.errors import PruneRefused, StorageUnavailable
from core.storage.identity import MARKER_KEY, write_marker
from core.storage.local import LocalStore
from flows.common import plain_steps
from flows.reconcile import reconcile_once
from tasks.restore import restore_checkpoint
from tasks.resume import resume
from tests.kit.checkpoints import replica_states
from tests.kit.pipeline import Recorder
from tests.kit.restore import commit_folder, on_node, promote, prune, scenario_settings, tier0_dir, tier1_dir

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return scenario_settings(settings_factory, db_url)


def save(settings, step: int) -> dict[str, bytes]:
    files = {"model.bin": os.urandom(200_000)}
    commit_folder(settings, RUN, step, files)
    promote(settings, RUN, step)
    return files


def unmount(root: str, *, leave_folder: bool = True) -> Path:
    """The mount at ``root`` gone: its contents moved aside, the node's own empty folder (or
    nothing) in its place. Returns where the mounted contents wait."""
    root_path = Path(root)
    aside = root_path.with_name(root_path.name + "-mounted")
    root_path.rename(aside)
    if leave_folder:
        root_path.mkdir()
    return aside


def mount(root: str, aside: Path) -> None:
    root_path = Path(root)
    if root_path.exists():
        root_path.rmdir()  # only ever the empty folder: anything written there would fail this
    aside.rename(root_path)


def test_tier1_mount_missing_on_a_node_gives_no_verdict_and_all_proceeds_once_back(settings):
    save(settings, 100)
    aside = unmount(settings.tier1_url)
    commit_folder(settings, RUN, 200, {"model.bin": os.urandom(200_000)})
    heard = Recorder()

    with events.announcing(heard), pytest.raises(StorageUnavailable, match="no identity marker"):
        promote(settings, RUN, 200)
    assert list(Path(settings.tier1_url).iterdir()) == []  # nothing written on the node's own disk
    assert "unavailable" in heard.names()
    assert replica_states(settings, RUN, 200).get((1, 0)) != "verified"

    with pytest.raises(PruneRefused):  # the copy that would justify it is on a tier that is not proven
        prune(settings, RUN, 100, 0)
    assert (tier0_dir(settings, RUN, 100) / "model.bin").is_file()

    with pytest.raises(StorageUnavailable):  # reconcile stops before it judges any copy
        reconcile_once(settings, steps=plain_steps(), actor="test")
    with pytest.raises(StorageUnavailable):  # another node resumes from Tier 1: not here
        resume(on_node(settings, "node-1"), RUN)
    here = resume(settings, RUN)  # this node's own Tier 0 copy of a durable step needs no Tier 1
    assert (here.step, here.parts[0].tier, here.parts[0].source) == (100, 0, "in place")
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert list(Path(settings.tier1_url).iterdir()) == []

    mount(settings.tier1_url, aside)
    promote(settings, RUN, 200)
    report = reconcile_once(settings, steps=plain_steps(), actor="test")
    point = resume(on_node(settings, "node-1"), RUN)

    assert report.missing == []
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert replica_states(settings, RUN, 200) == {(0, 0): "verified", (1, 0): "verified"}
    assert (point.step, point.parts[0].tier) == (200, 1)
    assert (tier1_dir(settings, RUN, 200) / "model.bin").is_file()


def test_a_prune_on_an_unmounted_tier_takes_no_claim(settings):
    """Retention retired step 100 and lets its Tier 1 copy go while the mount is missing: the
    prune stops before its claim, so the copy stays ``verified`` (not ``pruning`` until a lease
    nobody renews lapses) and a prune once the mount is back deletes it at once."""
    from db.catalog import Catalog

    save(settings, 100)
    save(settings, 200)
    with Catalog(settings.catalog_url) as cat:
        cat.retire(RUN, 100, reason="no tier keeps it", actor="test")
    aside = unmount(settings.tier1_url)

    with pytest.raises(StorageUnavailable):
        prune(settings, RUN, 100, 1)
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}

    mount(settings.tier1_url, aside)
    prune(settings, RUN, 100, 1)
    assert replica_states(settings, RUN, 100)[(1, 0)] == "pruned"
    assert not tier1_dir(settings, RUN, 100).exists()


def test_tier1_root_absent_is_never_created(settings):
    save(settings, 100)
    unmount(settings.tier1_url, leave_folder=False)
    commit_folder(settings, RUN, 200, {"model.bin": os.urandom(1000)})

    with pytest.raises(StorageUnavailable, match="does not exist"):
        promote(settings, RUN, 200)
    with pytest.raises(StorageUnavailable):
        reconcile_once(settings, steps=plain_steps(), actor="test")

    assert not Path(settings.tier1_url).exists()
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"


def test_tier0_not_mounted_is_unavailable_and_its_copies_are_not_judged(settings):
    save(settings, 100)
    aside = unmount(settings.tier0_url)  # the NVMe is not mounted: the job wrote to the root disk
    commit_folder(settings, RUN, 200, {"model.bin": os.urandom(1000)})

    with pytest.raises(StorageUnavailable, match="no identity marker"):
        promote(settings, RUN, 200)
    with pytest.raises(StorageUnavailable):
        reconcile_once(settings, steps=plain_steps(), actor="test")

    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert not tier1_dir(settings, RUN, 200).exists()

    shutil.rmtree(settings.tier0_url)  # what the job wrote on the root disk is gone with the remount
    mount(settings.tier0_url, aside)
    assert reconcile_once(settings, steps=plain_steps(), actor="test").missing == []
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}


@pytest.mark.parametrize("left", ["empty folder", "nothing"])
def test_a_save_onto_an_unmounted_tier0_is_refused_and_writes_nothing(settings, left):
    """The job's side: an NVMe that is not mounted shows an empty folder on the root disk (or
    no folder at all). The save raises at once and nothing is written or created there; once
    the mount is back the next save goes through."""
    import numpy as np

    from ckpt.client import CheckpointStager
    from core.errors import TierUnavailable
    from tests.kit.settings import mark_root

    nvme = Path(settings.data_dir).parent / "nvme"  # a configured root, not the embedded default folder
    nvme.mkdir()
    settings = settings.model_copy(update={"tier0_url": str(mark_root(nvme))})
    aside = unmount(settings.tier0_url, leave_folder=left == "empty folder")
    with CheckpointStager(RUN, settings=settings, announce=False) as st:
        with pytest.raises(TierUnavailable, match=r"tier 0 .* unavailable"):
            st.save(100, {"w": np.zeros(16, np.float32)})
        root = Path(settings.tier0_url)
        assert (list(root.iterdir()) == []) if left == "empty folder" else not root.exists()
        mount(settings.tier0_url, aside)
        st.save(100, {"w": np.zeros(16, np.float32)})
    assert (tier0_dir(settings, RUN, 100) / "manifest.json").is_file()


def test_a_restore_past_an_unmounted_tier0_reads_tier1_and_judges_nothing(settings, tmp_path):
    """Found by the soak: a restore on a node whose Tier 0 mount is gone stopped at that tier
    (``TierUnavailable``) although Tier 1 held the bytes; it reads them there and marks nothing."""
    files = save(settings, 100)
    aside = unmount(settings.tier0_url)

    report = restore_checkpoint(settings, RUN, tmp_path / "out", step=100, actor="test")

    assert report.tiers == [1] and report.bad == []
    assert (tmp_path / "out" / "model.bin").read_bytes() == files["model.bin"]
    assert any("tier 0 unreachable" in note for note in report.notes)
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert list(Path(settings.tier0_url).iterdir()) == []  # nothing read or written on the stand-in
    mount(settings.tier0_url, aside)


def test_a_root_with_another_marker_is_refused(settings, tmp_path):
    save(settings, 100)
    other = tmp_path / "other-tier1"
    other.mkdir()
    write_marker(LocalStore(other, 1))  # another cluster's Tier 1, mounted here by mistake
    aside = unmount(settings.tier1_url, leave_folder=False)
    other.rename(settings.tier1_url)
    commit_folder(settings, RUN, 200, {"model.bin": os.urandom(1000)})

    with pytest.raises(StorageUnavailable, match="another identity marker"):
        promote(settings, RUN, 200)
    with pytest.raises(StorageUnavailable, match="another identity marker"):
        reconcile_once(settings, steps=plain_steps(), actor="test")

    assert sorted(p.name for p in Path(settings.tier1_url).iterdir()) == [MARKER_KEY]
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert aside.is_dir()


def _tiers_init(settings, *args: str) -> tuple[int, str]:
    from ckpt.cli import app

    env = {"CKPT_DATA_DIR": str(settings.data_dir), "CKPT_NODE": settings.node,
           "CKPT_CATALOG_URL": settings.catalog_url}
    out = CliRunner().invoke(app, ["tiers", "init", *args], env=env)
    return out.exit_code, out.output


def test_tiers_init_is_idempotent_and_replace_takes_a_new_storage(settings):
    from db.catalog import Catalog

    marker = Path(settings.tier1_url) / MARKER_KEY
    before = marker.read_bytes()
    with Catalog(settings.catalog_url) as cat:
        recorded = {(r.tier, r.node): r.identity for r in cat.list_tier_roots()}

    code, out = _tiers_init(settings)
    assert (code, out.count("proven")) == (0, 2), out
    assert marker.read_bytes() == before
    with Catalog(settings.catalog_url) as cat:
        assert {(r.tier, r.node): r.identity for r in cat.list_tier_roots()} == recorded

    unmount(settings.tier1_url)  # a new, empty file system where Tier 1 was
    code, out = _tiers_init(settings)
    assert code == 1 and "UNAVAILABLE" in out, out
    assert not marker.exists()  # a missing mount is never re-marked

    code, out = _tiers_init(settings, "--replace")
    assert code == 0 and "marked and recorded" in out, out
    save(settings, 300)
    assert replica_states(settings, RUN, 300)[(1, 0)] == "verified"


def test_the_catalog_keeps_the_first_identity_recorded_unless_told_to_replace(catalog):
    first = catalog.record_tier_root(1, "node-0", "/lustre/ckpt", "a" * 32, actor="test")
    raced = catalog.record_tier_root(1, "node-7", "/lustre/ckpt", "b" * 32, actor="test")
    node0 = catalog.record_tier_root(0, "node-0", "/nvme/ckpt", "c" * 32, actor="test")
    replaced = catalog.record_tier_root(1, "node-0", "/lustre2/ckpt", "d" * 32, actor="test", replace=True)

    assert (first.node, first.identity, raced.identity) == ("", "a" * 32, "a" * 32)  # shared: one root
    assert (node0.node, catalog.tier_root(0, "node-1")) == ("node-0", None)  # Tier 0: one per node
    assert (replaced.identity, replaced.url) == ("d" * 32, "/lustre2/ckpt")
    assert [(r.tier, r.node) for r in catalog.list_tier_roots()] == [(0, "node-0"), (1, "")]


def test_a_resume_whose_newest_copy_is_on_an_unmounted_tier_waits_and_supersedes_nothing(settings, tmp_path):
    """node-1 holds step 100 on its own Tier 0; step 200 (node-0's) is readable from node-1 only
    on Tier 1, whose mount is gone there: the resume raises (a copy that may come back) instead of
    falling back to 100, which would record the launch as resuming from 100 and supersede 200
    for good; once the mount is back, the launch resumes from 200."""
    node1 = on_node(settings, "node-1")
    save(node1, 100)
    save(settings, 200)
    aside = unmount(settings.tier1_url)

    with pytest.raises(StorageUnavailable):
        resume(node1, RUN, to=tmp_path / "resume", attempt="relaunch-1")

    mount(settings.tier1_url, aside)
    point = resume(node1, RUN, to=tmp_path / "resume", attempt="relaunch-1")
    assert point is not None and point.step == 200


def test_a_resume_past_an_unmounted_tier0_reads_tier1_in_place_and_judges_nothing(settings):
    """As the restore above: a resume on a node whose Tier 0 mount is gone stopped at that tier
    (``TierUnavailable``) although Tier 1, mounted here, held the bytes; it reads them there in
    place and marks nothing, and nothing is read or written on the stand-in."""
    files = save(settings, 100)
    aside = unmount(settings.tier0_url)

    point = resume(settings, RUN)

    assert (point.step, point.path) == (100, str(tier1_dir(settings, RUN, 100)))
    assert [(p.tier, p.source) for p in point.parts] == [(1, "in place")]
    assert (Path(point.path) / "model.bin").read_bytes() == files["model.bin"]
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert list(Path(settings.tier0_url).iterdir()) == []
    mount(settings.tier0_url, aside)


def test_a_resume_past_an_unmounted_tier0_fetches_beside_it_and_judges_nothing(settings_factory, db_url):
    """Tier 1 is not mounted here (fetched, not read in place) and Tier 0's mount is gone: the
    resume neither reads nor writes the stand-in; it fetches the checkpoint from Tier 1 into this
    node's resume folder (as when another node holds the part's Tier 0 copy) and marks nothing."""
    settings = scenario_settings(settings_factory, db_url, tier1_url=f"memory://t1-unmounted-{os.getpid()}-{id(db_url)}")
    files = save(settings, 100)
    aside = unmount(settings.tier0_url)

    point = resume(settings, RUN)

    assert point.path == str(Path(settings.data_dir).absolute() / "resume" / RUN / "step-00000100")
    assert [(p.tier, p.source) for p in point.parts] == [(1, "fetched")]
    assert (Path(point.path) / "model.bin").read_bytes() == files["model.bin"]
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert list(Path(settings.tier0_url).iterdir()) == []
    mount(settings.tier0_url, aside)
