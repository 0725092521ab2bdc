"""What a resume looks for: the parts and files a node needs, and the sources of each part,
cheapest first (``plan_sources``); what it hands back (``ResumePoint``). No I/O but the
catalog's rows and the stores' answer to ``TierStore.in_place``."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from core.errors import BadInput
from core.formats import WIDE_FILES
from core.layout import checkpoint_prefix
from core.tiers import ALL_TIERS, Tier, readable_from
from db.catalog import Catalog
from db.entities import VERIFIED, CheckpointInfo, FileInfo, ReplicaInfo
from tasks.replicas import TierStores

Verify = Literal["size", "full"]
IN_PLACE, FETCHED = "in place", "fetched"


@dataclass(frozen=True)
class PartResume:
    """Where one part came from: ``tier``, ``source`` (in place | fetched), bytes moved now."""
    part: int
    tier: int
    source: str
    bytes_moved: int
    seconds: float


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from and the local folder holding it."""
    run: str
    step: int
    path: str
    parts: list[PartResume] = field(default_factory=list)
    note: str | None = None  # set when it fell back to an older step, and why

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "path": self.path,
                "parts": [asdict(p) for p in self.parts], "note": self.note}


@dataclass(frozen=True)
class Source:
    """One way to get a part: read ``tier`` in place, or fetch from it."""
    tier: int
    in_place: bool
    replica: ReplicaInfo


class NoGoodCopy(Exception):
    """Every source of a wanted part failed (each already marked in the catalog)."""


class HeldElsewhere(Exception):
    """Another node won the claim on a wanted part's Tier 0 row: its copy is on that node's NVMe."""


def plan_sources(replicas: Iterable[ReplicaInfo], part: int, *, node: str, configured: set[int],
                 local: set[int]) -> list[Source]:
    """The sources of ``part``, cheapest first: this node's Tier 0 copy (in place), Tier 1 (in
    place where ``local``, else fetched), Tier 2 (fetched). Only verified replicas of configured
    tiers; Tier 0 only on its own node and only as a local folder."""
    verified = {Tier(r.tier): r for r in replicas if r.part == part and r.state == VERIFIED and r.tier in configured
                and readable_from(r.tier, r.node, node)}
    return [Source(t, t in local and not t.object_store, verified[t]) for t in ALL_TIERS
            if t in verified and (t in local or not t.node_local)]


def wanted_parts(ck: CheckpointInfo, part: int | None, parts: int | None) -> list[int]:
    """The parts this caller needs: ``part`` (checked against ``parts`` and the checkpoint), or all."""
    if parts is not None and parts != ck.parts:
        raise BadInput(f"{ck.run}/step-{ck.step} has {ck.parts} part(s), the job says --parts {parts}")
    if part is None:
        return list(range(ck.parts))
    if not 0 <= part < ck.parts:
        raise BadInput(f"part {part} out of range: {ck.run}/step-{ck.step} has {ck.parts} part(s)")
    return [part]


def wanted_files(cat: Catalog, ck: CheckpointInfo, wanted: Sequence[int]) -> list[FileInfo]:
    """The files of the wanted parts and every checkpoint-wide file (``WIDE_FILES``), whichever
    part holds it: for one part, that part's rows alone (at thousands of nodes each node's
    resume reads its own share of the catalog, not the whole checkpoint's)."""
    if len(wanted) == 1:
        return cat.files(ck.id, wanted[0], also_paths=WIDE_FILES)
    return cat.files(ck.id)


def wide_files(files: Sequence[FileInfo], wanted: Sequence[int]) -> list[FileInfo]:
    """Checkpoint-wide files (``WIDE_FILES``) that another part holds, one per path."""
    own = {f.path for f in files if f.part in wanted}
    seen: dict[str, FileInfo] = {}
    for f in files:
        if f.path in WIDE_FILES and f.path not in own and f.part not in wanted:
            seen.setdefault(f.path, f)
    return list(seen.values())


def tier_in_place(stores: TierStores, tier: int, ck: CheckpointInfo) -> bool:
    """Whether ``tier`` is a folder mounted here (its checkpoints can be read where they lie)."""
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    return stores.configured(tier) and stores.in_place(tier, prefix) is not None


def sources(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int) -> list[Source]:
    configured: set[int] = {t for t in ALL_TIERS if stores.configured(t)}
    return plan_sources(cat.replicas(ck.id, part=part), part, node=stores.settings.node, configured=configured,
                        local={t for t in configured if tier_in_place(stores, t, ck)})


def with_moved(point: ResumePoint, moved: dict[int, int], started: float, tier: int) -> ResumePoint:
    seconds = time.monotonic() - started
    parts = [PartResume(p.part, tier if moved.get(p.part) else p.tier, FETCHED if moved.get(p.part) else p.source,
                        p.bytes_moved + moved.get(p.part, 0), seconds) for p in point.parts]
    return ResumePoint(point.run, point.step, point.path, parts, point.note)
