"""``ckpt commit DIR``: commit a checkpoint folder a job already wrote, without importing the
client in the job: check its format, write its manifest (CRC32C of every file), put it under
the layout on Tier 0 and announce it.

The folder goes through the client's own commit (``CheckpointStager.save`` on a folder:
format detection and validation, manifest written last, published by rename), and the event
through the client's announcer (``emit_completed``), sent here synchronously so the command can
say whether it arrived. A folder elsewhere than ``<tier0>/<run>/step-XXXXXXXX/`` is hard-linked
there first (as ``ckpt watch`` does), so the job's own folder is left as it was.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ckpt.announce import completed_payload, emit_completed, prefect_api_url
from ckpt.client import CheckpointStager, OriginKeywords, SavedCheckpoint
from ckpt.space import ensure_room_for_folder
from ckpt.watch import link_tree
from core import events
from core.errors import BadInput
from core.layout import staging_name
from core.settings import Settings


@dataclass(frozen=True)
class Committed:
    saved: SavedCheckpoint
    announced: bool | None  # None: not asked to (--no-announce); False: the event did not arrive


def commit_folder(folder: Path, run: str, step: int, settings: Settings, *, milestone: bool = False,
                  epoch_end: bool = False, origin: OriginKeywords | None = None, part: int = 0,
                  parts: int = 1, announce: bool = True, attempt: str | None = None) -> Committed:
    """Commit ``folder`` as ``run`` step ``step`` (part ``part`` of ``parts``) on Tier 0 and,
    with ``announce``, emit ``ckpt.checkpoint.completed``. ``origin``: the run's, as the
    stager's keyword (``{"fine_tuned_from": (run, step)}``), written into the manifest. Raises ``BadInput`` /
    ``CorruptCheckpoint`` for a folder that fails its format, ``EventTooLarge`` (before sending)
    for an event the orchestrator would drop."""
    folder = Path(folder).expanduser().absolute()
    if not folder.is_dir():
        raise BadInput(f"{str(folder)!r} is not a folder")
    stager = CheckpointStager(run, settings=settings, part=part, parts=parts, announce=False, measure_stall=False,
                              attempt=attempt, **(origin or {}))
    try:
        stager.prove_root()  # before anything is made under it: a missing mount is never written on
        final = stager.checkpoint_dir(step)
        if folder == final:
            saved = stager.save(step, folder, milestone=milestone, epoch_end=epoch_end)
        else:
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = final.parent / staging_name(final.name)
            shutil.rmtree(staging, ignore_errors=True)  # a leftover of an interrupted commit
            ensure_room_for_folder(stager, step, folder)
            try:
                link_tree(folder, staging)
                saved = stager.save(step, staging, milestone=milestone, epoch_end=epoch_end)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    finally:
        stager.close()
    assert isinstance(saved, SavedCheckpoint)  # a folder is committed in the foreground
    if not announce:
        return Committed(saved, None)
    m = saved.manifest
    events.check_size(events.build_event(events.COMPLETED, m.run, m.step, part=m.part, parts=m.parts, node=m.node,
                                         payload=completed_payload(m)))
    url = prefect_api_url(settings)
    return Committed(saved, emit_completed(m, api_url=url) if url else False)
