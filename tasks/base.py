"""What every pipeline step shares: opening the catalog and a tier, the part's manifest, results.

Steps are plain functions over plain values (``Settings``, run, step, part, tier, ids); they
open what they need and close it before returning, so a Prefect retry starts clean. What is
costly to open is shared per process underneath (the catalog's engine and schema check, an S3
client: see ``db.session`` and ``core.storage.s3``), so opening in every step stays cheap. They
announce facts with ``core.events.announce``; the flow that runs them decides where those go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from core.errors import BadInput, ConfigError, CorruptCheckpoint, PathEscape, StaleState
from core.formats import WIDE_FILES
from core.layout import checkpoint_prefix, manifest_name, part_key
from core.manifest import FileEntry, Manifest
from core.manifest_build import read_manifest
from core.paths import safe_run_name
from core.progress import uninterrupted
from core.settings import Settings
from core.storage import open_store
from core.storage.base import TierStore
from core.tiers import Tier
from core.transfer import WorkerPriority
from db.catalog import Catalog
from db.entities import CORRUPT, MISSING, PRUNED, ReplicaInfo
from tasks.tier_roots import prove_tier

log = logging.getLogger("ckpt.pipeline")

@contextmanager
def open_catalog(url: str) -> Iterator[Catalog]:
    """The catalog at ``url`` for the duration of one step; closed on the way out."""
    cat = Catalog(url)
    try:
        yield cat
    finally:
        cat.close()


def tier_store(settings: Settings, tier: int) -> TierStore:
    """The store of ``tier`` as configured, its root proven to be the one the catalog recorded
    (``tasks.tier_roots.prove_tier``: else ``TierUnavailable``, and nothing is judged, written
    or pruned on the strength of that tier). The one door through which the pipeline opens a
    tier; Tier 2 unset is a ``ConfigError``."""
    url = settings.tier_url(tier)
    if not url:
        raise ConfigError(f"tier {tier} is not configured (set CKPT_TIER{tier}_URL)")
    store = open_store(url, tier, settings)
    try:
        prove_tier(settings, store)
    except BaseException:
        store.close()
        raise
    return store


@contextmanager
def open_tier(settings: Settings, tier: int) -> Iterator[TierStore]:
    """``tier_store`` for one step, closed on the way out (S3 keeps a thread pool)."""
    with tier_store(settings, tier) as store:
        yield store


def read_part_manifest(store: TierStore, run: str, step: int, part: int, parts: int, *, attempt: str = "") -> Manifest:
    """The committed manifest of a part on ``store``; ``NotFound`` when the part is not committed.

    The manifest must name the same run, step, part and parts as its key, so a manifest copied
    under another checkpoint's name cannot be registered as that checkpoint.
    """
    manifest = read_manifest(store, checkpoint_prefix(run, step, attempt), part, parts)
    got = (manifest.run, manifest.step, manifest.part, manifest.parts, manifest.attempt)
    if got != (run, step, part, parts, attempt):
        raise CorruptCheckpoint(
            f"manifest at {store.url_for(part_key(run, step, part, parts, attempt))} describes {got}, "
            f"expected {(run, step, part, parts, attempt)}",
            path=manifest_name(part, parts),
        )
    return manifest


def catalog_digest(cat: Catalog, checkpoint_id: int, run: str, step: int, part: int, parts: int, *,
                   attempt: str = "") -> str:
    """The manifest digest of a part as the catalog registered it (the source of truth)."""
    return catalog_manifest(cat, checkpoint_id, run, step, part, parts, attempt=attempt).digest()


def catalog_manifest(cat: Catalog, checkpoint_id: int, run: str, step: int, part: int, parts: int, *,
                     attempt: str = "") -> Manifest:
    """A part's manifest as far as the catalog holds it: its files, sizes and checksums (no
    times, metrics or tags): enough to fetch and check the bytes while the tier's own manifest,
    the one to commit, is read (``copy_part``'s ``confirm``)."""
    files = cat.files(checkpoint_id, part)
    algorithm = files[0].algorithm if files else "crc32c"
    entries = tuple(FileEntry(path=f.path, size=f.size, checksum=f.checksum) for f in files)
    return Manifest(run=run, step=step, files=entries, algorithm=algorithm, part=part, parts=parts, attempt=attempt)


def registered_manifest(cat: Catalog, store: TierStore, checkpoint_id: int, run: str, step: int,
                        part: int, parts: int, *, attempt: str = "") -> Manifest:
    """The part's manifest on ``store``, proven to list exactly the files the catalog registered.

    A manifest that differs (edited, replaced) is ``CorruptCheckpoint``: bytes are always
    checked against what was registered, never against whatever a tier now claims.
    """
    manifest = read_part_manifest(store, run, step, part, parts, attempt=attempt)
    if manifest.digest() != catalog_digest(cat, checkpoint_id, run, step, part, parts, attempt=attempt):
        raise CorruptCheckpoint(
            f"manifest at {store.url_for(part_key(run, step, part, parts, attempt))} differs from the catalog",
            path=manifest_name(part, parts),
        )
    return manifest


def delete_part(cat: Catalog, store: TierStore, run: str, step: int, part: int, parts: int, *,
                reason: str, actor: str, token: str, check: Callable[[], None], attempt: str = "") -> int:
    """Uncommit (manifest first), then delete a part's files under the claim ``token``, whose
    ``check()`` raises ``StaleState`` once it is lost; returns objects deleted. The delete is
    fenced (``TierStore.bury``): what goes is first set aside under the token (on a file system
    moved into the claim's tombstone, a single-part checkpoint's folder in one rename), the claim
    checked once more (lost: what was moved is put back where its name is still free, and
    ``StaleState`` raised), then only that is deleted. So a worker stopped mid-delete and taken
    over, which then wakes, deletes nothing the new holder published; a tombstone it leaves is
    swept once its claim is over (``sweep_tombs``). A single-part checkpoint owns its folder; a
    part of several leaves the paths another part with a live copy on this tier still lists
    (``shared_paths``), takes the checkpoint-wide files of other parts a resume brought in beside
    it (``brought_in``), and removes the folder once nothing is left in it. The deletion is
    audited with ``reason`` before the first byte goes, so even a delete interrupted halfway is
    explained. It is never cut short for a stall (``core.progress.uninterrupted``)."""
    prefix = checkpoint_prefix(run, step, attempt)
    cat.record_deletion(f"files:{run}/{step}/part-{part}@tier{store.tier}", reason, actor=actor, run=run, step=step)
    with uninterrupted():
        doomed = None if parts == 1 else part_paths(cat, run, step, part, parts, store.tier, attempt=attempt)
        deleted = fenced_delete(store, prefix, doomed, token=token, check=check)
        if parts > 1:
            store.remove_empty(prefix)  # the last part of the checkpoint in this folder: no empty folder left
        return deleted


def fenced_delete(store: TierStore, prefix: str, paths: Sequence[str] | None, *, token: str,
                  check: Callable[[], None]) -> int:
    """Delete ``paths`` under ``prefix`` (None: all of it) as the claim ``token``: set aside
    (``TierStore.bury``) while the claim holds, the claim checked again (lost: put back what
    nobody took since, ``StaleState``), then only what was set aside deleted. The one way a claim
    deletes published files; run it inside ``core.progress.uninterrupted``."""
    check()
    tomb = store.bury(prefix, paths, token=token)
    try:
        check()
    except StaleState:
        store.exhume(tomb)
        raise
    return store.delete_tomb(tomb, check)


def part_paths(cat: Catalog, run: str, step: int, part: int, parts: int, tier: int, *,
               attempt: str = "") -> list[str]:
    """What deleting one part of several takes from its folder on ``tier``, the manifest first:
    its own paths no other live part there lists, and the checkpoint-wide files of other parts a
    resume brought in beside it."""
    ck = cat.get_checkpoint(run, step, attempt)
    keep = shared_paths(cat, ck.id, part, tier)
    own = [f.path for f in cat.files(ck.id, part) if f.path not in keep]
    return [manifest_name(part, parts), *own, *brought_in(cat, ck.id, part, tier)]


def sweep_tombs(cat: Catalog, store: TierStore, runs: Iterable[str], *, actor: str) -> int:
    """Remove the tombstones in ``runs``' folders whose claim is over (no replica holds its token
    any more: settled, or taken over), left by a worker that died or lost its claim mid-delete;
    audited when anything went; a folder whose name is not a run's (``lost+found``) holds none.
    Returns how many went."""
    removed = 0
    for run in runs:
        try:
            folder = safe_run_name(run)
        except (BadInput, PathEscape):
            continue
        swept = store.sweep_tombs(folder, cat.live_claim_tokens)
        if swept:
            cat.record_deletion(f"tombstones:{run}@tier{store.tier}", f"{swept} tombstone(s) of claims that are over",
                                actor=actor, run=run)
        removed += swept
    return removed


def sweep_staging(cat: Catalog, store: TierStore, run: str, step: int, *, older_than_s: float, reason: str,
                  actor: str, keys: Iterable[str] | None = None, attempt: str = "") -> int:
    """``store.sweep_staging`` under the checkpoint's folder (only ``keys``' staging data when
    given), audited when anything went."""
    swept = store.sweep_staging(checkpoint_prefix(run, step, attempt), older_than_s=older_than_s, keys=keys)
    if swept:
        cat.record_deletion(f"staging:{run}/{step}@tier{store.tier}", f"{swept} staging object(s): {reason}",
                            actor=actor, run=run, step=step)
    return swept


def live_beside(rows: Iterable[ReplicaInfo], part: int, tier: int) -> set[int]:
    """The other parts with a live copy in the same folder as ``part``'s on ``tier``: on Tier 0
    (node-local) only those on ``part``'s node; another node's NVMe shares no file with it."""
    rows = list(rows)
    node = next((r.node or None for r in rows if r.part == part), None)
    return {r.part for r in rows if r.part != part and r.state not in (PRUNED, CORRUPT, MISSING)
            and (not Tier(tier).node_local or (r.node or None) == node)}


def brought_in(cat: Catalog, checkpoint_id: int, part: int, tier: int) -> list[str]:
    """Checkpoint-wide files (``WIDE_FILES``) of other parts that may sit in this part's folder
    only because a resume brought them in beside it: those whose part has no live copy in the same
    place (on Tier 0: on this part's node). Only registered paths of the layout; ``store.delete``
    removes a link there itself, never what it points at."""
    live = live_beside(cat.replicas(checkpoint_id, tier), part, tier)
    files = cat.files(checkpoint_id)
    mine = {f.path for f in files if f.part == part}
    return sorted({f.path for f in files if f.path in WIDE_FILES and f.part != part and f.part not in live
                   and f.path not in mine})


def shared_paths(cat: Catalog, checkpoint_id: int, part: int, tier: int) -> set[str]:
    """Paths this part shares with another part that still has a live replica on ``tier``
    (parts of one checkpoint sit side by side in one folder; two nodes may both list e.g.
    ``config.json``): deleting this part must leave them for the other."""
    live = live_beside(cat.replicas(checkpoint_id, tier), part, tier)
    if not live:
        return set()
    mine = {f.path for f in cat.files(checkpoint_id, part)}
    return {f.path for p in live for f in cat.files(checkpoint_id, p) if f.path in mine}


def copy_priority(settings: Settings) -> WorkerPriority:
    """The priority the agent's background copy and verify threads run at (``copy_nice``,
    ``copy_io_class``): below a training job sharing the node."""
    return WorkerPriority(nice=settings.copy_nice, io_class=settings.copy_io_class)


@dataclass(frozen=True)
class HopResult:
    """One hop of one part (verify on a tier, or a copy between tiers), for the artifact."""

    hop: str  # e.g. 'verify tier 0', 'tier 0 -> tier 1'
    run: str
    step: int
    part: int
    files: int
    bytes: int
    seconds: float
    skipped: bool = False  # nothing to do: already verified there

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {
            "hop": self.hop,
            "part": self.part,
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "MB/s": round(self.mb_per_s, 1),
            "skipped": self.skipped,
        }
