"""verify: read a part back on one tier and compare it with what the catalog registered.

On Tier 0 this is the gate of the whole pipeline: a part is trusted only once its source bytes
and format proved good (a promotion proves them in the copy's own read, ``tasks.copy.
promote_part``, with the same records and verdicts as here; this step reads Tier 0 alone).
A good Tier 0 part is recorded as a ``verified`` replica on its node,
so the catalog knows every copy (reconcile records parts it finds on Tier 1 the same way). A
bad one makes the replica ``corrupt`` with the file and the reason, announces
``ckpt.checkpoint.corrupt`` and raises ``CorruptCheckpoint``; nothing else changes. The
checkpoint itself is marked corrupt only while no other tier holds a verified copy: rot found
on Tier 0 during a re-promotion does not condemn the good copies on Tiers 1 and 2. On Tier 1/2
a bad copy makes that replica ``corrupt`` (a later promotion copies it again). Tier 2 is checked by the server's
full-object CRC32C (HeadObject), not by downloading it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from core import events, transfer
from core.errors import CkptError, CorruptCheckpoint, NotFound, PathEscape
from core.layout import checkpoint_prefix
from core.settings import Settings
from core.tiers import Tier
from db.catalog import Catalog
from db.entities import CKPT_CORRUPT, COPYING, CORRUPT, MISSING, PENDING, VERIFIED, CheckpointInfo, ReplicaInfo
from tasks.base import HopResult, copy_priority, log, open_catalog, open_tier, registered_manifest
from tasks.claim import ClaimedCopy
from tasks.retry import pipeline_task


def verify_replica(settings: Settings, run: str, step: int, part: int = 0, *,
                   tier: int = 0, node: str | None = None, actor: str = "cli", attempt: str | None = None) -> HopResult:
    """Recompute the part's checksums and check its format on ``tier``; record the verdict."""
    node = node or settings.node
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, tier) as store:
        ck = cat.get_checkpoint(run, step, attempt)
        prefix = checkpoint_prefix(run, step, ck.attempt)
        url = store.url_for(prefix)
        # claim before reading: a replica recorded verified from a read that a prune (or a
        # failed copy) overtook would list files that are gone
        held, _ = ClaimedCopy.take(cat, ck.id, tier, part, url, node=node if Tier(tier).node_local else None,
                                   actor=actor, what="verify", lease_s=settings.claim_lease_seconds,
                                   stall_s=settings.copy_stall_seconds)
        with held if held is not None else nullcontext():
            started = time.monotonic()
            try:
                manifest = registered_manifest(cat, store, ck.id, run, step, part, ck.parts, attempt=ck.attempt)
                transfer.verify_part(store, prefix, manifest, parallelism=settings.copy_parallelism,
                                     buffer_bytes=settings.io_buffer_bytes, deep=not Tier(tier).object_store,
                                     priority=copy_priority(settings))
            except (CorruptCheckpoint, PathEscape) as exc:  # a symlink out of the tier is as bad as a bit flip
                record_bad(cat, ck, tier, part, node, url, CORRUPT, exc, actor, held)
                events.announce(events.CORRUPT, run, step, part=part, parts=ck.parts, node=node,
                                extra_id=f"tier{tier}",
                                payload={"tier": tier, "file": getattr(exc, "path", None), "reason": str(exc)})
                raise
            except NotFound as exc:
                record_bad(cat, ck, tier, part, node, url, MISSING, exc, actor, held)
                raise
            seconds = time.monotonic() - started
            if held is not None:
                held.verified(bytes=manifest.total_bytes, reason=f"tier {tier} copy read back against its manifest")
        events.announce(events.VERIFIED, run, step, part=part, parts=ck.parts, node=node, extra_id=f"tier{tier}",
                        payload={"tier": tier, "bytes": manifest.total_bytes, "seconds": round(seconds, 3)})
        return HopResult(hop=f"verify tier {tier}", run=run, step=step, part=part,
                         files=len(manifest.files), bytes=manifest.total_bytes, seconds=seconds)


def part_replica(cat: Catalog, checkpoint_id: int, tier: int, part: int, node: str | None) -> ReplicaInfo | None:
    """The replica of one part on one tier (on Tier 0: the one on ``node``)."""
    for rep in cat.replicas(checkpoint_id, tier):
        if rep.part == part and (not Tier(tier).node_local or node is None or rep.node == node):
            return rep
    return None


def record_bad(cat: Catalog, ck: CheckpointInfo, tier: int, part: int, node: str, url: str, state: str,
                exc: Exception, actor: str, held: ClaimedCopy | None) -> None:
    """Mark the replica ``state`` (corrupt/missing). Corruption belongs to the replica: the
    checkpoint itself becomes corrupt only when a corrupt Tier 0 source leaves it with no
    verified copy anywhere (a fresh save that is bad from the start). Losing a race to another
    writer is not an error here: the verdict is already raised to the caller, and the catalog
    keeps whichever change won."""
    reason = str(exc)
    try:
        if Tier(tier).node_local and state == CORRUPT and not any(
                r.state == VERIFIED and Tier(r.tier).durable for r in cat.replicas(ck.id)):
            cat.set_checkpoint_state(ck.id, CKPT_CORRUPT, reason=reason, actor=actor)
        if held is not None:  # this verify holds the replica: record the verdict under it
            held.settle(state, reason)
            return
        rep = part_replica(cat, ck.id, tier, part, node)
        if rep is None and Tier(tier).node_local:
            claim = cat.claim_copy(ck.id, Tier.NODE, part, url, node=node, actor=actor)
            if claim.acquired:
                cat.transition(claim.replica.id, state, expected=COPYING, actor=actor,
                               claim_token=claim.replica.claim_token, reason=reason)
        elif rep is not None and rep.state in (PENDING, VERIFIED):  # never break a live copy
            cat.transition(rep.id, state, expected=rep.state, actor=actor, reason=reason)
    except CkptError as race:
        log.warning("could not record %s for %s/%s part %s on tier %s: %s",
                    state, ck.run, ck.step, part, tier, race)


verify_task = pipeline_task(verify_replica, name="verify")
