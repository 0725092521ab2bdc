"""PyTorch Lightning: a ``CheckpointIO`` plugin that commits every checkpoint Lightning saves
(``ModelCheckpoint``, ``trainer.save_checkpoint``) as a step of a run and announces it.

    from ckpt.integrations.lightning import TieringCheckpointIO

    trainer = L.Trainer(..., plugins=[TieringCheckpointIO(run="lit-run")])

Why a ``CheckpointIO`` and not a ``Callback``: a callback's ``on_save_checkpoint`` runs
*before* the file is written; the checkpoint I/O plugin is the one place that knows the write
has finished. Lightning's own write is unchanged (``TorchCheckpointIO``, to the path
``ModelCheckpoint`` chose, which keeps tracking, rotating and loading its files as before); the
file is then hard-linked into Tier 0's layout (no byte copied when ``dirpath`` is on Tier 0's
file system; copied otherwise) and the CRC32C pass, the manifest and the announcement run on a
thread of their own. The job stalls for Lightning's save plus one link. A name Lightning
writes again (``last.ckpt``) is unlinked first, so the committed copy's bytes never change.
A step is committed once: the second file of the same step (``last.ckpt`` beside
``epoch=0-step=N.ckpt``) is the same state. Before Lightning writes, Tier 0 must have room for
the checkpoint (this node's Tier 0 retention is asked for it, and waited for): otherwise the
save raises ``StorageFull``, as Lightning raises a failed write, before a byte is written.

Resuming, one line: ``trainer.fit(model, ckpt_path=resume_path(run))``: the ``.ckpt`` of the
run's newest good checkpoint on this node (read in place, else fetched), ``None`` (a fresh
start) when the run has none yet. Into a new run: ``TieringCheckpointIO(run="lit-run-2",
resumed_from=resume_path("lit-run"))``.

One part: Lightning calls a ``CheckpointIO`` on global rank 0 only, with the one ``.ckpt`` of a
strategy that does not shard its checkpoint (single device, DDP, FSDP or ``ModelParallelStrategy``
with a full state dict), so every checkpoint is single-part and ``part``/``parts`` are refused
when the plugin is created (every rank would otherwise commit the same file name as a part of
its own, and no step could ever be whole on Tier 1). Sharded strategies (FSDP with
``state_dict_type="sharded"``, ``ModelParallelStrategy``'s distributed checkpoint, DeepSpeed)
write a folder of per-rank files themselves and call no ``CheckpointIO`` (Lightning issue
#20205), so this plugin sees none of their saves: ``ckpt.integrations.lightning_sharded``
commits FSDP's and ``ModelParallelStrategy``'s, one part per node (DeepSpeed's not yet), and
resumes them (``strategy.resume_path()``).

By hand: ``ckpt restore RUN --step N --to DIR``, then ``trainer.fit(model, ckpt_path=DIR/<file>.ckpt)``
with ``TieringCheckpointIO(run="lit-run-2", resumed_from=DIR)`` (or ``(run, step)``) for the
lineage. Needs ``pip install ckpt-tiering[lightning]``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from ckpt.client import CheckpointStager
from ckpt.integrations import BackgroundCommits, link_or_copy, origin_of, single_part, staging_dir, submit_staged
from ckpt.space import state_needed
from core.errors import CorruptCheckpoint

log = logging.getLogger(__name__)


class TieringCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose every save is also committed as step ``global_step`` of ``run``.

    ``resumed_from``: ``(run, step)`` or a folder (or ``.ckpt`` file) ``ckpt restore`` wrote;
    ``milestone``: a step predicate on top of the settings' milestone policy; every other
    keyword goes to ``CheckpointStager`` (``settings``, ``node``, ``project``, ``announce``...).
    """

    def __init__(self, run: str, *, resumed_from: tuple[str, int] | str | os.PathLike | None = None,
                 milestone: Callable[[int], bool] | None = None, **stager_options: Any) -> None:
        single_part("TieringCheckpointIO", stager_options,
                    "Lightning calls a CheckpointIO on global rank 0 only, with the one file of a non-sharded "
                    "strategy; sharded strategies call none: ckpt.integrations.lightning_sharded commits theirs")
        super().__init__()
        self.run = run
        self.origin = origin_of(resumed_from)
        self.milestone = milestone
        self.stager_options = stager_options
        self.commits: BackgroundCommits | None = None
        self.saved: list = []  # Futures of the commits (result: SavedCheckpoint)
        self.stalls: dict[int, float] = {}  # step -> seconds the save kept training waiting
        self._committed: set[int] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        """Lightning's write, then the commit; before the write, Tier 0 must have room for the
        checkpoint (``CheckpointStager.ensure_room``): ``StorageFull`` otherwise, raised out of
        the save as Lightning raises a failed write, with nothing written."""
        t0 = time.perf_counter()
        target = Path(path)
        step = int(checkpoint.get("global_step", 0))
        if self.commits is None:
            self.commits = BackgroundCommits(CheckpointStager(self.run, resumed_from=self.origin,
                                                              **self.stager_options))
        self.commits.stager.ensure_room(step, state_needed(checkpoint))
        if target.is_file() or target.is_symlink():
            target.unlink()  # a new inode: a committed hard link keeps its bytes
        super().save_checkpoint(checkpoint, path, storage_options)
        if step in self._committed:
            return
        staging = staging_dir(self.commits.stager, step)
        if not link_or_copy(target, staging / target.name):
            log.warning("TieringCheckpointIO: %s is not on Tier 0's file system; the checkpoint was copied",
                        target)
        submit_staged(self, step, staging, t0)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every checkpoint saved so far is committed on Tier 0 (and announced)."""
        if self.commits is not None:
            self.commits.wait(timeout)

    def teardown(self) -> None:
        """End of ``fit``: wait for the commits and let pending events leave."""
        super().teardown()
        if self.commits is not None:
            self.commits.close()
            self.commits = None


def resume_path(run: str, **resume_options: Any) -> str | None:
    """The ``.ckpt`` file to give ``Trainer.fit(ckpt_path=...)``: the one file of the run's
    newest good checkpoint on this node (``ckpt.resume.resume_point``; ``to``, ``verify``,
    ``settings`` go to it), or None when the run has no checkpoint yet."""
    from ckpt.resume import resume_point  # deferred: start-up — SQLAlchemy, Alembic (tasks.resume)

    point = resume_point(run, **resume_options)
    if point is None:
        return None
    files = sorted(Path(point.path).rglob("*.ckpt"))
    if len(files) != 1:
        raise CorruptCheckpoint(f"{point.path}: expected one .ckpt file, found {len(files)}")
    return str(files[0])
