"""register: record a part that is committed on Tier 0 in the catalog, from its manifest.

Bad input never reaches the catalog as data: an unknown run, a missing or malformed
manifest, a path that escapes the checkpoint folder, an unknown format, or a manifest that
differs from the one already registered for that part is audited as a rejection, announced
(``ckpt.checkpoint.rejected``) and raised as a permanent error, leaving every earlier
checkpoint as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt import events
from ckpt.errors import BadInput, ConflictError, CorruptCheckpoint, NotFound
from ckpt.paths import safe_run_name
from ckpt.settings import Settings
from db.entities import VERIFIED
from tasks.base import Notify, no_notify, open_catalog, open_tier, read_manifest
from tasks.retry import pipeline_task


@dataclass(frozen=True)
class Registered:
    checkpoint_id: int
    run: str
    step: int
    part: int
    parts: int
    kind: str
    state: str  # checkpoint state after this part: 'partial' or 'committed'
    files: int
    bytes: int
    promoted: bool = False  # this part is already verified on Tier 1: nothing left to copy


def register_part(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                  node: str | None = None, actor: str = "cli", notify: Notify = no_notify,
                  source_tier: int = 0) -> Registered:
    """Read the part's manifest from ``source_tier`` (Tier 0; reconcile adopts parts found only
    on Tier 1) and register it; idempotent for the same manifest."""
    node = node or settings.node
    with open_catalog(settings.catalog_url) as cat:
        done = _already_promoted(cat, run, step, part)
        if done is not None:
            return done
        try:
            safe_run_name(run)
            if step < 0 or not (0 <= part < parts):
                raise BadInput(f"invalid step/part: step {step}, part {part} of {parts}")
            with open_tier(settings, source_tier) as store:
                manifest = read_manifest(store, run, step, part, parts)
            info = cat.register_part(manifest, actor=actor)
        except (BadInput, ConflictError, CorruptCheckpoint, NotFound) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            cat.record_rejection(f"checkpoint:{run}/{step}/part-{part}", reason, actor=actor,
                                 run=run if _plain_name(run) else None, step=step)
            notify(events.REJECTED, run, step, part=part, parts=parts, node=node,
                   payload={"reason": reason})
            raise
    return Registered(checkpoint_id=info.id, run=run, step=step, part=part, parts=info.parts,
                      kind=info.kind, state=info.state, files=len(manifest.files),
                      bytes=manifest.total_bytes)


def _already_promoted(cat, run: str, step: int, part: int) -> Registered | None:
    """The registration of a part already verified on Tier 1 (a repeated event): answered from
    the catalog, so a late duplicate works even after Tier 0 was pruned."""
    try:
        ck = cat.get_checkpoint(run, step)
    except NotFound:
        return None
    if not any(r.part == part and r.state == VERIFIED for r in cat.replicas(ck.id, 1)):
        return None
    files = cat.files(ck.id, part)
    return Registered(checkpoint_id=ck.id, run=run, step=step, part=part, parts=ck.parts, kind=ck.kind,
                      state=ck.state, files=len(files), bytes=sum(f.size for f in files), promoted=True)


def _plain_name(run: str) -> bool:
    try:
        safe_run_name(run)
        return True
    except BadInput:
        return False


register_task = pipeline_task(register_part, name="register")
