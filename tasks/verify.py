"""verify: read a part back on one tier and compare it with what the catalog registered.

On Tier 0 this is the gate of the whole pipeline: a part is copied only after its source bytes
and format proved good. A good Tier 0 part is recorded as a ``verified`` replica on its node,
so the catalog knows every copy (reconcile records parts it finds on Tier 1 the same way).
A bad one makes the replica (and, on Tier 0, the checkpoint)
``corrupt`` with the file and the reason, announces ``ckpt.checkpoint.corrupt`` and raises
``CorruptCheckpoint``; nothing else changes. On Tier 1/2 a bad copy makes that replica
``corrupt`` (a later promotion copies it again). Tier 2 is checked by the server's
full-object CRC32C (HeadObject), not by downloading it.
"""

from __future__ import annotations

import time
from typing import Any

from core import events
from core.errors import CkptError, CorruptCheckpoint, NotFound, PathEscape
from core.settings import Settings
from core.storage.base import checkpoint_prefix
from db.entities import CKPT_CORRUPT, COPYING, CORRUPT, MISSING, PENDING, VERIFIED, ReplicaInfo
from tasks.base import HopResult, Notify, log, no_notify, open_catalog, open_tier, registered_manifest
from tasks.retry import pipeline_task


def verify_replica(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                   tier: int = 0, node: str | None = None, actor: str = "cli",
                   notify: Notify = no_notify) -> HopResult:
    """Recompute the part's checksums and check its format on ``tier``; record the verdict."""
    from core.transfer import verify_part

    node = node or settings.node
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, tier) as store:
        ck = cat.get_checkpoint(run, step)
        prefix = checkpoint_prefix(run, step)
        url = store.url_for(prefix)
        # claim before reading: a replica recorded verified from a read that a prune (or a
        # failed copy) overtook would list files that are gone
        claim = cat.claim_copy(ck.id, tier, part, url, node=node if tier == 0 else None, actor=actor)
        claim = claim if claim.acquired else None
        started = time.monotonic()
        try:
            manifest = registered_manifest(cat, store, ck.id, run, step, part, ck.parts)
            verify_part(store, prefix, manifest, parallelism=settings.copy_parallelism,
                        buffer_bytes=settings.io_buffer_bytes, deep=tier < 2)
        except (CorruptCheckpoint, PathEscape) as exc:  # a symlink out of the tier is as bad as a bit flip
            _record_bad(cat, ck, tier, part, node, url, CORRUPT, exc, actor, claim)
            notify(events.CORRUPT, run, step, part=part, parts=ck.parts, node=node,
                   extra_id=f"tier{tier}",
                   payload={"tier": tier, "file": getattr(exc, "path", None), "reason": str(exc)})
            raise
        except NotFound as exc:
            _record_bad(cat, ck, tier, part, node, url, MISSING, exc, actor, claim)
            raise
        except BaseException as exc:  # transient: let the claim go so a retry can take it
            if claim is not None:
                _transition_claimed(cat, claim, MISSING, f"verify interrupted: {type(exc).__name__}: {exc}", actor)
            raise
        seconds = time.monotonic() - started
        if claim is not None:
            cat.transition(claim.replica.id, VERIFIED, expected=COPYING, actor=actor,
                           claim_token=claim.replica.claim_token, bytes=manifest.total_bytes,
                           reason=f"tier {tier} copy read back against its manifest")
        notify(events.VERIFIED, run, step, part=part, parts=ck.parts, node=node, extra_id=f"tier{tier}",
               payload={"tier": tier, "bytes": manifest.total_bytes, "seconds": round(seconds, 3)})
        return HopResult(hop=f"verify tier {tier}", run=run, step=step, part=part,
                         files=len(manifest.files), bytes=manifest.total_bytes, seconds=seconds)


def part_replica(cat: Any, checkpoint_id: int, tier: int, part: int, node: str | None) -> ReplicaInfo | None:
    """The replica of one part on one tier (on Tier 0: the one on ``node``)."""
    for rep in cat.replicas(checkpoint_id, tier):
        if rep.part == part and (tier != 0 or node is None or rep.node == node):
            return rep
    return None


def _transition_claimed(cat: Any, claim: Any, state: str, reason: str, actor: str) -> None:
    try:
        cat.transition(claim.replica.id, state, expected=COPYING, actor=actor,
                       claim_token=claim.replica.claim_token, reason=reason)
    except CkptError as lost:
        log.warning("replica %s: could not record %s: %s", claim.replica.id, state, lost)


def _record_bad(cat: Any, ck: Any, tier: int, part: int, node: str, url: str, state: str,
                exc: Exception, actor: str, claim: Any = None) -> None:
    """Mark the replica ``state`` (corrupt/missing); on Tier 0 a corrupt source marks the
    checkpoint corrupt too. Losing a race to another writer is not an error here: the verdict
    is already raised to the caller, and the catalog keeps whichever change won."""
    reason = str(exc)
    try:
        if tier == 0 and state == CORRUPT:
            cat.set_checkpoint_state(ck.id, CKPT_CORRUPT, reason=reason, actor=actor)
        if claim is not None:  # this verify holds the replica: record the verdict under it
            _transition_claimed(cat, claim, state, reason, actor)
            return
        rep = part_replica(cat, ck.id, tier, part, node)
        if rep is None and tier == 0:
            claim = cat.claim_copy(ck.id, 0, part, url, node=node, actor=actor)
            if claim.acquired:
                cat.transition(claim.replica.id, state, expected="copying", actor=actor,
                               claim_token=claim.replica.claim_token, reason=reason)
        elif rep is not None and rep.state in (PENDING, VERIFIED):  # never break a live copy
            cat.transition(rep.id, state, expected=rep.state, actor=actor, reason=reason)
    except CkptError as race:
        log.warning("could not record %s for %s/%s part %s on tier %s: %s",
                    state, ck.run, ck.step, part, tier, race)


verify_task = pipeline_task(verify_replica, name="verify")
