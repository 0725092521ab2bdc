"""Issue 39, item 7: deletes are fenced. A prune's worker stopped inside its delete walk
(SIGSTOP, so its lease lapses and nothing of it runs: no renewal, no delete) whose prune is then
taken over, given up (the operator pinned the checkpoint) and whose part is copied to Tier 1
again by reconcile, deletes nothing of the new copy when it wakes (SIGCONT): it had moved what it
deletes to its own tombstone first. Real catalogs (SQLite, PostgreSQL), real folders, moto's S3
server for the Tier 2 copy that justifies the Tier 1 prune; the worker is a forked process that
stops itself at a known point of the walk, so nothing hinges on timing."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from core.layout import TOMB_MARK
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import (
    ckpt_dir,
    expire_claims,
    open_catalog,
    published_files,
    replica_states,
    write_checkpoint,
)
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url, s3_endpoint, s3_bucket):
    """Milestones 100 and 200 verified on Tiers 0, 1 and 2. The lease is long (its renewal comes
    a fifth of it later), so the stopped worker is never stopped inside a renewal's transaction:
    its lease is made to lapse in the catalog instead (``expire_claims``)."""
    s = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault", s3_endpoint_url=s3_endpoint,
                          claim_lease_seconds=3600)
    for step in (100, 200):
        write_checkpoint(s.tier0_url, RUN, step, kind="milestone", shard_bytes=1024)
        promote(s, RUN, step, steps=plain_steps())
    assert replica_states(s, RUN, 100) == {(0, 0): "verified", (1, 0): "verified", (2, 0): "verified"}
    return s


def _replica_id(settings, step: int, tier: int) -> int:
    with open_catalog(settings) as cat:
        return next(r.id for r in cat.replicas(cat.get_checkpoint(RUN, step).id, tier))


def _prune_stopping_in_the_walk(settings, replica_id: int, under: Path, after: int) -> None:
    """The forked prune worker: it stops itself (SIGSTOP) once it unlinked ``after`` files
    under ``under``, and goes on where it was when it is continued."""
    from tasks.prune import prune_replica

    real_unlink, seen = os.unlink, [0]

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if Path(path).is_relative_to(under):
            seen[0] += 1
            if seen[0] == after:
                os.kill(os.getpid(), signal.SIGSTOP)

    os.unlink = unlink
    prune_replica(settings, replica_id, actor="paused-worker", reason="demoted")


def test_a_prune_worker_that_wakes_after_losing_its_claim_deletes_nothing_of_the_new_copy(settings):
    tier1 = Path(settings.tier1_url)
    before = published_files(tier1, RUN, 100)
    assert len(before) >= 4
    worker = multiprocessing.get_context("fork").Process(
        target=_prune_stopping_in_the_walk, args=(settings, _replica_id(settings, 100, 1), tier1, 2))
    worker.start()
    _pid, status = os.waitpid(worker.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status)  # inside its delete walk: two files unlinked, the rest listed

    with open_catalog(settings) as cat:
        cat.pin(RUN, 100, reason="keep it", actor="operator")
    assert expire_claims(settings) == 1  # the stopped worker's lease lapses
    report = reconcile_once(settings, steps=plain_steps())  # takes the prune over, gives it up, copies again
    assert any("stalled prune given up" in r for r in report.recovered), report
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert published_files(tier1, RUN, 100) == before

    os.kill(worker.pid, signal.SIGCONT)
    worker.join(timeout=120)
    assert worker.exitcode not in (None, 0)  # it learns its claim is gone: it records nothing

    assert published_files(tier1, RUN, 100) == before  # the new copy is whole
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    reconcile_once(settings, steps=plain_steps())  # sweeps the tombstones of claims that are over
    assert not [p for p in (tier1 / RUN).iterdir() if p.name.startswith(TOMB_MARK)]
    scrubbed = _scrub(settings)
    assert scrubbed == [], scrubbed


def _scrub(settings) -> list[str]:
    """The Tier 1 copy read back against its manifest: what is wrong with it."""
    from tasks.base import open_tier
    from tasks.evidence import check_part

    with open_catalog(settings) as cat, open_tier(settings, 1) as store:
        ck = cat.get_checkpoint(RUN, 100)
        finding = check_part(cat, store, ck.id, RUN, 100, 0, ck.parts, read_back=True)
    return [] if finding is None else [finding.reason]


def test_the_step_folder_is_not_left_behind(settings):
    """A prune that finishes leaves neither the part's folder nor a tombstone."""
    from tasks.prune import prune_replica

    prune_replica(settings, _replica_id(settings, 100, 1), actor="retention", reason="demoted")
    assert not ckpt_dir(settings.tier1_url, RUN, 100).exists()
    assert sorted(p.name for p in (Path(settings.tier1_url) / RUN).iterdir()) == [ckpt_dir("", RUN, 200).name]
