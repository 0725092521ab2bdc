"""copy_to_tier1 / upload_to_tier2: copy one part between tiers as a claimed copy.

The catalog's claim (``tasks.claim.ClaimedCopy``) makes the copy happen once however many
promotions race: the caller that acquires it copies; a caller that finds the replica
``verified`` returns a skipped hop; one that finds another live claim raises
``CopyInProgress`` (transient: a retry finds it done). ``core.transfer.copy_part`` stages,
reads back and publishes with the manifest last, so a replica becomes ``verified`` only
after its bytes were read back from the destination. A copy that fails publishes nothing and
leaves the replica ``missing`` (with the reason), which the next claim may take again; a copy
killed outright leaves a claim that lapses after one lease.
"""

from __future__ import annotations

from core import events
from core.errors import CopyInProgress
from core.layout import checkpoint_prefix
from core.progress import reporter
from core.settings import Settings
from db.entities import COPYING, CORRUPT, MISSING, VERIFIED
from tasks.base import HopResult, delete_part, open_catalog, open_tier, registered_manifest, sweep_staging
from tasks.claim import ClaimedCopy
from tasks.verify import part_replica


def copy_between_tiers(settings: Settings, run: str, step: int, part: int = 0, *,
                       src_tier: int, dst_tier: int, node: str | None = None, actor: str = "cli") -> HopResult:
    """Copy a registered part from ``src_tier`` to ``dst_tier`` and record it ``verified``."""
    from core.transfer import copy_part

    node = node or settings.node
    hop = f"tier {src_tier} -> tier {dst_tier}"
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, src_tier) as src, \
            open_tier(settings, dst_tier) as dst:
        ck = cat.get_checkpoint(run, step)
        prefix = checkpoint_prefix(run, step)
        url = dst.url_for(prefix)
        manifest = registered_manifest(cat, src, ck.id, run, step, part, ck.parts)
        prior = part_replica(cat, ck.id, dst_tier, part, None)
        held, rep = ClaimedCopy.take(cat, ck.id, dst_tier, part, url, node=node if dst_tier == 0 else None,
                                     actor=actor,
                                     lease_s=settings.claim_lease_seconds)
        if held is None:
            if rep.state == VERIFIED:
                return HopResult(hop=hop, run=run, step=step, part=part, files=len(manifest.files),
                                 bytes=manifest.total_bytes, seconds=0.0, skipped=True)
            raise CopyInProgress(f"{run}/{step} part {part}: another worker is copying it to "
                                 f"tier {dst_tier} (replica {rep.id}, {rep.state})")
        with held:
            if prior is not None and prior.state == CORRUPT:  # known-bad bytes: never resume on them
                delete_part(cat, dst, run, step, part, ck.parts, actor=actor,
                            reason=f"replica {prior.id} is corrupt; recopying from tier {src_tier}")
            elif prior is not None and prior.state in (COPYING, MISSING):
                # a copy of this part that died: its staging data is garbage. This part's own
                # files are ours alone under the claim just taken (swept now, not after a
                # wall-clock wait); paths another part also lists may be that part's live copy
                # (left a lease); other parts' files are never touched
                own = [f.path for f in manifest.files] + [manifest.name]
                shared = {f.path for f in cat.files(ck.id) if f.part != part}
                why = f"left by a copy that died (replica {prior.id} was {prior.state})"
                sweep_staging(cat, dst, run, step, older_than_s=0, actor=actor, reason=why,
                              keys=[f"{prefix}/{p}" for p in own if p not in shared])
                sweep_staging(cat, dst, run, step, older_than_s=held.lease_s, actor=actor, reason=why,
                              keys=[f"{prefix}/{p}" for p in own if p in shared])
            shown = reporter(f"{run}/{step} part {part}: {hop}", manifest.total_bytes)
            report = copy_part(src, prefix, dst, prefix, manifest, parallelism=settings.copy_parallelism,
                               progress=held.progress(shown))
            held.verified(bytes=report.bytes, seconds=report.seconds,
                          reason=f"copied from tier {src_tier} and read back")
    event = events.PROMOTED if dst_tier == 1 else events.VERIFIED
    events.announce(event, run, step, part=part, parts=ck.parts, node=node, extra_id=f"tier{dst_tier}",
                    payload={"tier": dst_tier, "bytes": report.bytes, "seconds": round(report.seconds, 3),
                             "url": url})
    return HopResult(hop=hop, run=run, step=step, part=part, files=report.files, bytes=report.bytes,
                     seconds=report.seconds, skipped=False)


def copy_to_tier1(settings: Settings, run: str, step: int, part: int = 0, *,
                  node: str | None = None, actor: str = "cli") -> HopResult:
    """Tier 0 (this node) -> Tier 1."""
    return copy_between_tiers(settings, run, step, part, src_tier=0, dst_tier=1, node=node, actor=actor)


def upload_to_tier2(settings: Settings, run: str, step: int, part: int = 0, *,
                    node: str | None = None, actor: str = "cli") -> HopResult:
    """Tier 1 -> Tier 2 (milestones; the archive flow decides)."""
    return copy_between_tiers(settings, run, step, part, src_tier=1, dst_tier=2, node=node, actor=actor)

