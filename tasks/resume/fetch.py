"""Fetching under the catalog's claim: a part copied to a tier by ``tasks.copy``'s one claimed-copy
recipe (staged whole into a folder tier, ``stages.staged``), waiting while another worker holds
the claim, and a checkpoint-wide file brought in from a good copy of the part that holds it."""

from __future__ import annotations

import time

from core.errors import CopyInProgress, CorruptCheckpoint, NotFound, StorageUnavailable, TierUnavailable
from core.layout import checkpoint_prefix
from core.settings import Settings
from core.storage.base import TierStore
from db.catalog import Catalog
from db.entities import COPYING, CheckpointInfo, FileInfo
from tasks.base import HopResult, open_tier
from tasks.copy import copy_between_tiers
from tasks.replicas import TierStores
from tasks.resume.check import mark
from tasks.resume.plan import NoGoodCopy, sources
from tasks.resume.stages import staged

HYDRATION_POLL_S = 0.2
CLAIM_WAIT_GRACE_S = 30.0  # beyond two leases of silence from a claim's holder before giving up on it


def await_copy(cat: Catalog, settings: Settings, ck: CheckpointInfo, part: int, tier: int) -> str | None:
    """Wait while another worker copies ``part`` to ``tier`` (its replica ``copying``), so a
    checkpoint-wide file of that part is read from the copy it is publishing, not once more from
    S3 by every node: the cluster reads each object once. Gives up, as ``copy_when_free`` does,
    after two leases and ``CLAIM_WAIT_GRACE_S`` without a sign of the holder. Returns the row's
    state when the wait ended (None: no row)."""
    silence = 2 * settings.claim_lease_seconds + CLAIM_WAIT_GRACE_S
    deadline, seen = time.monotonic() + silence, None
    while True:
        row = next(iter(cat.replicas(ck.id, tier, part)), None)
        if row is None or row.state != COPYING:
            return None if row is None else row.state
        sign = (row.claim_token, row.updated_at)
        if sign != seen:
            seen, deadline = sign, time.monotonic() + silence
        if time.monotonic() > deadline:
            return row.state
        time.sleep(HYDRATION_POLL_S)


def copy_when_free(cat: Catalog, settings: Settings, ck: CheckpointInfo, part: int, *, src_tier: int,
                   dst_tier: int, actor: str) -> HopResult:
    """``claimed_fetch`` (a claimed copy), waiting while another worker holds the claim:
    until it publishes (then: a skipped hop) or its lease lapses (then: taken over). Asks the
    catalog every ``HYDRATION_POLL_S``; retries the claim (which reads the source's manifest)
    only every fifth of a lease. A holder that keeps renewing its lease is waited for however
    long its copy takes (each renewal moves the row's ``updated_at``); ``CopyInProgress`` only
    after two leases and ``CLAIM_WAIT_GRACE_S`` without a sign of it. Monotonic clock only."""
    silence = 2 * settings.claim_lease_seconds + CLAIM_WAIT_GRACE_S
    deadline = time.monotonic() + silence
    next_try, seen = 0.0, None
    while True:
        row = next(iter(cat.replicas(ck.id, dst_tier, part)), None)
        sign = None if row is None else (row.state, row.claim_token, row.updated_at)
        if sign != seen:  # the holder renewed, or the claim changed hands: it is alive
            seen, deadline = sign, time.monotonic() + silence
        if row is not None and row.state == COPYING and time.monotonic() < next_try:
            time.sleep(HYDRATION_POLL_S)
            continue
        try:
            return claimed_fetch(settings, ck, part, src_tier=src_tier, dst_tier=dst_tier, actor=actor)
        except CopyInProgress:
            if time.monotonic() > deadline:
                raise
            next_try = time.monotonic() + settings.claim_lease_seconds / 5


def claimed_fetch(settings: Settings, ck: CheckpointInfo, part: int, *, src_tier: int, dst_tier: int,
                  actor: str) -> HopResult:
    """One part copied to ``dst_tier`` by ``tasks.copy``'s claimed copy, the recipe promotion
    uses too. Into a tier read in place here the part lands whole in a hidden stage beside the
    checkpoint's folder and is renamed into place (``stages.staged``): a fetch killed midway
    leaves none of the part's files under their names. Into an object store (no rename there):
    files, manifest last."""
    with open_tier(settings, dst_tier) as dst:
        folder = dst.in_place(checkpoint_prefix(ck.run, ck.step, ck.attempt)) is not None
    return copy_between_tiers(settings, ck.run, ck.step, part, src_tier=src_tier, dst_tier=dst_tier,
                              node=settings.node, actor=actor, attempt=ck.attempt, stage=staged if folder else None)


def bring_file(cat: Catalog, stores: TierStores, ck: CheckpointInfo, f: FileInfo, dst: TierStore, key: str,
               actor: str, notes: list[str]) -> int:
    """One checkpoint-wide file of another part put at ``key`` from a good copy of that part
    (checked as it lands); 0 when it is already there and matches. Bytes moved."""
    try:
        dst.verify_object(key, f.size, f.checksum)
        return 0
    except (NotFound, CorruptCheckpoint):
        pass
    if stores.configured(1):  # the node resuming that part may be rehydrating it: read Tier 1 after it
        await_copy(cat, stores.settings, ck, f.part, 1)
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    unproven: list[str] = []
    for src in sources(cat, stores, ck, f.part):
        try:
            with stores.get(src.tier).open_read(f"{prefix}/{f.path}") as reader:
                dst.put_verified(key, reader, f.size, f.checksum)
            return f.size
        except TierUnavailable as exc:  # the source's tier is not proven: no verdict on its copy, the next one
            unproven.append(str(exc))
            notes.append(f"step {ck.step}: {f.path} not read from tier {exc.tier} ({exc.reason})")
        except (CorruptCheckpoint, NotFound) as exc:
            mark(cat, src.replica, exc, actor, notes)
    if unproven:  # a copy that may come back: never a reason to fall back to an older checkpoint
        raise StorageUnavailable(f"no copy of {f.path} (part {f.part}) readable now: {'; '.join(unproven)}")
    raise NoGoodCopy(f"no good copy of {f.path} (part {f.part})")
