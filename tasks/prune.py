"""prune: delete one replica's files as the owner of a claimed, guarded prune.

``catalog.claim_prune`` decides, in one transaction, whether this copy may go by the rows
(another verified copy at least as durable exists; not the newest verified checkpoint of its
run; not pinned or aliased) and hands this worker the prune under a claim token and a lease,
renewed by ``tasks.claim.Lease`` while it works; a refusal raises ``PruneRefused``, a normal
outcome that retention reports. Then the evidence: the copies that justify the prune are
checked on their tiers (``tasks.evidence``); one that fails is marked ``missing``/``corrupt``
and does not count, and with none left the prune is abandoned and refused, nothing deleted.

The part's manifest (its commit marker) is deleted first, so a half-deleted part never looks
committed; then its files. The delete is fenced (``tasks.base.delete_part``): what goes is first
moved to a tombstone named for this claim's token, so a worker stopped mid-delete, taken over,
which then wakes, deletes only its own tombstone, never a copy published since. Only the owner
settles the prune: ``pruned`` when everything went, or abandoned, back to ``verified`` only
while the part is provably still whole on its tier (``missing``/``corrupt`` when it provably is
not; left ``pruning`` when that cannot be told).
A prune found ``pruning`` under a live lease belongs to another worker: refused, nothing done.
One whose lease lapsed (its worker died) is taken over and goes through the whole guard again,
rows and evidence, before anything is deleted (reconcile does this for every stuck prune).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core import events
from core.errors import CkptError, ConfigError, IllegalTransition, ObjectLocked, PruneRefused, StaleState
from core.layout import checkpoint_prefix, part_key
from core.settings import Settings
from core.tiers import Tier, readable_from
from db.entities import CKPT_RETIRED, PRUNED, PRUNING, VERIFIED, CheckpointInfo, PruneClaim, ReplicaInfo
from tasks.base import delete_part, log, open_catalog, open_tier
from tasks.claim import Lease, claim_token, prune_key, unrecorded
from tasks.evidence import check_part
from tasks.retry import pipeline_task

if TYPE_CHECKING:
    from core.storage.base import TierStore
    from db.catalog import Catalog


@dataclass(frozen=True)
class Pruned:
    replica_id: int
    run: str
    step: int
    tier: int
    part: int
    deleted: int  # objects deleted
    bytes: int | None
    by_another: bool = False  # another worker had pruned it already: nothing done here


def prune_replica(settings: Settings, replica_id: int, *, actor: str = "cli", reason: str | None = None) -> Pruned:
    """Guarded delete of one replica; raises ``PruneRefused`` when the guard says no (or
    another worker owns a live prune of it). A copy another worker has pruned already, found so
    when the claim is refused, is that worker's outcome: returned ``by_another``, nothing done
    (not an error: a retention run beside another is normal). A copy of a retired checkpoint
    needs no other copy to justify it: its retirement was recorded first (pins, aliases and
    Object Lock still refuse). The tier is opened, its root proven, before the claim: a tier
    that cannot be opened (a missing mount, a store down, one this node has no URL for) leaves
    the copy ``verified``, never ``pruning`` under a claim nobody renews until it lapses."""
    with open_catalog(settings.catalog_url) as cat:
        rep = cat.get_replica(replica_id)
        if not readable_from(rep.tier, rep.node, settings.node):
            raise ConfigError(f"replica {replica_id} is on node {rep.node!r}'s Tier 0; prune it there")
        with open_tier(settings, rep.tier) as store:
            try:
                with claim_token(*prune_key(cat, replica_id)) as token:
                    claim = cat.claim_prune(replica_id, actor=actor, reason=reason,
                                            lease_seconds=settings.claim_lease_seconds, token=token)
            except (StaleState, IllegalTransition) as exc:
                now = cat.get_replica(replica_id)
                if now.state == PRUNED:  # another worker's prune ended (it may have been live a moment ago)
                    log.info("replica %s: already pruned by another worker (%s)", replica_id, exc)
                    return Pruned(replica_id=now.id, run=now.run, step=now.step, tier=now.tier, part=now.part,
                                  deleted=0, bytes=now.bytes, by_another=True)
                if now.state == PRUNING:
                    raise PruneRefused(f"another worker owns the prune: {exc}") from exc
                raise
            rep = claim.replica
            ck = cat.get_checkpoint_by_id(rep.checkpoint_id)
            assert rep.claim_token is not None  # claim_prune hands the prune over under a token
            lease = Lease(cat, rep.id, rep.claim_token, settings.claim_lease_seconds).start()
            try:
                refused = (claim.refused or lock_refused(cat, store, ck, rep)
                           or (ck.state != CKPT_RETIRED and justification_refused(settings, cat, ck, rep, actor)))
                if refused:
                    abandon(cat, store, ck, rep, actor, why=f"prune refused: {refused}")
                    raise PruneRefused(refused)
                try:
                    deleted = _delete(cat, store, ck, rep, lease, actor, reason=reason, claim=claim)
                except ObjectLocked as exc:  # the store's retention outlived our look at it: kept
                    raise PruneRefused(f"kept: {exc}") from exc
                lease.stop()
                lease.check()
                try:
                    cat.transition(rep.id, PRUNED, expected=PRUNING, claim_token=rep.claim_token, actor=actor,
                                   reason=f"{reason or 'pruned'}: {deleted} object(s) deleted")
                except CkptError as exc:
                    unrecorded(prune_key(cat, rep.id), rep.claim_token, exc)
                    raise
            finally:
                lease.stop()
    events.announce(events.PRUNED, rep.run, rep.step, part=rep.part, parts=ck.parts, node=rep.node or "",
                    extra_id=f"tier{rep.tier}", payload={"tier": rep.tier, "bytes": rep.bytes, "url": rep.url})
    return Pruned(replica_id=rep.id, run=rep.run, step=rep.step, tier=rep.tier, part=rep.part,
                  deleted=deleted, bytes=rep.bytes)


def _delete(cat: Catalog, store: TierStore, ck: CheckpointInfo, rep: ReplicaInfo, lease: Lease, actor: str, *,
            reason: str | None, claim: PruneClaim) -> int:
    """The part's files, fenced under the claim (``tasks.base.delete_part``: the manifest first;
    on a file system everything is moved into the claim's tombstone before anything is
    deleted). A failure that left the part committed (its manifest in place) abandons the prune:
    nothing of ours went; a lost claim is not ours to settle."""
    assert rep.claim_token is not None
    try:
        return delete_part(cat, store, rep.run, rep.step, rep.part, ck.parts, reason=_why(reason, claim),
                           actor=actor, token=rep.claim_token, check=lease.check, attempt=rep.attempt)
    except StaleState:
        raise
    except ObjectLocked:  # the manifest went, a file is locked: settled by what is left
        lease.stop()
        abandon(cat, store, ck, rep, actor, why="prune abandoned: a file is under Object Lock")
        raise
    except BaseException:
        if _committed(store, part_key(rep.run, rep.step, rep.part, ck.parts)):
            lease.stop()
            abandon(cat, store, ck, rep, actor, why="prune abandoned: the part could not be uncommitted")
        raise


def _committed(store: TierStore, manifest_key: str) -> bool:
    """Whether the part's manifest is still in place; False when that cannot be told."""
    try:
        return store.stat(manifest_key) is not None
    except Exception:  # noqa: BLE001 - unknown: the prune stays pending, its lease lapses
        return False


def _why(reason: str | None, claim: PruneClaim) -> str:
    how = (" (a prune taken back after its claim's answer was lost)" if claim.reclaimed
           else " (a prune taken over after its lease lapsed)" if claim.took_over else "")
    return "prune" + how + (f": {reason}" if reason else "")


def lock_refused(cat: Catalog, store: TierStore, ck: CheckpointInfo, rep: ReplicaInfo) -> str | None:
    """Why the part cannot be deleted yet: an object of it under retention on its tier (S3 Object
    Lock), with the date after which a retention pass may prune it; None when nothing is locked.
    A store without retention (every tier but an Object Lock bucket) costs no catalog query here."""
    if not store.retains:
        return None
    keys = [part_key(rep.run, rep.step, rep.part, ck.parts, rep.attempt)]
    keys += [f"{checkpoint_prefix(rep.run, rep.step, rep.attempt)}/{f.path}" for f in cat.files(ck.id, rep.part)]
    until = store.locked_until(keys)
    if until is None:
        return None
    return (f"checkpoint {ck.run}/{ck.step} part {rep.part} is under Object Lock on tier {rep.tier} until "
            f"{until.isoformat()}: kept, a retention pass after that date prunes it")


def justification_refused(settings: Settings, cat: Catalog, ck: CheckpointInfo, rep: ReplicaInfo,
                          actor: str) -> str | None:
    """Check, on their tiers, the verified copies of this part that justify pruning ``rep``
    (a tier at least as durable), until one holds up; a copy found wanting is marked
    ``missing``/``corrupt`` (audited). The reason to refuse, or None when one holds up."""
    others = sorted((r for r in cat.replicas(ck.id) if r.part == rep.part and r.id != rep.id
                     and r.state == VERIFIED and Tier(r.tier).as_durable_as(rep.tier)),
                    key=lambda r: r.tier)
    # a stat check (sizes only) is trusted only while another durable-enough copy would remain
    # beside the one it checked; a prune that would leave one verified copy reads it back in full
    read_back = settings.prune_evidence == "read" or len(others) < 2
    for other in others:
        if not settings.tier_url(other.tier):
            continue
        try:
            with open_tier(settings, other.tier) as store:
                finding = check_part(cat, store, ck.id, ck.run, ck.step, other.part, ck.parts, read_back=read_back,
                                     attempt=ck.attempt)
        except CkptError as exc:
            log.warning("prune of replica %s: tier %s copy could not be checked: %s", rep.id, other.tier, exc)
            continue
        if finding is None:
            if read_back:
                cat.mark_checked(other.id, actor=actor)  # just read back in full: scrub may wait
            return None
        try:
            cat.transition(other.id, finding.state, expected=VERIFIED, actor=actor,
                           reason=f"found by a prune's evidence check: {finding.reason}")
        except CkptError as exc:
            log.info("replica %s: not marked %s: %s", other.id, finding.state, exc)
    return (f"checkpoint {ck.run}/{ck.step} part {rep.part}: no other copy on a tier at least as durable as "
            f"tier {rep.tier} holds up on its tier")


def abandon(cat: Catalog, store: TierStore, ck: CheckpointInfo, rep: ReplicaInfo, actor: str, *, why: str) -> None:
    """Settle an unfinished prune as its owner: ``verified`` while the part is provably whole on
    its tier, ``missing``/``corrupt`` when it provably is not; left ``pruning`` (its lease then
    lapses, and the next prune or reconcile takes it over) when that cannot be told."""
    try:
        finding = check_part(cat, store, ck.id, ck.run, ck.step, rep.part, ck.parts, attempt=ck.attempt)
    except Exception as exc:  # noqa: BLE001 - unknown counts as gone: never return a doubtful copy
        log.warning("replica %s: prune left pending, its copy could not be checked: %s", rep.id, exc)
        return
    to_state, detail = (VERIFIED, why) if finding is None else (finding.state, f"{why}; {finding.reason}")
    try:
        cat.transition(rep.id, to_state, expected=PRUNING, claim_token=rep.claim_token, actor=actor, reason=detail)
    except CkptError as exc:
        log.warning("replica %s: could not abandon the prune: %s", rep.id, exc)
        unrecorded(prune_key(cat, rep.id), rep.claim_token, exc)  # its retry takes it back, guard and all


prune_task = pipeline_task(prune_replica, name="prune")
