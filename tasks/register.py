"""register: record a part that is committed on Tier 0 in the catalog, from its manifest.

A run seen for the first time is created from the manifest (its origin, the manifest's parent
in another run, recorded pending if the catalog does not know it yet): only a malformed run
name is refused. Bad input never reaches the catalog as data: a malformed run name, a missing or malformed
manifest, a path that escapes the checkpoint folder, an unknown format, a manifest that
differs from the one already registered for that part, or a part that lists a file another
part of the checkpoint lists with other bytes is audited as a rejection, announced
(``ckpt.checkpoint.rejected``) and raised as a permanent error, leaving every earlier
checkpoint as it was. A refused part is recorded in the catalog's rejections against its
manifest's digest, once: the same manifest again (a duplicate event, a reconcile pass) is
refused with ``AlreadyRejected`` without a new audit row or event; a re-save is judged afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from core import events
from core.errors import (
    AlreadyRejected,
    BadEvent,
    BadInput,
    ConflictError,
    CorruptCheckpoint,
    LineageCycle,
    NotFound,
    UnknownRun,
    quoted,
)
from core.layout import MAX_STEP, check_attempt, check_ref, checkpoint_prefix, parse_ref
from core.manifest import Manifest
from core.manifest_build import read_attempt_digest
from core.paths import safe_run_name
from core.settings import Settings
from db.catalog import Catalog
from db.entities import CKPT_RETIRED, VERIFIED
from tasks.base import open_catalog, open_tier, read_part_manifest
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


def register_stored_part(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                         node: str | None = None, actor: str = "cli",
                         source_tier: int = 0, attempt: str = "") -> Registered:
    """Read the part's manifest from ``source_tier`` (Tier 0; reconcile adopts parts found only
    on Tier 1) and register it; idempotent for the same manifest (its digest). A manifest whose
    digest differs from the one registered for the part is a ``ConflictError`` (refused, audited,
    announced), whether or not the first is on Tier 1 yet; a manifest refused before is
    ``AlreadyRejected`` without a new audit row or event; with no manifest left on the source a
    part already verified on Tier 1 is answered from the catalog."""
    node = node or settings.node
    with open_catalog(settings.catalog_url) as cat:
        digest = None
        try:
            safe_run_name(run)
            check_ref(step, part, parts)
            check_attempt(attempt)
            with open_tier(settings, source_tier) as store:
                digest = read_attempt_digest(store, checkpoint_prefix(run, step, attempt), part, parts)
                _refuse_if_rejected_before(cat, run, step, part, digest)
                manifest = read_part_manifest(store, run, step, part, parts, attempt=attempt)
            _ensure_run(cat, manifest, actor=actor)
            info = cat.register_part(manifest, actor=actor)  # the content check: same digest or ConflictError
        except AlreadyRejected:
            raise
        except NotFound as exc:
            done = _already_promoted(cat, run, step, part, attempt)
            if done is not None:  # no manifest left: a late duplicate after Tier 0 was pruned
                return done
            _refuse(cat, exc, digest, run=run, step=step, part=part, parts=parts, node=node, actor=actor)
        except (BadInput, ConflictError, CorruptCheckpoint, LineageCycle) as exc:
            _refuse(cat, exc, digest, run=run, step=step, part=part, parts=parts, node=node, actor=actor)
        done = _already_promoted(cat, run, step, part, attempt)
        if done is not None:
            return done
    return Registered(checkpoint_id=info.id, run=run, step=step, part=part, parts=info.parts,
                      kind=info.kind, state=info.state, files=len(manifest.files),
                      bytes=manifest.total_bytes)


def _ensure_run(cat: Catalog, manifest: Manifest, *, actor: str) -> None:
    """A run seen for the first time is created (audited ``create-run``): any documented way
    of announcing a checkpoint works without registering the run first. Its origin comes from
    the manifest (``Catalog.register_part``)."""
    try:
        cat.get_run(manifest.run)
    except UnknownRun:
        cat.ensure_run(manifest.run, actor=actor)


def _refuse_if_rejected_before(cat: Catalog, run: str, step: int, part: int, digest: str) -> None:
    prior = cat.rejection(run, step, part, digest)
    if prior is not None:
        raise AlreadyRejected(f"checkpoint {run}/{step} part {part}: this manifest was rejected at "
                              f"{prior.rejected_at.isoformat()} ({prior.reason}); save the part again to retry")


def _refuse(cat: Catalog, exc: Exception, digest: str | None, *, run: str, step: int, part: int, parts: int,
            node: str, actor: str) -> NoReturn:
    """Record the refusal of a part (once per manifest: ``reject_part``; an unknown run or a
    missing manifest only in the audit), announce ``ckpt.checkpoint.rejected``, re-raise."""
    reason = f"{type(exc).__name__}: {exc}"
    if digest is None or isinstance(exc, NotFound):  # no part to name, or a run yet to be created
        _reject(cat, f"checkpoint:{run}/{step}/part-{part}", exc, actor=actor, run=run, step=step)
    elif not cat.reject_part(run, step, part, digest=digest, reason=reason, node=node, actor=actor):
        raise exc  # recorded meanwhile by a concurrent attempt: announced there
    events.announce(events.REJECTED, run, step, part=part, parts=parts, node=node, payload={"reason": reason})
    raise exc


def _already_promoted(cat: Catalog, run: str, step: int, part: int, attempt: str) -> Registered | None:
    """The registration of a part already verified on Tier 1 (a repeated event), answered from
    the catalog. Called only once the part's manifest matched the registered digest, or when no
    manifest is left on the source (a late duplicate after Tier 0 was pruned): a different
    checkpoint saved under the same run and step is never answered "already promoted". A late
    event for a retired checkpoint is answered so too: nothing is copied back."""
    try:
        ck = cat.get_checkpoint(run, step, attempt)
    except NotFound:
        return None
    if ck.state != CKPT_RETIRED and not any(r.part == part and r.state == VERIFIED for r in cat.replicas(ck.id, 1)):
        return None  # a retired checkpoint is never promoted again: its copies are going
    files = cat.files(ck.id, part)
    return Registered(checkpoint_id=ck.id, run=run, step=step, part=part, parts=ck.parts, kind=ck.kind,
                      state=ck.state, files=len(files), bytes=sum(f.size for f in files), promoted=True)


def checkpoint_args(run: Any, step: Any, part: Any = 0, parts: Any = 1) -> tuple[str, int, int, int]:
    """Typed (run, step, part, parts) from values as an event delivers them (trigger templates
    render strings); ``BadEvent`` saying what is wrong otherwise."""
    try:
        return (safe_run_name(str(run)), *parse_ref(step, part, parts))
    except BadInput as exc:
        raise BadEvent(f"malformed checkpoint reference run={quoted(run)} step={quoted(step)} part={quoted(part)} "
                       f"parts={quoted(parts)}: {exc}") from None


def attempt_arg(attempt: Any) -> str:
    """The attempt an event or a flow parameter names ('' or absent: the unnamed attempt);
    ``BadEvent`` for one that is not an attempt name."""
    try:
        return check_attempt("" if attempt is None else str(attempt))
    except BadInput as exc:
        raise BadEvent(f"malformed checkpoint reference: {exc}") from None


def reject_event(settings: Settings, what: str, exc: Exception, *, actor: str = "cli", source: str = "event") -> None:
    """Audit a malformed request (``what`` names it; ``source``: ``event`` or ``cli``) as a
    rejection in the catalog."""
    with open_catalog(settings.catalog_url) as cat:
        _reject(cat, f"{source}:{what}", exc, actor=actor, run=None, step=None)


def _reject(cat: Catalog, subject: str, exc: Exception, *, actor: str, run: str | None, step: Any) -> None:
    step = step if isinstance(step, int) and 0 <= step <= MAX_STEP else None  # the audit row holds a BIGINT
    cat.record_rejection(subject, f"{type(exc).__name__}: {exc}", actor=actor,
                         run=run if run is not None and _plain_name(run) else None, step=step)


def _plain_name(run: str) -> bool:
    try:
        safe_run_name(run)
        return True
    except BadInput:
        return False


register_stored_part_task = pipeline_task(register_stored_part, name="register")
