"""Plain values the catalog returns. ORM rows never leave ``db/``; callers get these."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from core.tiers import Tier

# Replica states and the legal moves between them (enforced in db/, not by callers).
PENDING, COPYING, VERIFIED, PRUNING, PRUNED, CORRUPT, MISSING = (
    "pending", "copying", "verified", "pruning", "pruned", "corrupt", "missing",
)
TRANSITIONS: dict[str, frozenset[str]] = {
    PENDING: frozenset({COPYING, CORRUPT, MISSING}),
    COPYING: frozenset({VERIFIED, CORRUPT, MISSING, COPYING}),  # COPYING->COPYING: stale-claim takeover
    VERIFIED: frozenset({PRUNING, CORRUPT, MISSING}),
    PRUNING: frozenset({PRUNED, CORRUPT, MISSING, VERIFIED}),  # PRUNING->VERIFIED: prune abandoned before delete
    PRUNED: frozenset({COPYING}),
    CORRUPT: frozenset({COPYING}),
    MISSING: frozenset({COPYING}),
}

# Checkpoint states: 'partial' (some parts registered), 'committed' (all parts registered on
# Tier 0), 'rejected' (bad input), 'corrupt' (the source failed verification), 'retired' (the
# retention policy keeps it nowhere: recorded before its first byte is deleted, then every copy
# goes; restore, resume and ``latest`` no longer offer it; lineage keeps its edges).
CKPT_PARTIAL, CKPT_COMMITTED, CKPT_REJECTED, CKPT_CORRUPT = "partial", "committed", "rejected", "corrupt"
CKPT_RETIRED = "retired"
# An older attempt's checkpoint above the step a newer attempt resumed from: kept as history
# (lineage, a restore that names its attempt), never offered for resume, ``latest``, drills or a
# default restore, and retired by retention once the newer attempt has a durable checkpoint.
CKPT_SUPERSEDED = "superseded"

TIER_NAMES: dict[int, str] = {t: t.short for t in Tier}


@dataclass(frozen=True)
class RunInfo:
    id: int
    name: str
    project: str | None
    created_at: datetime
    config_digest: str | None = None
    code_digest: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    parent_run: str | None = None
    parent_step: int | None = None
    parent_relation: str | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    id: int
    run: str
    step: int
    kind: str
    state: str
    parts: int
    parts_registered: int
    total_bytes: int
    file_count: int
    metrics: dict[str, float]
    created_at: datetime
    committed_at: datetime | None
    writer_stall_seconds: float | None
    format: str
    tags: dict[str, str] = field(default_factory=dict)
    attempt: str = ""  # the training attempt whose parts make it ('' the unnamed one)
    superseded_by: str | None = None  # the attempt that resumed from below it (state 'superseded')


@dataclass(frozen=True)
class FileInfo:
    checkpoint_id: int
    part: int
    path: str
    size: int
    algorithm: str
    checksum: str


@dataclass(frozen=True)
class ReplicaInfo:
    id: int
    checkpoint_id: int
    run: str
    step: int
    tier: int
    part: int
    node: str | None
    url: str
    state: str
    bytes: int | None
    verified_at: datetime | None
    copy_seconds: float | None
    etag: str | None
    version_id: str | None
    claim_token: str | None
    updated_at: datetime
    checked_at: datetime | None = None  # last read back and matched (entering verified, or a scrub)
    attempt: str = ""  # the checkpoint's attempt: with run and step, where its folder is


@dataclass(frozen=True)
class Claim:
    """Result of ``Catalog.claim_copy``: ``acquired`` means this caller must copy now;
    otherwise ``replica.state`` says why not (``verified``: nothing to do)."""

    replica: ReplicaInfo
    acquired: bool


@dataclass(frozen=True)
class PruneClaim:
    """Result of ``Catalog.claim_prune``: the replica, now ``pruning`` under this caller's
    ``replica.claim_token``. ``took_over``: a stalled prune (lease lapsed) was taken over, or
    (``reclaimed``) its own token's claim given back to a caller whose answer was lost;
    ``refused``: why the guard forbids finishing it (only on a takeover: the owner abandons)."""

    replica: ReplicaInfo
    took_over: bool = False
    refused: str | None = None
    reclaimed: bool = False


@dataclass(frozen=True)
class Location:
    """A verified, committed copy of a whole checkpoint on one tier (all parts verified)."""

    run: str
    step: int
    tier: int
    urls: tuple[str, ...]  # one per part, part order
    verified_at: datetime
    bytes: int


@dataclass(frozen=True)
class LineageEdge:
    child_run: str
    child_step: int
    parent_run: str
    parent_step: int
    relation: str
    depth: int = 1


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: datetime
    actor: str
    subject: str  # e.g. 'replica:12', 'checkpoint:run-a/100', 'event:<id>'
    action: str  # e.g. 'transition', 'register', 'reject', 'pin'
    from_state: str | None
    to_state: str | None
    reason: str | None
    run: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class TierUsage:
    run: str
    tier: int
    checkpoints: int
    bytes: int


@dataclass(frozen=True)
class TierHolding:
    """What one tier holds: checkpoints with a verified copy there, their bytes as the manifests
    count them (``logical_bytes``) and as the tier stores them (``stored_bytes``, ``db.storage``)."""

    tier: int
    checkpoints: int
    logical_bytes: int
    stored_bytes: int
    # Tier 0 (each node's own disk, its budget per node): the node storing the most, and how much
    fullest_node: str | None = None
    fullest_node_bytes: int = 0


@dataclass(frozen=True)
class HopTiming:
    """One timed transfer the catalog recorded: a copy into ``tier`` (``write``: the hop's copy
    and read-back) or a restore drill from it (``read``)."""

    tier: int
    direction: str  # 'write' | 'read'
    bytes: int
    seconds: float
    first_byte_seconds: float | None
    at: datetime  # when it ended (a copy: its replica verified)
    checkpoint_id: int | None = None  # a copy's: the parts of one checkpoint copy side by side


@dataclass(frozen=True)
class DrillResult:
    id: int
    run: str
    step: int
    tier: int
    ok: bool
    seconds: float
    bytes: int
    at: datetime
    detail: str | None = None
    nodes: int = 1
    bound_seconds: float | None = None
    tier_bytes: dict[str, int] | None = None  # {"tier": bytes read from it}
    node_seconds: list[float] | None = None  # per node, common start -> its part loaded


@dataclass(frozen=True)
class RejectionInfo:
    """A part refused once for good (until a re-save brings another manifest)."""

    run: str
    step: int
    part: int
    manifest_digest: str  # core.manifest.attempt_digest of the refused manifest
    node: str | None
    reason: str
    rejected_at: datetime
    actor: str


@dataclass(frozen=True)
class PromotionStatus:
    """What reconcile needs to know of one checkpoint it found committed on a tier
    (``Catalog.promotion_status``: one set-based read for all of them)."""

    id: int
    run: str
    step: int
    state: str
    parts: int
    registered: frozenset[int]  # parts whose manifest is recorded
    tier1: dict[int, str]  # part -> state of its Tier 1 replica (absent: none)
    stale: bool  # committed longer ago than the grace, with a part not (being) promoted


@dataclass(frozen=True)
class StoredCopy:
    """A verified replica with what must be on its tier: the checkpoint's part count (for the
    manifest's name) and the part's files (``Catalog.verified_page``)."""

    replica: ReplicaInfo
    parts: int
    files: tuple[FileInfo, ...]


@dataclass(frozen=True)
class TierRootInfo:
    """The identity marker recorded for a tier root (``node`` '' for the shared Tiers 1 and 2)."""

    tier: int
    node: str
    url: str
    identity: str
    recorded_at: datetime
