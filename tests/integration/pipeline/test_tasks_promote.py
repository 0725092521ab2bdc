"""The promotion of one checkpoint through the plain steps: Tier 0 -> Tier 1 (and Tier 2 for
milestones, on moto's S3 server), on a real catalog (SQLite and PostgreSQL)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest

from core.errors import CorruptCheckpoint, PathEscape
from core.events import announcing
from flows.common import plain_steps
from flows.promote import promote
from tests.kit.checkpoints import (
    ckpt_dir,
    flip_bit,
    open_catalog,
    published_files,
    replica_states,
    same_bytes,
    shard_paths,
    truncate,
    write_checkpoint,
)
from tests.kit.pipeline import Recorder, pipeline_settings

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url)


def tier(settings, t: int) -> Path:
    return Path(settings.tier_url(t))


def test_promotion_copies_verified_bytes_to_tier1_and_records_every_copy(settings):
    m = write_checkpoint(tier(settings, 0), RUN, 100)
    events = Recorder()

    with announcing(events):
        result = promote(settings, RUN, 100, steps=plain_steps())

    assert result.durable
    for src in shard_paths(tier(settings, 0), RUN, 100):
        assert same_bytes(src, ckpt_dir(tier(settings, 1), RUN, 100) / src.name)
    assert (ckpt_dir(tier(settings, 1), RUN, 100) / "manifest.json").is_file()
    assert not [p for p in published_files(tier(settings, 1), RUN, 100) if ".ckpt-staging-" in p]
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    cat = open_catalog(settings)
    try:
        locs = {loc.tier: loc for loc in cat.locations(RUN, 100)}
        assert set(locs) == {0, 1}
        assert locs[1].bytes == m.total_bytes
        assert cat.newest_verified(RUN, tier=1).step == 100
    finally:
        cat.close()
    assert events.names() == ["verified", "promoted", "durable"]
    copy = result.hops[1]
    assert (copy.files, copy.bytes, copy.skipped) == (len(m.files), m.total_bytes, False)


def test_milestone_goes_to_tier2_and_is_verified_there(settings_factory, db_url, s3_endpoint, s3_bucket):
    import boto3

    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=s3_endpoint)
    m = write_checkpoint(tier(settings, 0), RUN, 200, kind="milestone")
    events = Recorder()

    with announcing(events):
        result = promote(settings, RUN, 200, steps=plain_steps())

    assert result.archive is not None and result.archive.archived
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    keys = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    prefix = f"vault/{RUN}/step-00000200"
    assert {f"{prefix}/{f.path}": f.size for f in m.files}.items() <= keys.items()
    assert f"{prefix}/manifest.json" in keys
    assert replica_states(settings, RUN, 200)[(2, 0)] == "verified"
    assert "archived" in events.names()


def test_non_milestone_is_not_uploaded(settings_factory, db_url, s3_endpoint, s3_bucket):
    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=s3_endpoint)
    write_checkpoint(tier(settings, 0), RUN, 101)
    result = promote(settings, RUN, 101, steps=plain_steps())
    assert result.archive is not None and not result.archive.milestone
    assert (2, 0) not in replica_states(settings, RUN, 101)


@pytest.mark.parametrize("damage", [truncate, flip_bit], ids=["truncated-shard", "bit-flip"])
def test_corrupt_source_is_never_promoted_and_earlier_checkpoints_are_untouched(settings, damage):
    write_checkpoint(tier(settings, 0), RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    before = published_files(tier(settings, 1), RUN, 100)
    write_checkpoint(tier(settings, 0), RUN, 200)
    bad = shard_paths(tier(settings, 0), RUN, 200)[1]
    damage(bad)
    events = Recorder()

    with pytest.raises(CorruptCheckpoint) as err, announcing(events):
        promote(settings, RUN, 200, steps=plain_steps())

    assert err.value.path == bad.name
    assert bad.name in str(err.value)
    assert published_files(tier(settings, 1), RUN, 200) == []
    # the copy that found it (Tier 0 is read once, by the copy) left its claim released, unpublished
    assert replica_states(settings, RUN, 200) == {(0, 0): "corrupt", (1, 0): "missing"}
    cat = open_catalog(settings)
    try:
        assert cat.get_checkpoint(RUN, 200).state == "corrupt"
        assert cat.newest_verified(RUN).step == 100
    finally:
        cat.close()
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert published_files(tier(settings, 1), RUN, 100) == before
    assert events.names() == ["corrupt"]


def test_bit_flip_on_tier1_after_the_copy_is_found_and_repaired(settings):
    from tasks.verify import verify_replica

    write_checkpoint(tier(settings, 0), RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    victim = shard_paths(tier(settings, 1), RUN, 100)[0]
    flip_bit(victim)

    with pytest.raises(CorruptCheckpoint) as err:
        verify_replica(settings, RUN, 100, tier=1)
    assert err.value.path == victim.name
    assert replica_states(settings, RUN, 100)[(1, 0)] == "corrupt"

    promote(settings, RUN, 100, steps=plain_steps())  # the next promotion copies it again
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert same_bytes(victim, ckpt_dir(tier(settings, 0), RUN, 100) / victim.name)


def test_same_promotion_twice_gives_one_set_of_copies_and_the_same_catalog(settings):
    write_checkpoint(tier(settings, 0), RUN, 100)
    first = promote(settings, RUN, 100, steps=plain_steps())
    files = published_files(tier(settings, 1), RUN, 100)
    states = replica_states(settings, RUN, 100)
    events = Recorder()

    with announcing(events):
        second = promote(settings, RUN, 100, steps=plain_steps())

    assert first.durable and not second.durable
    assert second.hops[-1].skipped
    assert published_files(tier(settings, 1), RUN, 100) == files
    assert replica_states(settings, RUN, 100) == states
    assert events.names() == []


def test_two_promotions_at_once_copy_once(settings):
    from concurrent.futures import ThreadPoolExecutor

    from core.errors import CopyInProgress

    write_checkpoint(tier(settings, 0), RUN, 100, shards=4, shard_bytes=4 << 20)
    events = Recorder()

    def attempt():
        try:
            with announcing(events):
                return promote(settings, RUN, 100, steps=plain_steps())
        except CopyInProgress as exc:  # the loser's task would retry; its rerun finds it done
            return exc

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda _: attempt(), range(2)))
    rerun = [promote(settings, RUN, 100, steps=plain_steps()) for o in outcomes if isinstance(o, Exception)]

    copies = [h for o in outcomes + rerun if not isinstance(o, Exception) for h in o.hops
              if h.hop == "tier 0 -> tier 1" and not h.skipped]
    assert len(copies) == 1
    assert events.names().count("durable") == 1
    assert events.names().count("promoted") == 1
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    assert len([p for p in published_files(tier(settings, 1), RUN, 100) if p.endswith(".safetensors")]) == 4


def test_a_new_run_is_created_on_first_sight_and_promoted(settings):
    write_checkpoint(tier(settings, 0), "newcomer", 5)
    events = Recorder()
    with announcing(events):
        promote(settings, "newcomer", 5, steps=plain_steps(), actor="flow-run:x")
    assert "rejected" not in events.names() and "durable" in events.names()
    assert replica_states(settings, "newcomer", 5)[(1, 0)] == "verified"
    with open_catalog(settings) as cat:
        created = [e for e in cat.audit_log(run="newcomer") if e.action == "create-run"]
    assert [(e.subject, e.actor) for e in created] == [("run:newcomer", "flow-run:x")]


def test_a_new_run_takes_its_origin_from_the_manifest_parent(settings):
    from core.manifest import ParentRef
    from tests.kit.checkpoints import commit_manifest

    write_checkpoint(tier(settings, 0), RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    write_checkpoint(tier(settings, 0), "child-run", 1)
    (ckpt_dir(tier(settings, 0), "child-run", 1) / "manifest.json").unlink()
    commit_manifest(ckpt_dir(tier(settings, 0), "child-run", 1), "child-run", 1, parent=ParentRef(RUN, 100),
                    node="node-0")
    promote(settings, "child-run", 1, steps=plain_steps())
    with open_catalog(settings) as cat:
        run = cat.get_run("child-run")
        assert (run.parent_run, run.parent_step) == (RUN, 100)
        assert [(e.parent_run, e.parent_step) for e in cat.ancestors("child-run", 1)][:1] == [(RUN, 100)]


def test_a_malformed_run_name_is_still_refused(settings):
    from core.errors import BadInput

    events = Recorder()
    with pytest.raises(BadInput), announcing(events):
        promote(settings, "bad name", 5, steps=plain_steps())
    assert events.names() == ["rejected"]


@pytest.mark.parametrize("bad_path", ["../escape.safetensors", "/etc/passwd", "a/../../b"])
def test_manifest_path_escaping_the_checkpoint_is_rejected(settings, bad_path):
    import json

    write_checkpoint(tier(settings, 0), RUN, 7)
    mpath = ckpt_dir(tier(settings, 0), RUN, 7) / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["files"][0]["path"] = bad_path
    mpath.write_text(json.dumps(doc))
    events = Recorder()

    with pytest.raises(PathEscape), announcing(events):
        promote(settings, RUN, 7, steps=plain_steps())

    assert events.names() == ["rejected"]
    assert published_files(tier(settings, 1), RUN, 7) == []
    assert not (tier(settings, 0).parent / "escape.safetensors").exists()


def test_symlink_leaving_tier0_is_refused(settings, tmp_path):
    write_checkpoint(tier(settings, 0), RUN, 8)
    folder = ckpt_dir(tier(settings, 0), RUN, 8)
    shard = shard_paths(tier(settings, 0), RUN, 8)[0]
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)  # same bytes, but outside the tier root

    with pytest.raises(PathEscape):
        promote(settings, RUN, 8, steps=plain_steps())

    assert published_files(tier(settings, 1), RUN, 8) == []
    assert replica_states(settings, RUN, 8).get((1, 0)) != "verified"
    assert folder.exists()


def test_run_name_escaping_the_tier_is_rejected(settings):
    with pytest.raises(PathEscape):
        promote(settings, "../etc", 1, steps=plain_steps())


def _upload_fails(*args, **kwargs):
    raise ConnectionError("tier 2 unreachable")


@pytest.mark.parametrize(("kind", "upload_fails", "wanted"), [
    ("step", False, False),  # nothing to archive
    ("milestone", False, False),  # archived inline: an archive run would find nothing to do
    ("milestone", True, True),  # the inline archive failed: the archive run is the safety net
])
def test_the_durable_event_asks_for_an_archive_run_only_when_the_inline_archive_failed(
        settings_factory, db_url, s3_endpoint, s3_bucket, kind, upload_fails, wanted):
    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=s3_endpoint)
    seen = []

    def record(name, run, step, **kw):
        seen.append((name, kw))
        return True

    steps = plain_steps()
    if upload_fails:
        steps = dataclasses.replace(steps, tier2_hop=_upload_fails)
    write_checkpoint(tier(settings, 0), RUN, 3, kind=kind)
    with announcing(record), contextlib.suppress(ConnectionError):
        result = promote(settings, RUN, 3, steps=steps)
    (durable,) = [kw for name, kw in seen if name.endswith("durable")]
    assert durable["labels"] == {"milestone": str(wanted).lower()} and durable["payload"]["milestone"] is wanted
    if kind == "milestone" and not upload_fails:
        assert result.archive is not None and result.archive.archived
        assert replica_states(settings, RUN, 3).get((2, 0)) == "verified"
