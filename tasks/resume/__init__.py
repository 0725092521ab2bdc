"""resume: the one call a training node makes on start, the newest checkpoint it can load and a
local folder to load it from, taken from the cheapest good source of each part it needs.

Contract of ``resume``:
- The newest committed checkpoint of the run (never a retired or partial one) whose wanted
  parts (``part``, or every part) all have a good copy; ``None`` when the run has none yet.
- Sources, cheapest first (``plan_sources``): this node's own Tier 0 copy in place; the Tier 1
  folder in place when Tier 1 is a path mounted here; else a fetch (Tier 1, then Tier 2) into
  this node's Tier 0 under the layout, recorded there as a verified replica under a claim (the
  next resume then finds case 1), or into ``to`` (absent or empty; filled atomically).
- A fetch into a tier that is a folder here (Tier 0; Tier 1 rehydrated) is staged whole in a
  hidden folder beside the checkpoint's and renamed into place (``stages.staged``): killed
  midway, it leaves none of the part's files under their names; the next claim of the part
  removes what it left. (Into an object store: files, then the manifest as the commit marker.)
- The ranks of one node resuming at once (8 GPUs a node) take turns to fetch (``node_turn``: a
  ``flock`` under ``<data_dir>/resume/``): the first fetches, each of the others then finds its
  copy in place and fetches nothing; reading in place takes no turn and writes nothing. The
  kernel ends the turn of a rank that dies, so a rank killed mid-fetch holds up no other.
- A source on a tier whose root is not proven (``TierUnavailable``: a mount that is gone) is
  passed over unjudged and the next one tried; Tier 0 unproven, the fetch goes beside it. With
  no other source: ``StorageUnavailable``, never a fall-back to an older checkpoint.
- "Good" means the copy is verified in the catalog, its manifest still lists exactly the files
  the catalog registered, and every file has the registered size (``verify="full"``: and the
  registered CRC32C, read back now). A copy that fails is marked ``corrupt``/``missing`` and the
  next source is tried; a checkpoint with no good copy gives way to the previous one, said in
  ``ResumePoint.note``.
- A part brings only its own files plus the checkpoint-wide files its format needs to load
  (DCP ``.metadata``, the HF index), from whichever part holds them.
- A fetch from Tier 2 whose Tier 1 copy is gone first rehydrates Tier 1 as a claimed copy
  (``fetch.claimed_fetch``): of N nodes resuming at once one reads S3, the others
  wait for its claim and read Tier 1. A rehydration that fails for a storage reason (Tier 1
  full or unreachable) is "not rehydrated": a warning and ``ckpt.resume.rehydrate_failed``, and
  the part is fetched into this node's Tier 0 (or ``to``) as if Tier 1 were not configured.
- It records nothing but replicas: resuming a run is not a new run.
- A folder under ``<data_dir>/resume/<run>/`` (the fetch of a node whose part another node holds
  on Tier 0; no replica row) is scratch: once a resume of the run from step N succeeds, the
  run's folders of older steps there go (``tidy_resume_folders``): a node keeps the newest.

The package reads as the order of the strategies (``_resume_checkpoint``): ``plan`` (what is
wanted, the sources cheapest first), then each source, a module of its own: ``in_place``,
``hydrate`` (Tier 2 through a rehydrated Tier 1), ``tier0`` (fetched into this node's NVMe),
``folder`` (fetched into a folder); beside them ``check`` (is a copy still what was
registered), ``fetch`` (``tasks.copy``'s claimed copy, waited for while another worker holds
it) and ``stages`` (the stage a fetch into a folder tier lands in; the sweeps of dead ones).
"""

from __future__ import annotations

import time
from pathlib import Path

from core.errors import BadInput, ConflictError, NotFound, TierUnavailable, UnknownRun
from core.layout import checkpoint_dirname
from core.paths import safe_run_name
from core.settings import Settings
from core.tiers import ALL_TIERS, Tier
from db.catalog import Catalog
from db.entities import CheckpointInfo, FileInfo
from tasks.base import log, open_catalog
from tasks.replicas import TierStores
from tasks.restore import candidates
from tasks.resume.check import check_file
from tasks.resume.folder import fetch_to_folder, folder_filled, node_turn, resume_root, tidy_resume_folders
from tasks.resume.hydrate import hydrate
from tasks.resume.in_place import BringInTurn, read_in_place
from tasks.resume.plan import (
    FETCHED,
    IN_PLACE,
    HeldElsewhere,
    NoGoodCopy,
    PartResume,
    ResumePoint,
    Source,
    Verify,
    plan_sources,
    tier_in_place,
    wanted_files,
    wanted_parts,
    wide_files,
    with_moved,
)
from tasks.resume.stages import STAGE_AGE_S, sweep_dead_stages
from tasks.resume.tier0 import fetch_to_tier0, tier0_is_ours


def resume(settings: Settings, run: str, *, part: int | None = None, parts: int | None = None,
           to: str | Path | None = None, verify: Verify = "size", actor: str = "resume",
           attempt: str | None = None) -> ResumePoint | None:
    """The resume point of ``run`` for this node; see the module contract. ``attempt``: the
    launch that resumes (``core.attempt``), recorded with the step it resumes from, so that
    older attempts' checkpoints above it are superseded (``Catalog.record_resume``); None for a
    look that starts no training (nothing recorded)."""
    safe_run_name(run)
    if verify not in ("size", "full"):
        raise BadInput(f"verify must be 'size' or 'full', not {verify!r}")
    if part is not None and (part < 0 or (parts is not None and part >= parts)):
        raise BadInput(f"part {part} out of range: the job has {parts} part(s)")
    target = Path(to).expanduser().absolute() if to is not None else None
    if target is not None and (target.is_symlink() or (target.exists() and not target.is_dir())):
        raise ConflictError(f"{target} exists and is not a folder; choose another destination")
    notes: list[str] = []
    assert settings.catalog_url is not None  # resolved by Settings
    with open_catalog(settings.catalog_url) as cat, TierStores(settings) as stores:
        if target is not None:
            _outside_managed_folders(stores, run, target)
        try:
            cat.get_run(run)
        except UnknownRun:
            _record(cat, run, attempt, None, actor)
            return None

        newest: int | None = None
        for ck in candidates(cat, run, None, True):
            newest = ck.step if newest is None else newest
            wanted = wanted_parts(ck, part, parts)
            try:
                point = _resume_checkpoint(cat, stores, ck, wanted, target, verify, actor, notes)
            except NoGoodCopy as exc:
                notes.append(f"step {ck.step}: {exc}")
                log.warning("resume %s: step %d has no good copy (%s); trying the previous checkpoint",
                            run, ck.step, exc)
                continue
            if ck.step != newest:
                point = ResumePoint(point.run, point.step, point.path, point.parts,
                                    f"fell back from step {newest} to step {ck.step}: " + "; ".join(notes))
            log.info("resume %s from step %d at %s", run, ck.step, point.path)
            if target is None:
                tidy_resume_folders(settings, run, step=ck.step)
            _record(cat, run, attempt, ck.step, actor)
            return point
        if newest is None:
            _record(cat, run, attempt, None, actor)
    if newest is None:
        return None
    raise NotFound(f"{run}: no checkpoint has a good copy readable here ({'; '.join(notes)})")


def _record(cat: Catalog, run: str, attempt: str | None, step: int | None, actor: str) -> None:
    if attempt is None:
        return
    superseded = cat.record_resume(run, attempt, step, actor=actor)
    if superseded:
        log.warning("resume %s (attempt %s) from %s: older attempts' steps %s are superseded: they are never "
                    "offered again", run, attempt or "(unnamed)", "scratch" if step is None else f"step {step}",
                    ", ".join(map(str, superseded)))


def _resume_checkpoint(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int],
                       target: Path | None, verify: Verify, actor: str, notes: list[str]) -> ResumePoint:
    """Resume ``ck``: in place where every wanted part is good on one tier, else fetched."""
    files = wanted_files(cat, ck, wanted)
    wide = wide_files(files, wanted)
    if target is None:  # read where it lies, as every rank of the node may at once: nothing written
        try:
            for tier in (Tier.NODE, Tier.SHARED):
                found = read_in_place(cat, stores, ck, tier, wanted, wide, files, verify, actor, notes, bring=False)
                if found is not None:
                    return found
        except BringInTurn:  # this node's Tier 0 copy, once a wide file is brought in beside it
            pass
    with node_turn(stores.settings, ck.run, target) as waited:  # the node's ranks fetch one after the other
        return _fetched(cat, stores, ck, wanted, files, wide, target, verify, actor, notes, waited=waited)


def _fetched(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int], files: list[FileInfo],
             wide: list[FileInfo], target: Path | None, verify: Verify, actor: str, notes: list[str], *,
             waited: bool) -> ResumePoint:
    """``ck`` fetched where this node reads it, in this node's turn. What a sibling rank fetched
    in the turn this one ``waited`` for is found in place (Tier 0, the resume folder, ``to``)
    before anything is rehydrated."""
    settings = stores.settings
    if target is None:
        found = read_in_place(cat, stores, ck, Tier.NODE, wanted, wide, files, verify, actor, notes)
        if found is not None:
            return found
    dest = target or resume_root(settings, ck.run) / checkpoint_dirname(ck.step)
    if waited and (target is not None or not tier0_is_ours(cat, ck, wanted, settings.node)):
        found = folder_filled(cat, ck, wanted, files, wide, dest, verify)
        if found is not None:  # a sibling rank fetched it there in its turn: nothing to rehydrate
            return found
    started = time.monotonic()
    moved = {p: hydrate(cat, stores, ck, p, actor, notes) for p in wanted}
    if target is None and tier_in_place(stores, Tier.SHARED, ck):
        found = read_in_place(cat, stores, ck, Tier.SHARED, wanted, wide, files, verify, actor, notes)
        if found is not None:  # rehydrated Tier 1 is mounted here: load it where it is
            return with_moved(found, moved, started, 2)
    if target is None and tier0_is_ours(cat, ck, wanted, settings.node):
        try:
            return fetch_to_tier0(cat, stores, ck, wanted, files, wide, moved, verify, actor, notes)
        except HeldElsewhere as exc:  # lost the race for the Tier 0 row: fetched beside it instead
            log.info("resume %s/step-%d: %s; fetching beside this node's Tier 0", ck.run, ck.step, exc)
        except TierUnavailable as exc:
            if exc.tier != Tier.NODE:
                raise
            log.warning("resume %s/step-%d: %s; fetching beside it", ck.run, ck.step, exc)
            notes.append(f"step {ck.step}: tier 0 unreachable ({exc.reason}); fetched beside it")
    return fetch_to_folder(cat, stores, ck, wanted, files, wide, dest, moved, verify, actor, notes,
                           scratch=target is None)


def _outside_managed_folders(stores: TierStores, run: str, target: Path) -> None:
    """``ConflictError`` when ``to`` lies in a folder this system manages: a tier mounted here (a
    checkpoint copied there would look committed to that tier) or this node's resume folders
    (tidied by the next resume)."""
    managed = [(f"tier {t}", root.parent) for t in ALL_TIERS if stores.configured(t)
               and (root := stores.in_place(t, run)) is not None]
    managed.append(("this node's resume folders", resume_root(stores.settings, run).parent))
    where = target.resolve()
    for name, folder in managed:
        if where.is_relative_to(folder.resolve()):
            raise ConflictError(f"{target} is inside {name} ({folder}); resume into a folder of your own")


__all__ = ["FETCHED", "IN_PLACE", "STAGE_AGE_S", "PartResume", "ResumePoint", "Source", "Verify", "check_file",
           "plan_sources", "resume", "resume_root", "sweep_dead_stages", "tidy_resume_folders", "wide_files"]
