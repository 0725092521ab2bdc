"""Retention on a Tier 2 under S3 Object Lock (moto over HTTP, the real pipeline as plain
functions, a real catalog): a locked milestone is planned for after its date, never tried
and never a failure; a prune asked by hand is refused, audited, and every byte stays; an
unlocked copy in the same (versioned) bucket is really removed when pruned, versions and all; a
copy whose lock date cannot be read is kept, and its checkpoint not retired, until it can."""

from __future__ import annotations

import os
import uuid

import boto3
import pytest

from core.errors import PruneRefused
from core.settings import RetentionPolicy
from db.catalog import Catalog
from tasks.prune import prune_replica
from tasks.retention import LOCKED, apply_retention, plan_retention
from tests.kit.restore import commit_folder, promote, scenario_settings

RUN = "vault-run"


@pytest.fixture
def lock_bucket(s3_endpoint):
    name = f"lock-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name, ObjectLockEnabledForBucket=True)
    return name


# Tiers 0 and 1 keep the newest checkpoint only, so step 1 leaves them once step 2 is durable; a
# milestone's archive is never demoted while another tier keeps the checkpoint, so what Tier 2's
# keep_last=1 decides for step 1 is its retirement, and Object Lock is what can stop that
KEEP_NEWEST = dict(retention_tier0=RetentionPolicy(keep_last=1), retention_tier1=RetentionPolicy(keep_last=1))


def _settings(settings_factory, sqlite_url, s3_endpoint, bucket, **kw):
    return scenario_settings(settings_factory, sqlite_url, s3_endpoint=s3_endpoint, s3_bucket=bucket,
                             retention_tier2=RetentionPolicy(keep_last=1, keep_milestones=False),
                             **{**KEEP_NEWEST, **kw})


def _milestones(settings, *steps: int) -> None:
    for step in steps:
        commit_folder(settings, RUN, step, {"model.bin": os.urandom(200_000), "optim.bin": os.urandom(50_000)},
                      milestone=True)
        promote(settings, RUN, step)


def _tier2(settings, step: int):
    with Catalog(settings.catalog_url) as cat:
        return next(r for r in cat.replicas(cat.get_checkpoint(RUN, step).id, 2))


def _objects(bucket: str, endpoint: str, step: int) -> tuple[list, list]:
    r = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").list_object_versions(
        Bucket=bucket, Prefix=f"ckpt/{RUN}/step-{step:08d}/")
    return r.get("Versions", []), r.get("DeleteMarkers", [])


def test_a_locked_milestone_is_kept_until_its_date_and_retention_does_not_fail(
        settings_factory, sqlite_url, s3_endpoint, lock_bucket):
    # first Tier 1 keeps both checkpoints (and so step 1's archive): a prune by hand of the
    # locked Tier 2 copy, whose Tier 1 twin would allow it, is refused for the lock
    keep_all = _settings(settings_factory, sqlite_url, s3_endpoint, lock_bucket, tier2_lock_days=30,
                         retention_tier1=RetentionPolicy(keep_last=10))
    _milestones(keep_all, 1, 2)
    assert _tier2(keep_all, 1).state == "verified"
    stored, _ = _objects(lock_bucket, s3_endpoint, 1)
    assert len(stored) == 3  # two files and the manifest
    with pytest.raises(PruneRefused, match="under Object Lock on tier 2 until"):
        prune_replica(keep_all, _tier2(keep_all, 1).id, actor="test", reason="by hand")
    assert _tier2(keep_all, 1).state == "verified"
    with Catalog(keep_all.catalog_url) as cat:
        reasons = [e.reason or "" for e in cat.history(RUN, 1)]
    assert any("Object Lock" in r for r in reasons), reasons

    # then only the newest is kept anywhere: step 1 would be retired, and its lock keeps it
    settings = _settings(settings_factory, sqlite_url, s3_endpoint, lock_bucket, tier2_lock_days=30)
    plan = [a for a in plan_retention(settings) if a.tier == 2]
    assert [(a.step, a.outcome) for a in plan] == [(1, LOCKED)]
    assert "Object Lock until" in plan[0].detail
    done = apply_retention(settings, plan, prune=prune_replica, actor="test")
    assert [a.outcome for a in done] == [LOCKED]  # not tried, not failed
    assert _tier2(settings, 1).state == "verified"
    assert _objects(lock_bucket, s3_endpoint, 1) == (stored, [])  # every byte stays, nothing hidden


def test_an_unlocked_copy_in_a_versioned_bucket_is_pruned_for_real(settings_factory, sqlite_url, s3_endpoint,
                                                                   lock_bucket):
    settings = _settings(settings_factory, sqlite_url, s3_endpoint, lock_bucket)
    _milestones(settings, 1, 2)  # the promotion of step 2 applies retention: step 1 leaves Tier 2
    assert _tier2(settings, 1).state == "pruned"
    assert _objects(lock_bucket, s3_endpoint, 1) == ([], [])  # no version kept, no delete marker left
    assert len(_objects(lock_bucket, s3_endpoint, 2)[0]) == 3


def test_a_copy_whose_lock_date_cannot_be_read_is_kept_and_nothing_is_retired(
        settings_factory, sqlite_url, s3_endpoint, lock_bucket, monkeypatch):
    """The store cannot say whether step 1's Tier 2 copy is locked (its HeadObject fails): the
    copy is kept this pass, shown with why (``lock date unknown: ERROR``), and its checkpoint, which
    no tier keeps any more, is not retired (its other copies stay too). Once the date can be read
    again, the next pass retires it as the policy says."""
    from core.errors import StorageUnavailable
    from core.storage.s3.store import S3Store
    from flows.common import plain_steps
    from flows.retention import run_retention
    from tasks.retention import KEEP, KEPT, RETIRE
    from tests.kit.restore import tier0_dir, tier1_dir

    settings = _settings(settings_factory, sqlite_url, s3_endpoint, lock_bucket)

    def unreadable(self, keys):
        raise StorageUnavailable(f"HeadObject {next(iter(keys))}: timed out")
    readable = S3Store.locked_until
    monkeypatch.setattr(S3Store, "locked_until", unreadable)
    _milestones(settings, 1, 2)  # the promotion of step 2 applies retention too
    stored, _ = _objects(lock_bucket, s3_endpoint, 1)
    assert len(stored) == 3

    plan = [a for a in plan_retention(settings) if a.step == 1]
    t2 = next(a for a in plan if a.tier == 2)
    assert (t2.action, t2.outcome) == (KEEP, KEPT)
    assert t2.reason.startswith("lock date unknown: StorageUnavailable: HeadObject") and "timed out" in t2.reason
    # its other copies are held with it, shown as such
    assert {(a.tier, a.action, a.reason) for a in plan if a.tier != 2} == {
        (t, KEEP, "retirement deferred: a tier 2 copy's lock date is unknown") for t in (0, 1)}
    done = [a for a in run_retention(settings, run=RUN, steps=plain_steps(), actor="test") if a.step == 1]
    assert {a.outcome for a in done} == {KEPT}  # nothing tried, nothing failed

    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(RUN, 1)
        assert ck.state == "committed"
        assert {r.tier: r.state for r in cat.replicas(ck.id)} == {0: "verified", 1: "verified", 2: "verified"}
        assert not [e for e in cat.history(RUN, 1) if e.action in ("retire", "delete")]
    assert tier0_dir(settings, RUN, 1).exists() and tier1_dir(settings, RUN, 1).exists()
    assert _objects(lock_bucket, s3_endpoint, 1) == (stored, [])

    monkeypatch.setattr(S3Store, "locked_until", readable)  # readable again (none set): the policy applies
    done = [a for a in run_retention(settings, run=RUN, steps=plain_steps(), actor="test") if a.step == 1]
    assert {(a.tier, a.outcome) for a in done if a.tier == 2} == {(2, "pruned")}
    assert {a.action for a in done} == {RETIRE}
    assert _objects(lock_bucket, s3_endpoint, 1) == ([], [])
