"""Source: fetched into this node's Tier 0 (from Tier 1, then Tier 2) as a claimed copy recorded
``verified``: the next resume on this node reads it in place."""

from __future__ import annotations

import time

from core.errors import CorruptCheckpoint, NotFound, StorageUnavailable, TierUnavailable
from core.layout import checkpoint_prefix
from core.tiers import Tier
from db.catalog import Catalog
from db.entities import VERIFIED, CheckpointInfo, FileInfo
from tasks.replicas import TierStores
from tasks.resume.check import mark, part_good
from tasks.resume.fetch import bring_file, copy_when_free
from tasks.resume.plan import FETCHED, IN_PLACE, HeldElsewhere, NoGoodCopy, PartResume, ResumePoint, Verify, sources


def tier0_is_ours(cat: Catalog, ck: CheckpointInfo, wanted: list[int], node: str) -> bool:
    """Whether this node may record a Tier 0 copy of every wanted part (no other node holds one)."""
    found = cat.replicas(ck.id, 0, wanted[0]) if len(wanted) == 1 else cat.replicas(ck.id, 0)
    rows = {r.part: r for r in found}
    return all(p not in rows or rows[p].node in (None, "", node) or rows[p].state != VERIFIED for p in wanted)


def fetch_to_tier0(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int], files: list[FileInfo],
                   wide: list[FileInfo], moved: dict[int, int], verify: Verify, actor: str,
                   notes: list[str]) -> ResumePoint:
    """Each wanted part copied into this node's Tier 0 from its nearest fetchable source, as a
    claimed copy recorded ``verified``; a source that fails is marked and the next one tried, one
    on a tier not proven (``TierUnavailable``) is passed over unjudged. Tier 0 itself unproven:
    ``TierUnavailable`` (the caller fetches beside it)."""
    done = []
    store = stores.get(0)  # proven first: nothing is judged or written on a stand-in
    for p in wanted:
        t0 = time.monotonic()
        srcs = sources(cat, stores, ck, p)
        own = next((s for s in srcs if Tier(s.tier).node_local), None)
        if own is not None and part_good(cat, store, ck, own, files, verify, actor, notes):
            done.append(PartResume(p, 0, IN_PLACE, 0, time.monotonic() - t0))  # this part is here already
            continue
        unproven = []
        for src in [s for s in srcs if not Tier(s.tier).node_local]:
            try:
                hop = copy_when_free(cat, stores.settings, ck, p, src_tier=src.tier, dst_tier=0, actor=actor)
            except TierUnavailable as exc:
                if exc.tier == 0:
                    raise
                unproven.append(str(exc))
                notes.append(f"step {ck.step} part {p}: tier {exc.tier} unreachable ({exc.reason}); "
                             "trying the next copy")
                continue
            except (CorruptCheckpoint, NotFound) as exc:
                mark(cat, src.replica, exc, actor, notes)
                continue
            if hop.skipped and not tier0_is_ours(cat, ck, [p], stores.settings.node):
                raise HeldElsewhere(f"part {p}'s Tier 0 copy was just made on another node")
            fetched = 0 if hop.skipped else hop.bytes  # skipped: another worker of this node just fetched it
            done.append(PartResume(p, src.tier if not moved[p] else 2, FETCHED, fetched + moved[p],
                                   time.monotonic() - t0))
            break
        else:
            if unproven:  # a copy that may come back: never a reason to fall back
                raise StorageUnavailable(f"{ck.run} step {ck.step} part {p}: no copy readable now "
                                         f"({'; '.join(unproven)})")
            raise NoGoodCopy(f"every copy of part {p} failed")
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    extra = sum(bring_file(cat, stores, ck, f, store, f"{prefix}/{f.path}", actor, notes) for f in wide)
    if extra:
        done[0] = PartResume(done[0].part, done[0].tier, done[0].source, done[0].bytes_moved + extra, done[0].seconds)
    folder = store.in_place(prefix)
    assert folder is not None
    return ResumePoint(ck.run, ck.step, str(folder), done)
