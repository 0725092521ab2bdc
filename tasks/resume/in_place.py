"""Source: a tier read where it lies (this node's Tier 0, or Tier 1 mounted here), every wanted
part checked in place first."""

from __future__ import annotations

import time

from core.errors import CorruptCheckpoint, NotFound, TierUnavailable
from core.layout import checkpoint_prefix
from core.tiers import Tier
from db.catalog import Catalog
from db.entities import CheckpointInfo, FileInfo
from tasks.base import log
from tasks.replicas import TierStores
from tasks.resume.check import check_file, mark, part_good
from tasks.resume.fetch import await_copy, bring_file
from tasks.resume.plan import IN_PLACE, PartResume, ResumePoint, Verify, sources


class BringInTurn(Exception):
    """This node's Tier 0 copy is good but lacks a checkpoint-wide file another part holds: it is
    brought in beside it in the node's turn (``folder.node_turn``), then read in place."""


def read_in_place(cat: Catalog, stores: TierStores, ck: CheckpointInfo, tier: int, wanted: list[int],
                  wide: list[FileInfo], files: list[FileInfo], verify: Verify, actor: str,
                  notes: list[str], *, bring: bool = True) -> ResumePoint | None:
    """``ck`` read where it lies on ``tier`` when every wanted part is good there (a part that
    is not is marked); checkpoint-wide files another part holds are fetched in beside it on Tier 0
    (``bring``; else, outside the node's turn, one not there yet raises ``BringInTurn``),
    checked in place on Tier 1."""
    started = time.monotonic()
    chosen = []
    for p in wanted:
        src = next((s for s in sources(cat, stores, ck, p) if s.tier == tier and s.in_place), None)
        if src is None:
            return None
        chosen.append(src)
    try:
        store = stores.get(tier)
    except TierUnavailable as exc:  # not proven the tier the catalog knows: no verdict, the next source
        unproven(ck, exc, notes)
        return None
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    if Tier(tier).node_local and not bring:  # before the parts' check: the turn checks them again
        for f in wide:
            try:
                store.verify_object(f"{prefix}/{f.path}", f.size, f.checksum)
            except (NotFound, CorruptCheckpoint):
                raise BringInTurn(f"{f.path} (part {f.part}) is not beside this node's Tier 0 copy yet") from None
    for src in chosen:
        if not part_good(cat, store, ck, src, files, verify, actor, notes):
            return None
    moved = 0
    for f in wide:
        if Tier(tier).node_local and not bring:
            continue  # checked above
        if Tier(tier).node_local:
            moved += bring_file(cat, stores, ck, f, store, f"{prefix}/{f.path}", actor, notes)
        elif not _wide_good(cat, stores, ck, f, verify, actor, notes):
            return None
    folder = store.in_place(prefix)
    assert folder is not None
    seconds = time.monotonic() - started
    return ResumePoint(ck.run, ck.step, str(folder),
                       [PartResume(s.replica.part, tier, IN_PLACE, moved if i == 0 else 0, seconds)
                        for i, s in enumerate(chosen)])


def _wide_good(cat: Catalog, stores: TierStores, ck: CheckpointInfo, f: FileInfo, verify: Verify, actor: str,
               notes: list[str]) -> bool:
    """A checkpoint-wide file of another part, on Tier 1 in place: that part verified there (once
    a rehydration of it in flight has ended: ``await_copy``), the file intact."""
    await_copy(cat, stores.settings, ck, f.part, 1)
    src = next((s for s in sources(cat, stores, ck, f.part) if s.tier == Tier.SHARED and s.in_place), None)
    if src is None:
        return False
    try:
        check_file(stores.get(1), f"{checkpoint_prefix(ck.run, ck.step, ck.attempt)}/{f.path}", f, verify)
    except TierUnavailable as exc:
        unproven(ck, exc, notes)
        return False
    except (CorruptCheckpoint, NotFound) as exc:
        mark(cat, src.replica, exc, actor, notes)
        return False
    return True


def unproven(ck: CheckpointInfo, exc: TierUnavailable, notes: list[str]) -> None:
    """A source on a tier whose root is not proven (``TierUnavailable``): passed over, judged
    not at all (a mount that is gone says nothing about the copies on it)."""
    log.warning("resume %s/step-%d: %s; trying the next source", ck.run, ck.step, exc)
    notes.append(f"step {ck.step}: tier {exc.tier} unreachable ({exc.reason}); trying the next source")
