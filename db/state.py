"""The replica state machine: claims, compare-and-set transitions and the guarded prune.

Each function runs inside the caller's transaction (``db.session.transaction``) and locks what
it decides on: ``SELECT ... FOR UPDATE`` on PostgreSQL, the database write lock taken by
``BEGIN IMMEDIATE`` on SQLite. The final UPDATE is also guarded by ``WHERE state = <the state
read>`` and checked by rowcount, so a caller that lost a race gets ``StaleState``, never a
silent double win.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.engine import Connection, Row

from core.errors import BadInput, IllegalTransition, PruneRefused, StaleState
from core.tiers import Tier
from db.entities import CKPT_RETIRED, COPYING, MISSING, PENDING, PRUNING, TRANSITIONS, VERIFIED, Claim, PruneClaim
from db.queries import newest_verified_steps
from db.rows import (
    add_audit,
    aliases,
    checkpoint_row_by_id,
    checkpoints,
    insert_ignore,
    pins,
    replica_row,
    replica_select,
    replicas,
    tier_bit,
    to_replica,
)


def check_tier(tier: int) -> int:
    try:
        return Tier(tier)
    except ValueError:
        raise BadInput(f"unknown tier {tier!r}; expected one of {[int(t) for t in Tier]}") from None


def refresh_verified_tiers(conn: Connection, checkpoint_id: int, parts: int) -> None:
    """Recompute ``checkpoints.verified_tiers`` (bit t: every part verified on tier t)."""
    counts = conn.execute(select(replicas.c.tier, func.count())
                          .where(replicas.c.checkpoint_id == checkpoint_id, replicas.c.state == VERIFIED)
                          .group_by(replicas.c.tier)).all()
    mask = sum(tier_bit(t) for t, n in counts if n >= parts)
    conn.execute(update(checkpoints).where(checkpoints.c.id == checkpoint_id).values(verified_tiers=mask))


def move(conn: Connection, rep: Row, to_state: str, *, now: datetime, actor: str, reason: str | None,
         parts: int, values: dict | None = None) -> None:
    """CAS ``rep.state -> to_state`` (legality already checked), audited, mask kept in step."""
    vals = dict(values or {}, state=to_state, updated_at=now)
    if to_state == VERIFIED:
        vals["verified_at"] = now
        if rep.state == COPYING:  # a fresh copy was just read back (an abandoned prune was not)
            vals["checked_at"] = now
    if rep.state in (COPYING, PRUNING) and to_state != rep.state:  # a claimed operation settles
        vals.update(claim_token=None, lease_expires_at=None)
    done = conn.execute(update(replicas).where(replicas.c.id == rep.id, replicas.c.state == rep.state)
                        .values(**vals)).rowcount
    if done != 1:
        raise StaleState(f"replica {rep.id} changed state under us (was {rep.state!r})")
    if VERIFIED in (rep.state, to_state):
        refresh_verified_tiers(conn, rep.checkpoint_id, parts)
    where = f"tier {rep.tier} part {rep.part}"
    add_audit(conn, at=now, actor=actor, subject=f"replica:{rep.id}", action="transition",
              from_state=rep.state, to_state=to_state, reason=f"{where}: {reason}" if reason else where,
              run=rep.run_name, step=rep.step)


def check_legal(rep: Row, to_state: str) -> None:
    if to_state not in TRANSITIONS:
        raise BadInput(f"unknown replica state {to_state!r}")
    if to_state not in TRANSITIONS[rep.state]:
        raise IllegalTransition(f"replica {rep.id} ({rep.run_name}/{rep.step} tier {rep.tier} part {rep.part}) "
                                f"cannot move {rep.state} -> {to_state}; "
                                f"legal: {sorted(TRANSITIONS[rep.state]) or 'none'}")


def transition(conn: Connection, replica_id: int, to_state: str, *, expected: str | Sequence[str] | None,
               claim_token: str | None, now: datetime, actor: str, reason: str | None, values: dict,
               seen_updated_at: datetime | None = None) -> Row:
    # Lock order, everywhere: checkpoint row, then replica rows. The checkpoint lock also
    # serialises concurrent verifications of a checkpoint's parts, so the last one counts the
    # others' (committed) replicas when it recomputes verified_tiers.
    ckpt = checkpoint_row_by_id(conn, replica_row(conn, replica_id).checkpoint_id, lock=True)
    rep = replica_row(conn, replica_id, lock=True)
    if expected is not None:
        allowed = (expected,) if isinstance(expected, str) else tuple(expected)
        if rep.state not in allowed:
            raise StaleState(f"replica {replica_id} is {rep.state!r}, expected {' or '.join(allowed)}")
    if claim_token is not None and rep.claim_token != claim_token:
        raise StaleState(f"replica {replica_id}: claim {claim_token} is not the live claim")
    if seen_updated_at is not None and rep.updated_at != seen_updated_at:
        # every state change stamps updated_at: the row the caller judged is not this one
        # (e.g. a copy re-verified by another worker since), so its verdict does not apply
        raise StaleState(f"replica {replica_id} changed since it was read ({rep.state!r} since {rep.updated_at})")
    check_legal(rep, to_state)
    if rep.state == PRUNING and rep.claim_token is not None and claim_token != rep.claim_token:
        # a prune is finished (pruned) or abandoned (verified, missing) by its owner only;
        # a stalled one is taken over through ``claim_prune``, never settled from outside
        raise StaleState(f"replica {replica_id} is being pruned under another claim")
    if to_state == PRUNING:  # the guard is the catalog's rule, whichever door the caller used
        claim = claim_prune(conn, replica_id, now=now, actor=actor, reason=reason, lease_seconds=600)
        if claim.refused:
            raise PruneRefused(claim.refused)
        return replica_row(conn, replica_id)
    move(conn, rep, to_state, now=now, actor=actor, reason=reason, parts=ckpt.parts, values=values)
    return replica_row(conn, replica_id)


def claim_copy(conn: Connection, checkpoint_id: int, tier: int, part: int, url: str, *, node: str | None,
               now: datetime, actor: str, lease_seconds: float, token: str | None = None) -> Claim:
    ckpt = checkpoint_row_by_id(conn, checkpoint_id)
    check_tier(tier)
    if not 0 <= part < ckpt.parts:
        raise BadInput(f"part {part} out of range: checkpoint {ckpt.run_name}/{ckpt.step} has {ckpt.parts} part(s)")
    insert_ignore(conn, replicas, dict(checkpoint_id=checkpoint_id, tier=tier, part=part, node=node, url=url,
                                       state=PENDING, created_at=now, updated_at=now),
                  ["checkpoint_id", "tier", "part"])
    rid = conn.execute(select(replicas.c.id).where(replicas.c.checkpoint_id == checkpoint_id,
                                                   replicas.c.tier == tier, replicas.c.part == part)).scalar_one()
    rep = replica_row(conn, rid, lock=True)
    if token is not None and rep.state == COPYING and rep.claim_token == token:
        return _reclaim(conn, rep, node=node, url=url, now=now, actor=actor, lease_seconds=lease_seconds)
    live_claim = rep.state == COPYING and rep.lease_expires_at is not None and rep.lease_expires_at > now
    if rep.state in (VERIFIED, PRUNING) or live_claim:
        return Claim(replica=to_replica(rep), acquired=False)
    token = token or uuid.uuid4().hex
    why = "stale claim taken over" if rep.state == COPYING else "copy claimed"
    move(conn, rep, COPYING, now=now, actor=actor, reason=why, parts=ckpt.parts,
         values=dict(claim_token=token, lease_seconds=lease_seconds, node=node, url=url,
                     lease_expires_at=now + timedelta(seconds=lease_seconds)))
    return Claim(replica=to_replica(replica_row(conn, rid)), acquired=True)


RECLAIMED = "claim taken back by the caller that made it (its answer was lost)"


def _reclaim(conn: Connection, rep: Row, *, node: str | None, url: str, now: datetime, actor: str,
             lease_seconds: float) -> Claim:
    """The claim under ``rep.claim_token`` given back to the caller that chose that token: its
    earlier claim committed, but the answer was lost (the connection dropped after the commit),
    so nobody holds it. Its lease starts again; audited."""
    conn.execute(update(replicas).where(replicas.c.id == rep.id, replicas.c.state == COPYING,
                                        replicas.c.claim_token == rep.claim_token)
                 .values(node=node, url=url, lease_seconds=lease_seconds, updated_at=now,
                         lease_expires_at=now + timedelta(seconds=lease_seconds)))
    add_audit(conn, at=now, actor=actor, subject=f"replica:{rep.id}", action="reclaim", from_state=COPYING,
              to_state=COPYING, run=rep.run_name, step=rep.step,
              reason=f"tier {rep.tier} part {rep.part}: {RECLAIMED}")
    return Claim(replica=to_replica(replica_row(conn, rep.id)), acquired=True)


def heartbeat(conn: Connection, replica_id: int, claim_token: str, *, now: datetime) -> None:
    rep = replica_row(conn, replica_id, lock=True)
    if rep.state not in (COPYING, PRUNING) or rep.claim_token != claim_token:
        raise StaleState(f"replica {replica_id}: the claim was lost (state {rep.state!r})")
    conn.execute(update(replicas).where(replicas.c.id == replica_id).values(
        lease_expires_at=now + timedelta(seconds=rep.lease_seconds or 600), updated_at=now))


def lease_live(rep: Row, now: datetime) -> bool:
    return rep.lease_expires_at is not None and rep.lease_expires_at > now


def claim_prune(conn: Connection, replica_id: int, *, now: datetime, actor: str, reason: str | None,
                lease_seconds: float, token: str | None = None) -> PruneClaim:
    """Take the prune of a replica under a fresh claim token (or ``token``) and lease (see
    ``Catalog.claim_prune``).

    ``verified -> pruning`` only if the guard allows (else ``PruneRefused``, nothing changed).
    A ``pruning`` replica under a live lease is another worker's: ``StaleState``. One whose
    lease lapsed (its worker died) is taken over whatever the guard says now, with the guard's
    verdict in ``refused``: the new owner must then abandon it, never finish it. One under
    ``token`` itself, live or lapsed, is given back the same way (``reclaimed``): its caller's
    earlier answer was lost. Locks the checkpoint row first, then every replica of the same
    part, in id order, so concurrent prunes and pins serialise on the checkpoint instead of
    deadlocking."""
    peek = replica_row(conn, replica_id)
    ckpt = checkpoint_row_by_id(conn, peek.checkpoint_id, lock=True)
    same_part = conn.execute(
        select(replicas.c.id, replicas.c.tier, replicas.c.state)
        .where(replicas.c.checkpoint_id == peek.checkpoint_id, replicas.c.part == peek.part)
        .order_by(replicas.c.id).with_for_update()).all()
    rep = replica_row(conn, replica_id)
    took_over = rep.state == PRUNING
    reclaimed = took_over and token is not None and rep.claim_token == token
    if took_over and lease_live(rep, now) and not reclaimed:
        raise StaleState(f"replica {replica_id} is already being pruned (claim live until {rep.lease_expires_at})")
    if not took_over:
        check_legal(rep, PRUNING)
    refused = prune_refusal(conn, ckpt, rep, same_part)
    if refused and not took_over:
        raise PruneRefused(refused)
    token = token or uuid.uuid4().hex
    lease = dict(claim_token=token, lease_seconds=lease_seconds,
                 lease_expires_at=now + timedelta(seconds=lease_seconds))
    if took_over:
        done = conn.execute(update(replicas).where(replicas.c.id == rep.id, replicas.c.state == PRUNING,
                                                   _same_token(rep.claim_token))
                            .values(updated_at=now, **lease)).rowcount
        if done != 1:
            raise StaleState(f"replica {rep.id} changed under us while taking over its prune")
        why = RECLAIMED if reclaimed else "stalled prune taken over (lease lapsed)"
        add_audit(conn, at=now, actor=actor, subject=f"replica:{rep.id}", action="reclaim" if reclaimed else "takeover",
                  from_state=PRUNING, to_state=PRUNING, run=rep.run_name, step=rep.step,
                  reason=f"tier {rep.tier} part {rep.part}: {why}")
    else:
        move(conn, rep, PRUNING, now=now, actor=actor, reason=reason, parts=ckpt.parts, values=lease)
    return PruneClaim(replica=to_replica(replica_row(conn, replica_id)), took_over=took_over, refused=refused,
                      reclaimed=reclaimed)


def prune_refusal(conn: Connection, ckpt: Row, rep: Row, same_part: Sequence[Row]) -> str | None:
    """Why the catalog's rows forbid pruning ``rep`` (None: they allow it)."""
    name = f"{ckpt.run_name}/{ckpt.step}"
    if conn.execute(select(pins.c.checkpoint_id).where(pins.c.checkpoint_id == ckpt.id)).first():
        return f"checkpoint {name} is pinned"
    alias = conn.execute(select(aliases.c.name).where(aliases.c.checkpoint_id == ckpt.id)).scalar()
    if alias is not None:
        return f"checkpoint {name} is aliased as {alias!r}"
    if ckpt.state == CKPT_RETIRED:  # its retirement was recorded first: no copy is to be kept
        return None
    if newest_verified_steps(conn, [ckpt.run_id]).get(ckpt.run_id) == ckpt.step:
        return f"checkpoint {name} is the newest verified checkpoint of its run"
    others = [r for r in same_part if r.id != rep.id and r.state == VERIFIED
              and Tier(r.tier).as_durable_as(rep.tier)]
    if not others:
        return (f"checkpoint {name} part {rep.part}: no other verified copy on a tier at least "
                f"as durable as tier {rep.tier}")
    return None


def expire_copy_claim(conn: Connection, replica_id: int, *, now: datetime, actor: str) -> bool:
    """``copying`` past its lease (its worker died mid-copy or mid-verify) -> ``missing``, so
    promotion and retention can act on it again. False (nothing done) when the replica is not
    ``copying`` or its lease is still live: idempotent."""
    ckpt = checkpoint_row_by_id(conn, replica_row(conn, replica_id).checkpoint_id, lock=True)
    rep = replica_row(conn, replica_id, lock=True)
    if rep.state != COPYING or lease_live(rep, now):
        return False
    move(conn, rep, MISSING, now=now, actor=actor, parts=ckpt.parts,
         reason=f"claim lapsed at {rep.lease_expires_at}: its worker is gone, nothing it wrote is trusted")
    return True


def expired_claims(conn: Connection, *, now: datetime) -> Sequence[Row]:
    """Replicas held ``copying`` or ``pruning`` whose lease lapsed (or that never had one)."""
    return conn.execute(replica_select().where(
        replicas.c.state.in_([COPYING, PRUNING]),
        or_(replicas.c.lease_expires_at.is_(None), replicas.c.lease_expires_at <= now))
        .order_by(replicas.c.id)).all()


def _same_token(token: str | None) -> ColumnElement[bool]:
    return replicas.c.claim_token.is_(None) if token is None else replicas.c.claim_token == token
