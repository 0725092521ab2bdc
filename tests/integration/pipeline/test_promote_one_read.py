"""A promotion reads Tier 0 once: the copy to Tier 1 is the Tier 0 verify (``tasks.copy.promote_part``).

What a user checks: how many Tier 0 bytes one promotion reads; that a bad source still leaves
nothing on Tier 1 and its Tier 0 replica ``corrupt``; that a worker killed between the copy and
its catalog commit, retried, ends where an uninterrupted promotion ends. Real catalog (SQLite
and PostgreSQL), real local tiers, Tier 1 buffered and with direct I/O.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import CorruptCheckpoint
from flows.common import plain_steps
from flows.promote import promote
from tests.kit.checkpoints import (
    ckpt_dir,
    expire_claims,
    flip_bit,
    open_catalog,
    published_files,
    replica_states,
    same_bytes,
    write_checkpoint,
)
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"


@pytest.fixture(params=[False, True], ids=["buffered", "direct-io"])
def settings(settings_factory, db_url, request):
    """Each test with Tier 1 written and read back through the page cache, and directly."""
    return pipeline_settings(settings_factory, db_url, copy_parallelism=1, tier1_direct_io=request.param)


def tier(settings, t: int) -> Path:
    return Path(settings.tier_url(t))


@pytest.fixture
def tier0_reads() -> Iterator[Counter]:
    """Bytes read from Tier 0 by file name, through every store the pipeline opens on Tier 0
    (kernel copies included: the copy path is the real one)."""
    from benchmarks.tier_reads import counting_tier_reads

    with counting_tier_reads(0) as seen:
        yield seen


def _format_check_bytes(folder: Path) -> int:
    """What the format check reads before the copy: each safetensors header and the HF index."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + struct.unpack("<Q", fh.read(8))[0]
    return total + (folder / "model.safetensors.index.json").stat().st_size


def test_a_promotion_reads_each_tier0_byte_once(settings, tier0_reads):
    m = write_checkpoint(tier(settings, 0), RUN, 100, shards=3, shard_bytes=256 << 10)

    result = promote(settings, RUN, 100, steps=plain_steps())

    assert result.durable
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    data = sum(n for key, n in tier0_reads.items() if key in {f.path for f in m.files})
    # checkpoint bytes once (the copy), plus the few KB of headers the format check reads;
    # the verify-then-copy promotion read every byte twice
    assert data == m.total_bytes + _format_check_bytes(ckpt_dir(tier(settings, 0), RUN, 100))
    assert data < 1.05 * m.total_bytes
    assert [h.hop for h in result.hops[:2]] == ["verify tier 0", "tier 0 -> tier 1"]


def test_a_part_already_on_tier1_is_verified_on_tier0_alone(settings, tier0_reads):
    m = write_checkpoint(tier(settings, 0), RUN, 100, shards=2, shard_bytes=128 << 10)
    promote(settings, RUN, 100, steps=plain_steps())
    with open_catalog(settings) as cat:  # the Tier 0 record is lost (say, a node reinstalled)
        rep = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id) if r.tier == 0)
        cat.transition(rep.id, "missing", expected="verified", actor="test", reason="node reinstalled")
    flip_bit(min(ckpt_dir(tier(settings, 0), RUN, 100).glob("*.safetensors")))
    tier0_reads.clear()
    from tasks.copy import promote_part

    with pytest.raises(CorruptCheckpoint):
        promote_part(settings, RUN, 100)

    assert replica_states(settings, RUN, 100) == {(0, 0): "corrupt", (1, 0): "verified"}
    assert sum(n for k, n in tier0_reads.items() if k in {f.path for f in m.files}) >= m.total_bytes // 2
    with open_catalog(settings) as cat:  # rot on Tier 0 does not condemn the good Tier 1 copy
        assert cat.get_checkpoint(RUN, 100).state != "corrupt"


def test_a_flipped_bit_on_tier0_leaves_nothing_on_tier1(settings):
    write_checkpoint(tier(settings, 0), RUN, 100, shards=3, shard_bytes=128 << 10)
    last = max(ckpt_dir(tier(settings, 0), RUN, 100).glob("*.safetensors"))
    flip_bit(last)  # the last file copied: the others were already published when it failed

    with pytest.raises(CorruptCheckpoint) as err:
        promote(settings, RUN, 100, steps=plain_steps())

    assert err.value.path == last.name and type(err.value) is CorruptCheckpoint
    assert not ckpt_dir(tier(settings, 1), RUN, 100).exists()  # not even the folder the copy made
    assert replica_states(settings, RUN, 100) == {(0, 0): "corrupt", (1, 0): "missing"}
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        assert ck.state == "corrupt"
        tier0 = next(r for r in cat.replicas(ck.id) if r.tier == 0)
        trail = cat.history(RUN, 100)
        assert any(a.subject == f"replica:{tier0.id}" and a.to_state == "corrupt" and last.name in (a.reason or "")
                   for a in trail)
        # the files copied before the bad one were published, then retracted, audited first
        deleted = [a for a in trail if a.action == "delete"]
    assert [a.subject for a in deleted] == [f"files:{RUN}/100/part-0@tier1"]
    assert last.name in (deleted[0].reason or "")


class _Crash(BaseException):
    """The worker dies here (no exception handler of ours runs)."""


@pytest.mark.parametrize("commits_before_crash", [0, 1], ids=["before-any-commit", "after-tier0-commit"])
def test_a_worker_killed_between_the_copy_and_its_commit_is_retried_to_the_same_end(
        settings, monkeypatch, commits_before_crash):
    from db.catalog import Catalog
    from tasks.claim import ClaimedCopy

    m = write_checkpoint(tier(settings, 0), RUN, 100, shards=2, shard_bytes=128 << 10)
    real_transition, real_exit = Catalog.transition, ClaimedCopy.__exit__
    commits = []

    def transition(self, replica_id, to_state, **kw):
        if to_state == "verified":
            if len(commits) == commits_before_crash:
                raise _Crash
            commits.append(replica_id)
        return real_transition(self, replica_id, to_state, **kw)

    def dead_exit(self, exc_type, exc, tb):
        if isinstance(exc, _Crash):  # a killed worker settles nothing; its lease just stops
            self.lease.stop()
            return
        real_exit(self, exc_type, exc, tb)

    monkeypatch.setattr(Catalog, "transition", transition)
    monkeypatch.setattr(ClaimedCopy, "__exit__", dead_exit)
    with pytest.raises(_Crash):
        promote(settings, RUN, 100, steps=plain_steps())
    monkeypatch.setattr(Catalog, "transition", real_transition)
    monkeypatch.setattr(ClaimedCopy, "__exit__", real_exit)
    assert "verified" not in replica_states(settings, RUN, 100).get((1, 0), "")
    expire_claims(settings)  # a lease later

    result = promote(settings, RUN, 100, steps=plain_steps())

    assert result.durable
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    t1 = ckpt_dir(tier(settings, 1), RUN, 100)
    assert published_files(tier(settings, 1), RUN, 100) == sorted([f.path for f in m.files] + ["manifest.json"])
    for f in m.files:
        assert same_bytes(ckpt_dir(tier(settings, 0), RUN, 100) / f.path, t1 / f.path)
    assert json.loads((t1 / "manifest.json").read_text())["step"] == 100


def test_a_bad_read_back_on_tier1_is_not_blamed_on_tier0(settings, monkeypatch):
    """Tier 1 returns wrong bytes on its read-back: the copy fails as before, and the Tier 0
    source, read back alone, is recorded verified (not corrupt) and the checkpoint stays good."""
    from core.storage.local import LocalStore

    write_checkpoint(tier(settings, 0), RUN, 100, shards=2, shard_bytes=128 << 10)
    real = LocalStore._hash

    def bad_tier1_read_back(self, path):
        size, crc = real(self, path)
        return (size, "00000000") if self.tier == 1 and ".ckpt-staging-" in path.name else (size, crc)

    monkeypatch.setattr(LocalStore, "_hash", bad_tier1_read_back)
    with pytest.raises(CorruptCheckpoint, match="read-back"):
        promote(settings, RUN, 100, steps=plain_steps())

    assert published_files(tier(settings, 1), RUN, 100) == []
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "missing"}
    with open_catalog(settings) as cat:
        assert cat.get_checkpoint(RUN, 100).state != "corrupt"
    monkeypatch.setattr(LocalStore, "_hash", real)  # Tier 1 healthy again: the retry promotes it
    assert promote(settings, RUN, 100, steps=plain_steps()).durable
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
