"""``ckpt watch DIR --run RUN``: announce checkpoints written by a job that cannot import the
client (a framework's own ``save``, a shell script).

Each sub-folder of DIR whose name ends in a number (``step-100``, ``checkpoint-100``,
``global_step100``) is a candidate checkpoint of that step. It is complete when:
- it holds a marker file (``--marker``, default ``COMMITTED``) — the job's explicit word; or
- it is a PyTorch DCP folder with ``.metadata`` (DCP writes it last, on commit); or
- it is a Hugging Face folder whose ``model.safetensors.index.json`` names shards that are
  all present (``save_pretrained`` writes the index after the shards).
A folder with neither is left alone until it is.

Milestones (archived to Tier 2) without any global setting: ``--milestone-every N`` tags every
step that is a multiple of N, and a folder holding the milestone marker file
(``--milestone-marker``, default ``MILESTONE``) is tagged whatever its step.

The run's origin (``--resumed-from``, ``--fine-tuned-from`` or ``--branched-from RUN/STEP``) is
written into every manifest, so the catalog records the run's lineage from any of them.

A complete folder is hard-linked (no bytes copied; a copy across file systems) into
``<tier0>/<run>/step-XXXXXXXX/`` and committed there with its manifest by the client, which
announces it. The job's own folder is untouched, so its resume logic and rotation keep
working. "Once" is durable: a step whose Tier 0 manifest exists is never announced again,
across restarts of the watcher.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.client import CheckpointStager, OriginKeywords, SavedCheckpoint
from ckpt.space import ensure_room_for_folder
from core.errors import StorageFull, TierUnavailable
from core.formats import DCP_METADATA, HF_INDEX, hf_index_shards
from core.layout import manifest_name, staging_name
from core.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_MARKER = "COMMITTED"
DEFAULT_MILESTONE_MARKER = "MILESTONE"
_STEP_RE = re.compile(r"(\d+)$", re.ASCII)  # ASCII digits, as every step read from text
_TEMP_PREFIXES = ("tmp", ".")  # HF's tmp-checkpoint-N, hidden staging folders


def step_of(name: str) -> int | None:
    """The step a folder name ends with, or None (temporary folders never count)."""
    if name.startswith(_TEMP_PREFIXES):
        return None
    m = _STEP_RE.search(name)
    return int(m.group(1)) if m else None


def completion(folder: Path, marker: str = DEFAULT_MARKER) -> str | None:
    """Why ``folder`` is a complete checkpoint ('marker', 'dcp', 'hf'), or None if not yet."""
    if (folder / marker).is_file():
        return "marker"
    if (folder / DCP_METADATA).is_file():
        return "dcp"
    index = folder / HF_INDEX
    if index.is_file():
        try:
            shards = hf_index_shards(index.read_bytes(), HF_INDEX)
        except Exception:  # noqa: BLE001 - a half-written index: not complete yet
            return None
        if shards and all((folder / s).is_file() for s in shards):
            return "hf"
    return None


def link_tree(src: Path, dst: Path, *, skip: Collection[str] = frozenset()) -> None:
    """Hard-link every file of ``src`` into the new folder ``dst`` (copy across devices)."""
    for dirpath, _dirs, names in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in names:
            if rel == Path(".") and name in skip:
                continue
            s, d = Path(dirpath) / name, dst / rel / name
            if s.is_symlink():
                d.symlink_to(os.readlink(s))  # kept as a link: the manifest builder confines it
                continue
            try:
                os.link(s, d)
            except OSError:
                shutil.copy2(s, d)


@dataclass
class Watcher:
    """Polls ``root`` and commits/announces each newly complete checkpoint folder once."""

    root: Path
    run: str
    settings: Settings
    marker: str = DEFAULT_MARKER
    part: int = 0
    parts: int = 1
    announce: bool = True
    milestone_every: int | None = None
    milestone_marker: str = DEFAULT_MILESTONE_MARKER
    origin: OriginKeywords = field(default_factory=OriginKeywords)  # written into every manifest
    seen: set[int] = field(default_factory=set)
    _stager: CheckpointStager | None = field(default=None, repr=False)

    @property
    def stager(self) -> CheckpointStager:
        if self._stager is None:
            self._stager = CheckpointStager(self.run, settings=self.settings, part=self.part, parts=self.parts,
                                            announce=self.announce, measure_stall=False, **self.origin)
        return self._stager

    def pending(self) -> list[tuple[int, Path, str]]:
        """(step, folder, why) of complete folders not yet committed on Tier 0, oldest first."""
        out: list[tuple[int, Path, str]] = []
        if not self.root.is_dir():
            return out
        for entry in sorted(self.root.iterdir()):
            step = step_of(entry.name)
            if step is None or step in self.seen or not entry.is_dir() or entry.is_symlink():
                continue
            if (self.stager.checkpoint_dir(step) / manifest_name(self.part, self.parts)).is_file():
                self.seen.add(step)  # committed by an earlier watcher (or the client): done
                continue
            why = completion(entry, self.marker)
            if why:
                out.append((step, entry, why))
        return sorted(out)

    def poll(self) -> list[SavedCheckpoint]:
        """Commit and announce what became complete since the last poll. A folder that fails
        (bad format, a link leaving it) is logged and skipped for good, never retried in a loop."""
        done: list[SavedCheckpoint] = []
        for step, folder, why in self.pending():
            self.seen.add(step)
            try:
                self.stager.prove_root()  # before anything is made under it: a missing mount is never written on
            except TierUnavailable as exc:  # not the folder's fault: tried again at the next poll
                self.seen.discard(step)
                log.warning("Tier 0 is unavailable for %s (step %d): %s", folder, step, exc)
                continue
            final = self.stager.checkpoint_dir(step)
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = final.parent / staging_name(final.name)
            try:
                ensure_room_for_folder(self.stager, step, folder)
                link_tree(folder, staging, skip={self.marker, self.milestone_marker})
                saved = self.stager.save(step, staging, milestone=self.is_milestone(step, folder))
                log.info("announced %s step %d (%s, %s, %d files)", self.run, step, why, saved.manifest.kind,
                         len(saved.manifest.files))
                done.append(saved)
            except (StorageFull, TierUnavailable) as exc:  # not the folder's fault: tried again at the next poll
                self.seen.discard(step)
                log.warning("Tier 0 cannot take %s (step %d) yet: %s", folder, step, exc)
            except Exception as exc:  # noqa: BLE001 - one bad folder must not stop the watcher
                log.error("cannot commit %s (step %d): %s", folder, step, exc)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return done

    def is_milestone(self, step: int, folder: Path) -> bool:
        """Tagged by the every-N rule or by the marker file in the job's folder."""
        every = self.milestone_every
        return bool(every and step % every == 0) or (folder / self.milestone_marker).is_file()

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


def watch(root: Path, run: str, settings: Settings, *, marker: str = DEFAULT_MARKER, interval: float = 2.0,
          once: bool = False, part: int = 0, parts: int = 1,
          on_commit: Callable[[SavedCheckpoint], object] | None = None, milestone_every: int | None = None,
          milestone_marker: str = DEFAULT_MILESTONE_MARKER, origin: OriginKeywords | None = None) -> int:
    """Run the watcher until interrupted (or one pass with ``once``); returns how many
    checkpoints it committed. ``origin``: the run's, as the stager's keyword
    (``{"resumed_from": (run, step)}``), written into every manifest."""
    w = Watcher(Path(root).absolute(), run, settings, marker=marker, part=part, parts=parts,
                milestone_every=milestone_every, milestone_marker=milestone_marker, origin=origin or OriginKeywords())
    count = 0
    try:
        while True:
            for saved in w.poll():
                count += 1
                if on_commit:
                    on_commit(saved)
            if once:
                return count
            time.sleep(interval)
    except KeyboardInterrupt:
        return count
    finally:
        w.close()
