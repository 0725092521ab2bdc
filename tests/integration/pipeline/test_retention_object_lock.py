"""Retention on a Tier 2 under S3 Object Lock (moto over HTTP, the real pipeline as plain
functions, a real catalog): a locked milestone is planned for after its date, never tried
and never a failure; a prune asked by hand is refused, audited, and every byte stays; an
unlocked copy in the same (versioned) bucket is really removed when pruned, versions and all."""

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


def _settings(settings_factory, sqlite_url, s3_endpoint, bucket, **kw):
    return scenario_settings(settings_factory, sqlite_url, s3_endpoint=s3_endpoint, s3_bucket=bucket,
                             retention_tier2=RetentionPolicy(keep_last=1, keep_milestones=False), **kw)


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
    settings = _settings(settings_factory, sqlite_url, s3_endpoint, lock_bucket, tier2_lock_days=30)
    _milestones(settings, 1, 2)  # the promotion of step 2 applies retention too: it completed
    assert _tier2(settings, 1).state == "verified"
    stored, _ = _objects(lock_bucket, s3_endpoint, 1)
    assert len(stored) == 3  # two files and the manifest

    plan = [a for a in plan_retention(settings) if a.tier == 2]
    assert [(a.step, a.outcome) for a in plan] == [(1, LOCKED)]
    assert "Object Lock until" in plan[0].detail
    done = apply_retention(settings, plan, prune=prune_replica, actor="test")
    assert [a.outcome for a in done] == [LOCKED]  # not tried, not failed

    with pytest.raises(PruneRefused, match="under Object Lock on tier 2 until"):
        prune_replica(settings, _tier2(settings, 1).id, actor="test", reason="by hand")
    assert _tier2(settings, 1).state == "verified"
    with Catalog(settings.catalog_url) as cat:
        reasons = [e.reason or "" for e in cat.history(RUN, 1)]
    assert any("Object Lock" in r for r in reasons), reasons
    assert _objects(lock_bucket, s3_endpoint, 1) == (stored, [])  # every byte stays, nothing hidden


def test_an_unlocked_copy_in_a_versioned_bucket_is_pruned_for_real(settings_factory, sqlite_url, s3_endpoint,
                                                                   lock_bucket):
    settings = _settings(settings_factory, sqlite_url, s3_endpoint, lock_bucket)
    _milestones(settings, 1, 2)  # the promotion of step 2 applies retention: step 1 leaves Tier 2
    assert _tier2(settings, 1).state == "pruned"
    assert _objects(lock_bucket, s3_endpoint, 1) == ([], [])  # no version kept, no delete marker left
    assert len(_objects(lock_bucket, s3_endpoint, 2)[0]) == 3
