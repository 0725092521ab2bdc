"""The catalog's Python API: the only door to the database.

CONTRACT (implemented by the catalog work; callers rely on exactly this). Every method runs in
its own transaction through one managed-session helper; transient database failures raise
``CatalogUnavailable`` (retryable) and nothing is half-written; rule violations raise the
permanent errors of ``core.errors``. Methods return ``db.entities`` values, never ORM rows.
``actor`` is a flow-run id, ``cli``, ``agent:<node>`` or similar, recorded in the audit log.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy import ColumnElement, event, func, select
from sqlalchemy.engine import make_url

from core.errors import BadInput, CatalogUnavailable, PruneRefused, SchemaOutdated, UnknownRun
from core.layout import check_attempt
from core.manifest import Manifest
from core.storage.content import SHARED_TIERS
from core.tiers import DURABLE_TIERS
from db import (
    attempts as _attempts,
    lineage as _lineage,
    queries as _q,
    register as _reg,
    rejections as _rej,
    retention as _ret,
    state as _state,
)
from db.audit import Audit
from db.clock import catalog_now as _now
from db.drills import Drills
from db.entities import (
    CKPT_COMMITTED,
    CKPT_CORRUPT,
    CKPT_PARTIAL,
    CKPT_REJECTED,
    CKPT_RETIRED,
    CKPT_SUPERSEDED,
    COPYING,
    CORRUPT,
    MISSING,
    PRUNING,
    VERIFIED,
    CheckpointInfo,
    Claim,
    FileInfo,
    LineageEdge,
    Location,
    PromotionStatus,
    PruneClaim,
    RejectionInfo,
    ReplicaInfo,
    RunInfo,
    StoredCopy,
    TierUsage,
)
from db.migrate import current_revision, head_revision, known_revisions, upgrade_connection
from db.pins import Pins
from db.rows import (
    add_audit,
    checkpoint_row,
    checkpoint_row_by_id,
    checkpoint_select,
    checkpoints,
    completions,
    cursors,
    files as files_table,
    insert_ignore,
    parts as parts_table,
    replica_row,
    replica_select,
    replicas as replicas_table,
    run_row,
    runs,
    tier_bit,
    to_checkpoint,
    to_file,
    to_replica,
    to_run,
)
from db.session import (
    DEFAULT_BUSY_TIMEOUT_S,
    CatalogPart,
    lease_engine,
    make_engine,
    normalize_url,
    release_engine,
    transaction,
)
from db.storage import Storage
from db.tier_roots import TierRoots

if TYPE_CHECKING:
    from core.retention import CheckpointFacts
    from core.settings import MilestonePolicy

CHECKPOINT_STATES = (CKPT_PARTIAL, CKPT_COMMITTED, CKPT_REJECTED, CKPT_CORRUPT)


class Catalog(Pins, Audit, Drills, TierRoots, Storage, CatalogPart):
    # --- lifecycle -------------------------------------------------------------------
    def __init__(self, url: str, *, check_schema: bool = True,
                 busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        """Open the catalog at a SQLAlchemy URL. SQLite: WAL, foreign keys, busy timeout.
        With ``check_schema`` a schema behind the migrations' head raises ``SchemaOutdated``
        naming ``ckpt db upgrade`` (checked once per URL per process, again after
        ``SCHEMA_RECHECK_S`` and after ``upgrade``). ``busy_timeout_s``: how long a SQLite
        writer waits for the lock before the call fails with ``CatalogUnavailable``.
        The engine is the process's shared one for this URL (``db.session.lease_engine``);
        ``close`` gives it back without disposing it."""
        self.url = url
        self._lease = lease_engine(url, busy_timeout_s=busy_timeout_s)
        self.engine = self._lease.engine
        if check_schema and not _schema_passed_recently(url):
            try:
                self.check_schema()
            except Exception:
                self.close()
                raise

    @classmethod
    def open(cls, url: str, *, auto_upgrade: bool = False, **kwargs: Any) -> Catalog:
        """Open the catalog; with ``auto_upgrade`` first create/upgrade its schema (demo, tests)."""
        if auto_upgrade:
            upgrade(url)
        return cls(url, **kwargs)

    def check_schema(self) -> None:
        """Raise ``SchemaOutdated`` unless the database is at the migrations' head."""
        with transaction(self.engine, write=False) as conn:
            rev = current_revision(conn)
        head = _head()
        if rev == head:
            _schema_passed[normalize_url(self.url)] = time.monotonic()
            return
        where = make_url(self.engine.url).render_as_string(hide_password=True)
        if rev is None:
            raise SchemaOutdated(f"the catalog at {where} has no schema yet; run `ckpt db upgrade`")
        if rev not in known_revisions():
            raise SchemaOutdated(f"the catalog at {where} is at revision {rev}, newer than this ckpt "
                                 f"(head {head}); upgrade ckpt")
        raise SchemaOutdated(f"the catalog at {where} is at revision {rev}, this ckpt needs {head}; "
                             f"run `ckpt db upgrade`")

    def close(self) -> None:
        """Give the shared engine back (its pool stays for the next ``Catalog`` on this URL)."""
        release_engine(self._lease)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- runs ------------------------------------------------------------------------
    def ensure_run(self, name: str, *, project: str | None = None, config_digest: str | None = None,
                   code_digest: str | None = None, tags: dict[str, str] | None = None,
                   parent: tuple[str, int] | None = None, parent_relation: str = "resumed_from",
                   actor: str = "cli") -> RunInfo:
        """Create the run or return the existing one (idempotent). ``parent`` (run, step) records
        the run-level origin (resumed/fine-tuned/branched from that checkpoint). The origin
        checkpoint must be recorded (``NotFound`` otherwise); the run's first checkpoint gets
        the lineage edge to it."""
        with self._tx() as conn:
            row = _reg.ensure_run(conn, name, now=_now(conn), actor=actor, parent=parent,
                                  parent_relation=parent_relation, project=project,
                                  config_digest=config_digest, code_digest=code_digest, tags=tags)
            return to_run(row)

    def get_run(self, name: str) -> RunInfo:
        """Raises ``UnknownRun``."""
        with self._tx(write=False) as conn:
            return to_run(run_row(conn, name))

    def list_runs(self) -> list[RunInfo]:
        with self._tx(write=False) as conn:
            return [to_run(r) for r in conn.execute(select(runs).order_by(runs.c.name))]

    # --- checkpoints -----------------------------------------------------------------
    def register_part(self, manifest: Manifest, *, actor: str) -> CheckpointInfo:
        """Record one part of a checkpoint (its files) from its manifest. Idempotent: the same
        manifest digest again returns the existing record; a different digest for the same
        (run, step, part) raises ``ConflictError``, and so does a part that lists a relative path
        another part of the checkpoint lists with other bytes. Unknown run: ``UnknownRun``. When the last
        part arrives the checkpoint becomes ``committed``. A manifest's ``parent`` adds a lineage
        edge; the previous checkpoint of the same run gets a ``follows`` edge automatically."""
        manifest.validate()
        digest = manifest.digest()
        with self._tx() as conn:
            now = None if conn.dialect.name == "postgresql" else _now(conn)  # None: read with the run's lock
            return _reg.register_part(conn, manifest, digest=digest, now=now, actor=actor)

    def register_many(self, manifests: Sequence[Manifest], *, actor: str) -> int:
        """Bulk ``register_part`` in one transaction (backfills, imports): same rules, one
        commit, multi-row inserts where the batch allows. Returns how many manifests were
        processed; any error rolls back all of them."""
        for m in manifests:
            m.validate()
        with self._tx() as conn:
            _reg.register_batch(conn, list(manifests), now=_now(conn), actor=actor)
        return len(manifests)

    def get_checkpoint(self, run: str, step: int, attempt: str | None = None) -> CheckpointInfo:
        """The checkpoint at ``step`` written by ``attempt``; None: the one not superseded, else
        the one recorded last (``checkpoint_row``). Raises ``NotFound``."""
        with self._tx(write=False) as conn:
            return to_checkpoint(checkpoint_row(conn, run, step, attempt=attempt))

    def record_resume(self, run: str, attempt: str, step: int | None, *, actor: str) -> list[int]:
        """Attempt ``attempt`` of ``run`` resumes from ``step`` (None: from scratch): the older
        attempts' checkpoints above it are superseded (``db.attempts``). The run is created if it
        is new. Returns the steps superseded by this call."""
        check_attempt(attempt)
        with self._tx() as conn:
            now = _now(conn)
            _reg.ensure_run(conn, run, now=now, actor=actor, parent=None, parent_relation="resumed_from", tags=None)
            return _attempts.record_resume(conn, run_row(conn, run, lock=True), attempt, step, now=now, actor=actor)

    def attempt_refusal(self, run: str, attempt: str, *, created: str) -> str | None:
        """Why every checkpoint ``attempt`` writes at ``created`` (ISO-8601) would be refused (it
        never resumed, and an older attempt of the run holds checkpoints: a run name reused by
        mistake), or None; None too for a run the catalog does not know (``db.attempts``)."""
        check_attempt(attempt)
        with self._tx(write=False) as conn:
            try:
                row = run_row(conn, run)
            except UnknownRun:
                return None
            return _attempts.refusal(conn, row, attempt, created=created)

    def get_checkpoint_by_id(self, checkpoint_id: int) -> CheckpointInfo:
        """Raises ``NotFound``."""
        with self._tx(write=False) as conn:
            return to_checkpoint(checkpoint_row_by_id(conn, checkpoint_id))

    def list_checkpoints(self, run: str | None = None) -> list[CheckpointInfo]:
        with self._tx(write=False) as conn:
            stmt = checkpoint_select().order_by(runs.c.name, checkpoints.c.step)
            if run is not None:
                stmt = stmt.where(checkpoints.c.run_id == run_row(conn, run).id)
            return [to_checkpoint(r) for r in conn.execute(stmt)]

    def count_checkpoints(self, run: str) -> int:
        """How many checkpoints the run has (any state). Raises ``UnknownRun``."""
        with self._tx(write=False) as conn:
            return conn.execute(select(func.count()).select_from(checkpoints)
                                .where(checkpoints.c.run_id == run_row(conn, run).id)).scalar_one()

    def newest_checkpoints(self, run: str, limit: int) -> list[CheckpointInfo]:
        """The run's ``limit`` checkpoints of highest step (any state), newest first. Raises
        ``UnknownRun``."""
        with self._tx(write=False) as conn:
            return _q.newest_checkpoints(conn, run_row(conn, run).id, limit)

    def recorded_stalls(self, run: str, limit: int) -> list[tuple[datetime, float]]:
        """(created_at, writer_stall_seconds) of the run's ``limit`` checkpoints of highest step
        that recorded a writer stall, newest first (``core.sizing.measured``'s input over a
        window). Raises ``UnknownRun``."""
        with self._tx(write=False) as conn:
            return _q.recorded_stalls(conn, run_row(conn, run).id, limit)

    def complete_at(self, checkpoint_ids: Sequence[int], tier: int) -> dict[int, datetime]:
        """checkpoint id -> when it became complete on ``tier`` (the newest ``verified_at`` of
        its parts' verified replicas there, as ``locations`` reports it), for those of
        ``checkpoint_ids`` that are complete on ``tier``; one query for all of them."""
        if not checkpoint_ids:
            return {}
        with self._tx(write=False) as conn:
            return _q.complete_at(conn, checkpoint_ids, _state.check_tier(tier))

    def checkpoint_tiers(self, run: str | None = None) -> dict[tuple[str, int], tuple[int, ...]]:
        """(run, step) -> the tiers holding a complete verified copy, for listings."""
        stmt = select(runs.c.name, checkpoints.c.step, checkpoints.c.verified_tiers).join(
            runs, runs.c.id == checkpoints.c.run_id)
        with self._tx(write=False) as conn:
            if run is not None:
                stmt = stmt.where(checkpoints.c.run_id == run_row(conn, run).id)
            return {(n, s): tuple(_q.complete_tiers(m)) for n, s, m in conn.execute(stmt)}

    def checkpoint_states(self, pairs: Sequence[tuple[str, int]]) -> dict[tuple[str, int], str]:
        """(run, step) -> state of each known checkpoint of ``pairs`` (a lineage tree's nodes):
        one query per 500 pairs."""
        wanted, out = sorted(set(pairs)), dict[tuple[str, int], str]()
        with self._tx(write=False) as conn:
            for i in range(0, len(wanted), 500):
                chunk = wanted[i:i + 500]
                stmt = (select(runs.c.name, checkpoints.c.step, checkpoints.c.state)
                        .select_from(checkpoints.join(runs, runs.c.id == checkpoints.c.run_id))
                        .where(runs.c.name.in_({r for r, _ in chunk}),
                               checkpoints.c.step.in_({s for _, s in chunk})))
                out |= {(n, st): state for n, st, state in conn.execute(stmt) if (n, st) in set(chunk)}
        return out

    def files(self, checkpoint_id: int, part: int | None = None, *, also_paths: Collection[str] = ()
              ) -> list[FileInfo]:
        """The checkpoint's files, by part and path; ``part``: that part's alone, and with
        ``also_paths`` also every part's files of those paths (the checkpoint-wide files a part
        needs to load, whichever part holds them): a node reads its own rows, not the whole
        checkpoint's."""
        stmt = select(files_table).where(files_table.c.checkpoint_id == checkpoint_id)
        if part is not None and also_paths:
            stmt = stmt.where((files_table.c.part == part) | files_table.c.path.in_(sorted(also_paths)))
        elif part is not None:
            stmt = stmt.where(files_table.c.part == part)
        with self._tx(write=False) as conn:
            return [to_file(r) for r in conn.execute(stmt.order_by(files_table.c.part, files_table.c.path))]

    def set_checkpoint_state(self, checkpoint_id: int, state: str, *, reason: str, actor: str) -> None:
        """e.g. ``corrupt`` when the source failed verification (audited)."""
        if state not in CHECKPOINT_STATES:
            raise BadInput(f"unknown checkpoint state {state!r}; expected one of {CHECKPOINT_STATES}")
        with self._tx() as conn:
            now = _now(conn)
            ck = checkpoint_row_by_id(conn, checkpoint_id, lock=True)
            conn.execute(checkpoints.update().where(checkpoints.c.id == ck.id).values(state=state))
            add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{ck.run_name}/{ck.step}", action="set-state",
                      from_state=ck.state, to_state=state, reason=reason, run=ck.run_name, step=ck.step)

    def record_rejection(self, subject: str, reason: str, *, actor: str, run: str | None = None,
                         step: int | None = None) -> None:
        """Audit a rejected input (malformed event, unknown run, path escape)."""
        with self._tx() as conn:
            add_audit(conn, at=_now(conn), actor=actor, subject=subject, action="reject", to_state="rejected",
                      reason=reason, run=run, step=step)

    def reject_part(self, run: str, step: int, part: int, *, digest: str, reason: str, actor: str,
                    node: str | None = None) -> bool:
        """Record that this manifest (``digest``: ``core.manifest.attempt_digest``) of a part was
        refused for a permanent reason; audited once. True if new, False if recorded before.
        See ``db.rejections`` for when the checkpoint itself becomes ``rejected``."""
        with self._tx() as conn:
            return _rej.record(conn, run, step, part, digest=digest, reason=reason, node=node, now=_now(conn),
                               actor=actor)

    def rejection(self, run: str, step: int, part: int, digest: str) -> RejectionInfo | None:
        """The recorded refusal of exactly this manifest of the part, if any."""
        with self._tx(write=False) as conn:
            return _rej.find(conn, run, step, part, digest)

    def part_registered(self, run: str, step: int, part: int, attempt: str, digest: str) -> bool:
        """Whether this manifest (its ``digest``) is the one registered for the part."""
        with self._tx(write=False) as conn:
            return conn.execute(
                select(parts_table.c.checkpoint_id)
                .join(checkpoints, checkpoints.c.id == parts_table.c.checkpoint_id)
                .join(runs, runs.c.id == checkpoints.c.run_id)
                .where(runs.c.name == run, checkpoints.c.step == step, checkpoints.c.attempt == attempt,
                       parts_table.c.part == part, parts_table.c.manifest_digest == digest)).first() is not None

    def rejections(self, run: str | None = None) -> list[RejectionInfo]:
        with self._tx(write=False) as conn:
            return _rej.listing(conn, run)

    def record_deletion(self, subject: str, reason: str, *, actor: str, run: str | None = None,
                        step: int | None = None) -> None:
        """Audit that bytes were deleted from a tier (``subject`` says what: a part's files on a
        tier, a killed copy's staging data) and why. Every delete leaves one row, so the audit
        log explains every file that disappeared."""
        with self._tx() as conn:
            add_audit(conn, at=_now(conn), actor=actor, subject=subject, action="delete", reason=reason,
                      run=run, step=step)

    # --- replicas (compare-and-set state machine, see db.entities.TRANSITIONS) ----------
    def claim_copy(self, checkpoint_id: int, tier: int, part: int, url: str, *, node: str | None,
                   actor: str, lease_seconds: float = 600, token: str | None = None) -> Claim:
        """Create the replica row (pending) if absent and move it to ``copying`` for this caller.
        ``acquired=False`` when it is already ``verified`` (nothing to do) or another claim is
        live (``copying`` and touched within ``lease_seconds``); a stale claim is taken over.
        (Also ``acquired=False`` while it is ``pruning``: a prune owns it.)

        ``token``: the claim token to use (default: a fresh one). A caller whose earlier call
        with the same token raised after the catalog committed it (the answer lost) gets that
        claim back, live or lapsed, with a fresh lease (audited ``reclaim``), instead of meeting
        it as another worker's until its lease lapses. A token must be unguessable and used by
        one worker only (``tasks.claim`` keeps the tokens of answers lost in its process)."""
        with self._tx() as conn:
            return _state.claim_copy(conn, checkpoint_id, tier, part, url, node=node, now=_now(conn), actor=actor,
                                     lease_seconds=lease_seconds, token=token)

    def heartbeat(self, replica_id: int, claim_token: str) -> None:
        """Keep a claim alive during a long copy. Raises ``StaleState`` if the claim was lost."""
        with self._tx() as conn:
            _state.heartbeat(conn, replica_id, claim_token, now=_now(conn))

    def transition(self, replica_id: int, to_state: str, *, expected: str | Sequence[str] | None = None,
                   actor: str, reason: str | None = None, claim_token: str | None = None,
                   bytes: int | None = None, copy_seconds: float | None = None,
                   first_byte_seconds: float | None = None,
                   etag: str | None = None, version_id: str | None = None,
                   seen_updated_at: datetime | None = None) -> ReplicaInfo:
        """Move a replica: illegal moves raise ``IllegalTransition``; a state not in ``expected``
        (or a foreign ``claim_token``, or a row changed since the caller read it at
        ``seen_updated_at``: a compare-and-set on what it saw) raises ``StaleState``. Entering
        ``verified`` stamps ``verified_at``. One transaction; audited."""
        given = dict(bytes=bytes, copy_seconds=copy_seconds, first_byte_seconds=first_byte_seconds, etag=etag,
                     version_id=version_id)
        values = {k: v for k, v in given.items() if v is not None}
        with self._tx() as conn:
            row = _state.transition(conn, replica_id, to_state, expected=expected, claim_token=claim_token,
                                    now=_now(conn), actor=actor, reason=reason, values=values,
                                    seen_updated_at=seen_updated_at)
            return to_replica(row)

    def claim_prune(self, replica_id: int, *, actor: str, reason: str | None = None,
                    lease_seconds: float = 120, token: str | None = None) -> PruneClaim:
        """Take the prune of a replica as its owner: ``verified -> pruning`` under a fresh claim
        token and a lease of ``lease_seconds`` (renew it with ``heartbeat``), only if in the same
        transaction another replica of the same checkpoint and part is verified on a tier >= this
        one, and the checkpoint is not the newest verified checkpoint of its run, not pinned and
        not aliased; else ``PruneRefused``. Two concurrent prunes of the last two copies: exactly
        one wins. A replica already ``pruning`` under a live lease: ``StaleState``. One whose
        lease lapsed is taken over (``took_over``, audited) with the guard's current verdict in
        ``refused``. Only the owner's token finishes (``pruned``) or abandons the prune.
        ("Tier >= this one" is by durability class, ``core.tiers.Tier.durability``: Tiers 1 and 2 both
        survive node loss and stand in for each other; Tier 0 never protects a higher tier.)
        ``token``: as for ``claim_copy``; a prune under this very token (its caller's answer was
        lost) is given back as a takeover is (``took_over`` and ``reclaimed``, the guard's verdict
        in ``refused``), live lease or not (audited ``reclaim``)."""
        with self._tx() as conn:
            return _state.claim_prune(conn, replica_id, now=_now(conn), actor=actor, reason=reason,
                                      lease_seconds=lease_seconds, token=token)

    def begin_prune(self, replica_id: int, *, actor: str, reason: str | None = None,
                    lease_seconds: float = 120) -> ReplicaInfo:
        """``claim_prune`` that raises ``PruneRefused`` for any refusal; the returned replica
        carries the claim token that finishes the prune."""
        claim = self.claim_prune(replica_id, actor=actor, reason=reason, lease_seconds=lease_seconds)
        if claim.refused:
            raise PruneRefused(claim.refused)
        return claim.replica

    def expired_claims(self) -> list[ReplicaInfo]:
        """Replicas stuck ``copying`` or ``pruning`` past their lease (by the catalog's clock)."""
        with self._tx(write=False) as conn:
            return [to_replica(r) for r in _state.expired_claims(conn, now=_now(conn))]

    def live_claim_tokens(self, tokens: Collection[str]) -> set[str]:
        """Those of ``tokens`` that still hold a claim: a replica ``copying`` or ``pruning`` under
        it (a lapsed lease not yet taken over counts: its worker may take it back). A token none
        holds belongs to a claim that is over; what it set aside (a tombstone) is garbage."""
        if not tokens:
            return set()
        with self._tx(write=False) as conn:
            return set(conn.execute(select(replicas_table.c.claim_token).where(
                replicas_table.c.claim_token.in_(sorted(tokens)),
                replicas_table.c.state.in_((COPYING, PRUNING)))).scalars())

    def expire_copy_claim(self, replica_id: int, *, actor: str) -> bool:
        """A ``copying`` replica past its lease -> ``missing`` (audited); False if not stuck."""
        with self._tx() as conn:
            return _state.expire_copy_claim(conn, replica_id, now=_now(conn), actor=actor)

    def complete_on_tier(self, checkpoint_id: int, tier: int, *, actor: str) -> bool:
        """True exactly once per (checkpoint, tier): for the first caller that observes every
        part of the checkpoint verified on ``tier`` (records the time, audited). Lets N part
        promotions trigger the cluster-level archive and retention once, not N times."""
        with self._tx() as conn:
            now = _now(conn)
            ck = checkpoint_row_by_id(conn, checkpoint_id, lock=True)
            if ck.parts_registered < ck.parts or not ck.verified_tiers & (1 << _state.check_tier(tier)):
                return False
            won = insert_ignore(conn, completions, dict(checkpoint_id=ck.id, tier=tier, completed_at=now,
                                                        actor=actor), ["checkpoint_id", "tier"]) == 1
            if won:
                add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{ck.run_name}/{ck.step}",
                          action="complete", to_state=f"tier{tier}", reason=f"all {ck.parts} part(s) verified on "
                          f"tier {tier}", run=ck.run_name, step=ck.step)
            return won

    def claim_followups(self, checkpoint_id: int, tier: int = 1, *, lease_seconds: float) -> bool:
        """Take the work that follows the checkpoint's completion on ``tier`` (archive, durable
        event, status page, retention) for ``lease_seconds``: True when it is open
        (``followups_open``), in one compare-and-set, so two callers never both take it.
        Whoever recorded the completion is not special: a retry, a duplicate event or reconcile
        finishes what a killed caller left."""
        with self._tx() as conn:
            now = _now(conn)
            return conn.execute(completions.update().where(
                _completion(checkpoint_id, tier), _followups_free(now)).values(
                followups_lease_until=now + timedelta(seconds=lease_seconds))).rowcount == 1

    def followups_open(self, checkpoint_id: int, tier: int = 1) -> bool:
        """Whether the checkpoint is recorded complete on ``tier`` with its follow-ups not
        recorded done and under no live lease (a lapsed one counts as free): what
        ``claim_followups`` would take now."""
        with self._tx(write=False) as conn:
            return conn.execute(select(completions.c.checkpoint_id).where(
                _completion(checkpoint_id, tier), _followups_free(_now(conn)))).first() is not None

    def followups_done(self, checkpoint_id: int, tier: int = 1, *, actor: str) -> None:
        """Record the follow-ups of the checkpoint's completion on ``tier`` done (idempotent)."""
        with self._tx() as conn:
            now = _now(conn)
            ck = checkpoint_row_by_id(conn, checkpoint_id)
            done = conn.execute(completions.update().where(
                completions.c.checkpoint_id == checkpoint_id, completions.c.tier == _state.check_tier(tier),
                completions.c.followups_done_at.is_(None)).values(
                followups_done_at=now, followups_lease_until=None)).rowcount
            if done:
                add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{ck.run_name}/{ck.step}",
                          action="followups-done", to_state=f"tier{tier}",
                          reason="archive, durable event, status page and retention done", run=ck.run_name,
                          step=ck.step)

    def followups_due(self, tier: int = 1, *, older_than_seconds: float = 0,
                      limit: int = 100) -> list[CheckpointInfo]:
        """Checkpoints complete on ``tier`` more than ``older_than_seconds`` ago (catalog clock)
        whose follow-ups are not done and not under a live lease, oldest first: a read of the
        partial index of unfinished completions (migration 0008), whatever the catalog holds."""
        with self._tx(write=False) as conn:
            now = _now(conn)
            due = select(completions.c.checkpoint_id).where(
                _followups_free(now), completions.c.tier == _state.check_tier(tier),
                completions.c.completed_at <= now - timedelta(seconds=older_than_seconds),
            ).order_by(completions.c.completed_at).limit(limit)
            ids = [r.checkpoint_id for r in conn.execute(due)]
            if not ids:
                return []
            rows = {c.id: c for c in map(to_checkpoint, conn.execute(
                checkpoint_select().where(checkpoints.c.id.in_(ids))))}
            return [rows[i] for i in ids if i in rows]

    def replicas(self, checkpoint_id: int, tier: int | None = None, part: int | None = None) -> list[ReplicaInfo]:
        """The checkpoint's replicas by tier and part; ``tier`` / ``part``: those alone (a node
        resuming its part reads that part's rows, not every part's)."""
        stmt = replica_select().where(replicas_table.c.checkpoint_id == checkpoint_id)
        if tier is not None:
            stmt = stmt.where(replicas_table.c.tier == tier)
        if part is not None:
            stmt = stmt.where(replicas_table.c.part == part)
        with self._tx(write=False) as conn:
            return [to_replica(r) for r in conn.execute(stmt.order_by(replicas_table.c.tier, replicas_table.c.part))]

    def get_replica(self, replica_id: int) -> ReplicaInfo:
        """Raises ``NotFound``."""
        with self._tx(write=False) as conn:
            return to_replica(replica_row(conn, replica_id))

    # --- scrub: reading stored copies back ---------------------------------------------
    def scrub_candidates(self, tiers: Sequence[int], limit: int | None, *,
                         run: str | None = None) -> list[ReplicaInfo]:
        """Verified replicas on ``tiers``, least recently read back first: never checked
        (``checked_at`` NULL, which only a row the stamping missed can be) first, then oldest
        ``checked_at``, ties by id. At most ``limit`` (None: all). Reading the first ``limit``
        and stamping each with ``mark_checked`` visits every verified replica within
        ``ceil(count / limit)`` rounds. Ordered, limited scan of the ``(state, checked_at,
        id)`` index; the NULLs are a separate probe so that the order is the same on both
        backends (PostgreSQL sorts NULLs last, SQLite first). Raises ``UnknownRun``."""
        wanted = tuple(_state.check_tier(t) for t in tiers)
        if not wanted or (limit is not None and limit <= 0):
            return []
        base = replica_select().where(replicas_table.c.state == VERIFIED, replicas_table.c.tier.in_(wanted))
        checked = replicas_table.c.checked_at
        with self._tx(write=False) as conn:
            if run is not None:
                base = base.where(checkpoints.c.run_id == run_row(conn, run).id)
            found = [to_replica(r) for r in conn.execute(
                base.where(checked.is_(None)).order_by(replicas_table.c.id).limit(limit))]
            left = None if limit is None else limit - len(found)
            if left is None or left > 0:
                found += [to_replica(r) for r in conn.execute(
                    base.where(checked.is_not(None)).order_by(checked, replicas_table.c.id).limit(left))]
            return found

    def count_verified(self, tiers: Sequence[int], *, run: str | None = None) -> int:
        """How many verified replicas are on ``tiers`` (the pool ``scrub_candidates`` draws
        from). Raises ``UnknownRun``."""
        wanted = tuple(_state.check_tier(t) for t in tiers)
        stmt = select(func.count()).select_from(replicas_table).where(
            replicas_table.c.state == VERIFIED, replicas_table.c.tier.in_(wanted))
        with self._tx(write=False) as conn:
            if run is not None:
                of_run = select(checkpoints.c.id).where(checkpoints.c.run_id == run_row(conn, run).id)
                stmt = stmt.where(replicas_table.c.checkpoint_id.in_(of_run))
            return conn.execute(stmt).scalar_one() if wanted else 0

    def bad_replicas(self, tiers: Sequence[int], *, run: str | None = None) -> list[ReplicaInfo]:
        """Replicas on ``tiers`` found ``corrupt`` or ``missing`` (what a scrub repairs), by id;
        the ``(tier, state)`` index, not a walk over every checkpoint. Raises ``UnknownRun``."""
        wanted = tuple(_state.check_tier(t) for t in tiers)
        stmt = replica_select().where(replicas_table.c.state.in_((CORRUPT, MISSING)),
                                      replicas_table.c.tier.in_(wanted)).order_by(replicas_table.c.id)
        with self._tx(write=False) as conn:
            if run is not None:
                stmt = stmt.where(checkpoints.c.run_id == run_row(conn, run).id)
            return [to_replica(r) for r in conn.execute(stmt)] if wanted else []

    def mark_checked(self, replica_id: int, *, actor: str) -> bool:
        """Stamp ``checked_at`` = now: the replica's bytes were just read back and matched.
        Only while it is still ``verified`` (a copy that moved on meanwhile, e.g. into a prune
        or marked corrupt by another reader, is left alone): True if stamped. ``NotFound`` for
        an unknown id. No audit row and ``updated_at`` is kept: a clean check changes no state,
        and one row per replica per scrub cycle would swamp the audit log (a failed check is a
        ``transition``, audited as ever). ``actor`` is accepted like every other write's, for
        a light audit later without changing callers; it is not recorded now."""
        with self._tx() as conn:
            done = conn.execute(replicas_table.update().where(
                replicas_table.c.id == replica_id, replicas_table.c.state == VERIFIED).values(
                checked_at=_now(conn))).rowcount
            if done != 1:
                replica_row(conn, replica_id)  # NotFound for an unknown id
            return done == 1

    # --- queries (numbered as in the catalog issue) -------------------------------------
    def newest_verified(self, run: str, *, tier: int | None = None, follow_resumed: bool = False,
                        durable_only: bool = False) -> CheckpointInfo | None:
        """(1) Newest checkpoint with every part verified on some tier (or on ``tier``).
        ``follow_resumed``: if the run has none, look in the run it was resumed from, at or
        below the step it resumed from, and so on up. Raises ``UnknownRun``."""
        with self._tx(write=False) as conn:
            return _q.newest_verified(conn, run, tier=tier, follow_resumed=follow_resumed, durable_only=durable_only)

    def locations(self, run: str, step: int) -> list[Location]:
        """(2) The tiers that hold a complete verified copy, with URLs and verified_at."""
        with self._tx(write=False) as conn:
            return _q.locations(conn, checkpoint_row(conn, run, step))

    def durable_now(self, run: str, steps: Collection[int]) -> dict[int, bool]:
        """step -> whether a checkpoint of ``run`` at that step is held whole and verified on a
        durable tier (Tier 1 or 2) now, in one statement; a step whose checkpoints retention
        retired, or a newer attempt superseded, is left out (no loss: a decision)."""
        if not steps:
            return {}
        want = 0
        for t in DURABLE_TIERS:
            want |= tier_bit(t)
        with self._tx(write=False) as conn:
            rows = conn.execute(select(checkpoints.c.step, checkpoints.c.verified_tiers)
                                .where(checkpoints.c.run_id == run_row(conn, run).id,
                                       checkpoints.c.step.in_(list(steps)),
                                       checkpoints.c.state.not_in([CKPT_RETIRED, CKPT_SUPERSEDED])))
            out: dict[int, bool] = {}
            for step, mask in rows:
                out[int(step)] = out.get(int(step), False) or bool(mask & want)
        return out

    def nearest_copy(self, run: str, step: int, preference: Sequence[int] = (0, 1, 2)) -> Location | None:
        """(3) First tier in ``preference`` holding a complete verified copy."""
        by_tier = {loc.tier: loc for loc in self.locations(run, step)}
        return next((by_tier[t] for t in preference if t in by_tier), None)

    def ancestors(self, run: str, step: int, *, max_depth: int = 1000) -> list[LineageEdge]:
        """(4) Recursive CTE up the lineage edges, nearest first."""
        with self._tx(write=False) as conn:
            return _lineage.walk(conn, checkpoint_row(conn, run, step).id, up=True, max_depth=max_depth)

    def descendants(self, run: str, step: int, *, max_depth: int = 1000) -> list[LineageEdge]:
        """(5) Recursive CTE down the lineage edges."""
        with self._tx(write=False) as conn:
            return _lineage.walk(conn, checkpoint_row(conn, run, step).id, up=False, max_depth=max_depth)

    def under_replicated(self, *, durable_tier: int = 1, min_copies: int = 1,
                         run: str | None = None, limit: int | None = None) -> list[CheckpointInfo]:
        """(6) Committed checkpoints with no complete verified copy on a tier >= durable_tier,
        or fewer than ``min_copies`` complete verified copies."""
        with self._tx(write=False) as conn:
            run_id = run_row(conn, run).id if run is not None else None
            return _q.under_replicated(conn, durable_tier=durable_tier, min_copies=min_copies, run_id=run_id,
                                       limit=limit)

    def retention_facts(self, *, run: str | None = None, node: str | None = None,
                        contents: bool = False) -> list[CheckpointFacts]:
        """(7) What ``core.retention.plan`` decides from: every committed or retired checkpoint
        with a verified replica (of ``run``; with ``node``, of the runs with a Tier 0 replica on
        that node), each with its verified replicas, pins, aliases and lineage children."""
        with self._tx(write=False) as conn:
            run_ids = [run_row(conn, run).id] if run is not None else None
            return _ret.facts(conn, run_ids=run_ids, node=node, contents=contents)

    def retire(self, run: str, step: int, *, reason: str, actor: str, keep_parents: bool = True,
               attempt: str | None = None) -> bool:
        """Record the checkpoint ``retired`` (audited) before any of its bytes is deleted; True
        if recorded now, False if it was already. ``PruneRefused`` when a pin, an alias, being
        the run's newest verified or newer than its newest durable checkpoint, or (with
        ``keep_parents``) a child run forbids it, checked again under the checkpoint's lock."""
        with self._tx() as conn:
            return _ret.retire(conn, run, step, reason=reason, actor=actor, now=_now(conn),
                               keep_parents=keep_parents, attempt=attempt)

    def retired_with_copies(self, *, limit: int = 1000) -> list[tuple[str, int]]:
        """(run, step) of retired checkpoints that still have a verified replica: retirements a
        crash interrupted, for reconcile to finish."""
        with self._tx(write=False) as conn:
            return _ret.retired_with_copies(conn, limit=limit)

    def usage(self, run: str | None = None) -> list[TierUsage]:
        """(9) Verified bytes and checkpoint counts per run per tier."""
        with self._tx(write=False) as conn:
            return _q.usage(conn, run_row(conn, run).id if run is not None else None)

    def stored_bytes(self, tier: int) -> int:
        """The data bytes ``tier`` holds, each content once on a tier that shares content
        (``core.storage.content.SHARED_TIERS``), of every live copy (being written, verified, being
        pruned, corrupt): what ``ckpt tiers`` counts; a budget counts the verified ones
        (``core.retention.stored_bytes``)."""
        with self._tx(write=False) as conn:
            return _q.stored_bytes(conn, shared=SHARED_TIERS).get(tier, 0)

    def referenced_contents(self, tier: int) -> set[tuple[int, str]]:
        """(size, CRC32C) of every content a replica on ``tier`` may reference (pending,
        copying, verified, pruning, corrupt): what a sweep of shared contents must keep."""
        with self._tx(write=False) as conn:
            return _q.referenced_contents(conn, tier)

    def unpromoted(self, *, older_than_seconds: float = 0, run: str | None = None,
                   limit: int | None = None) -> list[CheckpointInfo]:
        """(10) Committed checkpoints without a verified (or live copying) Tier 1 replica.
        A part whose Tier 1 copy was verified and later pruned counts as promoted."""
        with self._tx(write=False) as conn:
            run_id = run_row(conn, run).id if run is not None else None
            return _q.unpromoted(conn, now=_now(conn), older_than_seconds=older_than_seconds, run_id=run_id,
                                 limit=limit)

    # --- reconcile: set-based reads and sweep cursors -------------------------------------
    def promotion_status(self, pairs: Sequence[tuple[str, int, str]], *,
                         older_than_seconds: float = 0) -> dict[tuple[str, int, str], PromotionStatus]:
        """(run, step, attempt) -> ``PromotionStatus`` of each listed checkpoint the catalog knows (absent:
        unknown), in a few queries per 500 whatever the catalog holds. ``stale``: committed more
        than ``older_than_seconds`` ago (catalog clock) with a part not promoted (``unpromoted``)."""
        with self._tx(write=False) as conn:
            return _q.promotion_status(conn, pairs, now=_now(conn), older_than_seconds=older_than_seconds)

    def verified_page(self, tier: int, *, after_id: int = 0, limit: int = 1000,
                      node: str | None = None) -> list[StoredCopy]:
        """The next ``limit`` verified replicas on ``tier`` by id after ``after_id``, each with
        the files its tier must hold; ``node``: only that node's (or node-less) replicas."""
        with self._tx(write=False) as conn:
            return _q.verified_page(conn, _state.check_tier(tier), after_id=after_id, limit=limit, node=node)

    def milestone_backlog(self, policy: MilestonePolicy) -> list[CheckpointInfo]:
        """Milestones (by ``policy``) complete on Tier 1 with no complete copy on Tier 2."""
        with self._tx(write=False) as conn:
            return _q.milestone_backlog(conn, policy)

    def sweep_cursor(self, name: str) -> int:
        """Where the sweep ``name`` stopped (0: at the start)."""
        with self._tx(write=False) as conn:
            return conn.execute(select(cursors.c.position).where(cursors.c.name == name)).scalar() or 0

    def set_sweep_cursor(self, name: str, position: int) -> None:
        with self._tx() as conn:
            now = _now(conn)
            if not insert_ignore(conn, cursors, dict(name=name, position=position, updated_at=now), ["name"]):
                conn.execute(cursors.update().where(cursors.c.name == name).values(position=position, updated_at=now))


def _completion(checkpoint_id: int, tier: int) -> ColumnElement[bool]:
    return (completions.c.checkpoint_id == checkpoint_id) & (completions.c.tier == _state.check_tier(tier))


def _followups_free(now: datetime) -> ColumnElement[bool]:
    """A completion's follow-ups not recorded done and under no live lease (a lapsed one is free)."""
    lease = completions.c.followups_lease_until
    return completions.c.followups_done_at.is_(None) & (lease.is_(None) | (lease <= now))


@lru_cache(maxsize=1)
def _head() -> str:
    return head_revision()


def preload() -> None:
    """Read the migration scripts' revisions now (what the first schema check of a process
    reads, as text: db/migrate.py): a process that forks workers afterwards shares them."""
    _head()


# A schema at head once is at head for a while: every pipeline step opens a Catalog, and each
# check costs a transaction and Alembic's reading of the version table. Rechecked after
# SCHEMA_RECHECK_S, so a long-lived worker still refuses a catalog that a newer ckpt migrated
# past it; forgotten by ``upgrade`` of that URL in this process. Only a passed check is kept.
SCHEMA_RECHECK_S = 300.0
_schema_passed: dict[str, float] = {}  # normalized URL -> time.monotonic() of the last passed check


def _schema_passed_recently(url: str) -> bool:
    at = _schema_passed.get(normalize_url(url))
    return at is not None and time.monotonic() - at < SCHEMA_RECHECK_S


def forget_schema_checks() -> None:
    """The next ``Catalog`` of every URL checks its schema again (tests, benchmarks)."""
    _schema_passed.clear()


def _sqlite_foreign_keys_off(dbapi_conn: Any, _record: object) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=OFF")
    cur.close()


def upgrade(url: str) -> str:
    """Apply Alembic migrations up to head on the catalog at ``url``; return the revision.
    Creates the SQLite file (and its folder) if needed. Safe to run again."""
    _schema_passed.pop(normalize_url(url), None)
    engine = make_engine(url)
    if engine.dialect.name == "sqlite":
        # a migration may recreate a table others reference (SQLite's ALTER is a copy): foreign
        # keys are off while it runs (a PRAGMA outside the transaction) and checked before commit
        event.listen(engine, "connect", _sqlite_foreign_keys_off)
    try:
        for attempt in range(6):
            try:
                with transaction(engine) as conn:
                    if conn.dialect.name == "postgresql":  # two agents starting at once: one migrates, one waits
                        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(72717983)")
                    upgrade_connection(conn)
                    if conn.dialect.name == "sqlite" and conn.exec_driver_sql("PRAGMA foreign_key_check").first():
                        raise SchemaOutdated("the catalog's upgrade left rows whose foreign keys point nowhere")
                    rev = current_revision(conn)
                    if rev is None:  # never after an upgrade to head; narrows the type
                        where = make_url(url).render_as_string(hide_password=True)
                        raise SchemaOutdated(f"the catalog at {where} has no schema revision after the upgrade")
                    return rev
            except CatalogUnavailable:
                # SQLite: a fresh file's switch to WAL needs the file to itself and can answer
                # "database is locked" without waiting; the upgrade is idempotent, so try again
                if attempt == 5:
                    raise
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")
    finally:
        engine.dispose()
