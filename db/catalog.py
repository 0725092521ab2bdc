"""The catalog's Python API: the only door to the database.

CONTRACT (implemented by the catalog work; callers rely on exactly this). Every method runs in
its own transaction through one managed-session helper; transient database failures raise
``CatalogUnavailable`` (retryable) and nothing is half-written; rule violations raise the
permanent errors of ``ckpt.errors``. Methods return ``db.entities`` values, never ORM rows.
``actor`` is a flow-run id, ``cli``, ``agent:<node>`` or similar, recorded in the audit log.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ckpt.manifest import Manifest
from db.entities import (
    AuditEntry,
    CheckpointInfo,
    Claim,
    DrillResult,
    FileInfo,
    LineageEdge,
    Location,
    ReplicaInfo,
    RunInfo,
    TierUsage,
)


class Catalog:
    # --- lifecycle -------------------------------------------------------------------
    def __init__(self, url: str, *, check_schema: bool = True):
        """Open the catalog at a SQLAlchemy URL. SQLite: WAL, foreign keys, busy timeout.
        With ``check_schema`` a schema behind the migrations' head raises ``SchemaOutdated``
        naming ``ckpt db upgrade``."""
        raise NotImplementedError

    def close(self) -> None: ...

    # --- runs ------------------------------------------------------------------------
    def ensure_run(self, name: str, *, project: str | None = None, config_digest: str | None = None,
                   code_digest: str | None = None, tags: dict[str, str] | None = None,
                   parent: tuple[str, int] | None = None, parent_relation: str = "resumed_from",
                   actor: str = "cli") -> RunInfo:
        """Create the run or return the existing one (idempotent). ``parent`` (run, step) records
        the run-level origin (resumed/fine-tuned/branched from that checkpoint)."""
        raise NotImplementedError

    def get_run(self, name: str) -> RunInfo:
        """Raises ``UnknownRun``."""
        raise NotImplementedError

    def list_runs(self) -> list[RunInfo]: ...

    # --- checkpoints -----------------------------------------------------------------
    def register_part(self, manifest: Manifest, *, actor: str) -> CheckpointInfo:
        """Record one part of a checkpoint (its files) from its manifest. Idempotent: the same
        manifest digest again returns the existing record; a different digest for the same
        (run, step, part) raises ``ConflictError``. Unknown run: ``UnknownRun``. When the last
        part arrives the checkpoint becomes ``committed``. A manifest's ``parent`` adds a lineage
        edge; the previous checkpoint of the same run gets a ``follows`` edge automatically."""
        raise NotImplementedError

    def get_checkpoint(self, run: str, step: int) -> CheckpointInfo:
        """Raises ``NotFound``."""
        raise NotImplementedError

    def list_checkpoints(self, run: str | None = None) -> list[CheckpointInfo]: ...

    def files(self, checkpoint_id: int, part: int | None = None) -> list[FileInfo]: ...

    def set_checkpoint_state(self, checkpoint_id: int, state: str, *, reason: str, actor: str) -> None:
        """e.g. ``corrupt`` when the source failed verification (audited)."""

    def record_rejection(self, subject: str, reason: str, *, actor: str, run: str | None = None,
                         step: int | None = None) -> None:
        """Audit a rejected input (malformed event, unknown run, path escape)."""

    # --- replicas (compare-and-set state machine, see db.entities.TRANSITIONS) ----------
    def claim_copy(self, checkpoint_id: int, tier: int, part: int, url: str, *, node: str | None,
                   actor: str, lease_seconds: float = 600) -> Claim:
        """Create the replica row (pending) if absent and move it to ``copying`` for this caller.
        ``acquired=False`` when it is already ``verified`` (nothing to do) or another claim is
        live (``copying`` and touched within ``lease_seconds``); a stale claim is taken over."""
        raise NotImplementedError

    def heartbeat(self, replica_id: int, claim_token: str) -> None:
        """Keep a claim alive during a long copy. Raises ``StaleState`` if the claim was lost."""

    def transition(self, replica_id: int, to_state: str, *, expected: str | Sequence[str] | None = None,
                   actor: str, reason: str | None = None, claim_token: str | None = None,
                   bytes: int | None = None, copy_seconds: float | None = None,
                   etag: str | None = None, version_id: str | None = None) -> ReplicaInfo:
        """Move a replica: illegal moves raise ``IllegalTransition``; a state not in ``expected``
        (or a foreign ``claim_token``) raises ``StaleState``. Entering ``verified`` stamps
        ``verified_at``. One transaction; audited."""
        raise NotImplementedError

    def begin_prune(self, replica_id: int, *, actor: str, reason: str | None = None) -> ReplicaInfo:
        """verified -> pruning, only if in the same transaction: another replica of the same
        checkpoint and part is verified on a tier >= this one, and the checkpoint is not the
        newest verified checkpoint of its run, not pinned and not aliased. Else ``PruneRefused``.
        Two concurrent prunes of the last two copies: exactly one wins."""
        raise NotImplementedError

    def complete_on_tier(self, checkpoint_id: int, tier: int, *, actor: str) -> bool:
        """True exactly once per (checkpoint, tier): for the first caller that observes every
        part of the checkpoint verified on ``tier`` (records the time, audited). Lets N part
        promotions trigger the cluster-level archive and retention once, not N times."""
        raise NotImplementedError

    def replicas(self, checkpoint_id: int, tier: int | None = None) -> list[ReplicaInfo]: ...

    def get_replica(self, replica_id: int) -> ReplicaInfo: ...

    # --- pins, aliases, lineage --------------------------------------------------------
    def pin(self, run: str, step: int, *, reason: str | None = None, actor: str) -> None: ...
    def unpin(self, run: str, step: int, *, actor: str) -> None: ...
    def set_alias(self, run: str, alias: str, step: int, *, actor: str) -> None: ...
    def remove_alias(self, run: str, alias: str, *, actor: str) -> None: ...
    def resolve_alias(self, run: str, alias: str) -> int: ...

    def add_lineage(self, child: tuple[str, int], parent: tuple[str, int], relation: str, *,
                    actor: str) -> None:
        """Raises ``LineageCycle`` if ``parent`` descends from ``child``; idempotent."""

    # --- queries (numbered as in the catalog issue) -------------------------------------
    def newest_verified(self, run: str, *, tier: int | None = None, follow_resumed: bool = False,
                        durable_only: bool = False) -> CheckpointInfo | None:
        """(1) Newest checkpoint with every part verified on some tier (or on ``tier``)."""
        raise NotImplementedError

    def locations(self, run: str, step: int) -> list[Location]:
        """(2) The tiers that hold a complete verified copy, with URLs and verified_at."""
        raise NotImplementedError

    def nearest_copy(self, run: str, step: int, preference: Sequence[int] = (0, 1, 2)) -> Location | None:
        """(3) First tier in ``preference`` holding a complete verified copy."""
        raise NotImplementedError

    def ancestors(self, run: str, step: int, *, max_depth: int = 1000) -> list[LineageEdge]:
        """(4) Recursive CTE up the lineage edges, nearest first."""
        raise NotImplementedError

    def descendants(self, run: str, step: int, *, max_depth: int = 1000) -> list[LineageEdge]:
        """(5) Recursive CTE down the lineage edges."""
        raise NotImplementedError

    def under_replicated(self, *, durable_tier: int = 1, min_copies: int = 1,
                         run: str | None = None) -> list[CheckpointInfo]:
        """(6) Committed checkpoints with no complete verified copy on a tier >= durable_tier,
        or fewer than ``min_copies`` complete verified copies."""
        raise NotImplementedError

    def prune_candidates(self, tier: int, policy, *, run: str | None = None,
                         now: datetime | None = None) -> list[ReplicaInfo]:
        """(7) Verified replicas on ``tier`` that ``policy`` (ckpt.settings.RetentionPolicy)
        no longer keeps, excluding pins, aliases and each run's newest verified checkpoint."""
        raise NotImplementedError

    def history(self, run: str, step: int) -> list[AuditEntry]:
        """(8) The checkpoint's audit trail, oldest first."""
        raise NotImplementedError

    def usage(self, run: str | None = None) -> list[TierUsage]:
        """(9) Verified bytes and checkpoint counts per run per tier."""
        raise NotImplementedError

    def unpromoted(self, *, older_than_seconds: float = 0, run: str | None = None) -> list[CheckpointInfo]:
        """(10) Committed checkpoints without a verified (or live copying) Tier 1 replica."""
        raise NotImplementedError

    # --- drills -------------------------------------------------------------------------
    def record_drill(self, run: str, step: int, tier: int, *, ok: bool, seconds: float, bytes: int,
                     detail: str | None = None, actor: str) -> DrillResult: ...
    def drills(self, run: str | None = None, limit: int = 50) -> list[DrillResult]: ...


def upgrade(url: str) -> str:
    """Apply Alembic migrations up to head on the catalog at ``url``; return the revision."""
    raise NotImplementedError
