"""Hugging Face ``transformers`` Trainer: one callback commits every ``checkpoint-N`` folder the
Trainer writes as step N of a run and announces it.

    from ckpt.integrations.hf import TieringCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TieringCallback(run="gpt-sft")])

Where the bytes go. The Trainer writes ``output_dir/checkpoint-N/`` (safetensors weights,
optimizer, scheduler, RNG state, ``trainer_state.json``); Tier 0's layout wants
``<tier0>/<run>/step-0000000N/``. Keep ``output_dir`` on Tier 0's file system (the node's
NVMe) and ``on_save`` *moves* the folder there with one rename: no byte is copied or written
twice, and the Trainer's own ``save_total_limit`` rotation has nothing left to rotate (Tier 0
retention decides instead). The CRC32C pass, the manifest and the announcement then run on a
thread of their own, so the job stalls for the Trainer's save plus one rename. With
``keep_trainer_copy=True`` (automatic under ``load_best_model_at_end``, which reopens the
Trainer's folders) the files are hard-linked instead, still without copying; on another file
system they are copied (slower; a warning says so once).

Resuming, one line: ``trainer.train(resume_from_checkpoint=resume_from(run))`` continues from
the run's newest good checkpoint (its folder on this node's Tier 0 or the mounted Tier 1, read
in place, else fetched; ``None`` starts afresh when the run has none yet). Into a new run:
``TieringCallback(run="gpt-sft-2", resumed_from=resume_from("gpt-sft"))``.

By hand: ``ckpt restore RUN --step N --to DIR`` gives the Trainer's folder back (plus its
manifest); ``trainer.train(resume_from_checkpoint=DIR)`` continues from step N, and
``TieringCallback(run="gpt-sft-2", resumed_from=DIR)`` records the new run's lineage
(``resumed_from`` may also be ``(run, step)``).

Room: before the Trainer writes a checkpoint, Tier 0 must have room for the model's and the
optimizer's state (this node's Tier 0 retention is asked for it, and waited for); otherwise
``trainer.train()`` raises ``StorageFull``, as it raises a failed save, and nothing is written.

Needs ``pip install ckpt-tiering[hf]``. On multi-process jobs only the world's process zero
commits (it is the one that writes the Trainer's checkpoint folder).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ckpt.client import CheckpointStager
from ckpt.integrations import BackgroundCommits, link_or_copy, origin_of, same_filesystem, single_part, staging_dir
from ckpt.space import state_needed

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState

log = logging.getLogger(__name__)

PREFIX_CHECKPOINT_DIR = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


class TieringCallback(TrainerCallback):
    """Commit each ``checkpoint-N`` the Trainer saves as step N of ``run`` and announce it.

    ``resumed_from``: ``(run, step)`` or a folder ``ckpt restore`` wrote (lineage of a resumed
    run); ``milestone``: a step predicate (``lambda s: s % 5000 == 0``) on top of the milestone
    policy in settings; ``keep_trainer_copy``: hard-link instead of moving the Trainer's
    folder; every other keyword goes to ``CheckpointStager`` (``settings``, ``node``,
    ``project``, ``announce``...).
    """

    def __init__(self, run: str, *, resumed_from: tuple[str, int] | str | os.PathLike | None = None,
                 milestone: Callable[[int], bool] | None = None, keep_trainer_copy: bool = False,
                 **stager_options: Any) -> None:
        single_part("TieringCallback", stager_options, "the world's process zero commits the Trainer's folder")
        self.run = run
        self.origin = origin_of(resumed_from)
        self.milestone = milestone
        self.keep_trainer_copy = keep_trainer_copy
        self.stager_options = stager_options
        self.commits: BackgroundCommits | None = None
        self.saved: list = []  # Futures of this run's commits (result: SavedCheckpoint)
        self.stalls: dict[int, float] = {}  # step -> seconds the training loop waited for that save
        self._step_end: float | None = None
        self._warned_copy = False

    # --- the Trainer's hooks ------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if getattr(args, "load_best_model_at_end", False) and not self.keep_trainer_copy:
            log.info("load_best_model_at_end reopens the Trainer's folders: hard-linking them instead of moving")
            self.keep_trainer_copy = True
        if state.is_world_process_zero and self.commits is None:
            self.commits = BackgroundCommits(self._make_stager())

    def on_step_end(self, args, state, control, **kwargs):
        self._step_end = time.perf_counter()  # the Trainer saves right after this hook
        self._ensure_room(state, control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._ensure_room(state, control, kwargs)  # an epoch-end save follows this hook

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.commits is None:
            self.commits = BackgroundCommits(self._make_stager())
        step = int(state.global_step)
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if not folder.is_dir():
            log.warning("TieringCallback: %s not found; step %d not committed", folder, step)
            return
        staging = staging_dir(self.commits.stager, step)
        if not self.keep_trainer_copy and same_filesystem(folder, staging.parent):
            os.rename(folder, staging)
        else:
            self._link_tree(folder, staging)
        now = time.perf_counter()
        stall = now - (self._step_end if self._step_end is not None else now)
        self.stalls[step] = stall
        save_strategy = str(getattr(args, "save_strategy", ""))
        self.saved.append(self.commits.submit(
            step, staging, metrics=_metrics(state, step), stall_seconds=stall,
            milestone=bool(self.milestone and self.milestone(step)),
            epoch_end=save_strategy.endswith("epoch")))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()  # every commit done, pending events sent; a later train() starts afresh

    # --- the caller's --------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Wait until every checkpoint saved so far is committed on Tier 0 (and announced)."""
        if self.commits is not None:
            self.commits.wait(timeout)

    def close(self) -> None:
        """Wait for the commits, then let pending events leave (``CheckpointStager.close``)."""
        if self.commits is not None:
            self.commits.close()
            self.commits = None

    def _ensure_room(self, state: TrainerState, control: TrainerControl, hooks: dict[str, Any]) -> None:
        """Before the Trainer writes a checkpoint (``control.should_save``, set by the Trainer's
        own flow callback, which runs first): room on Tier 0 for the model's and optimizer's
        state, or ``StorageFull`` out of ``trainer.train()``, the way the Trainer reports a
        failed save, with nothing written."""
        if not (control.should_save and state.is_world_process_zero):
            return
        if self.commits is None:
            self.commits = BackgroundCommits(self._make_stager())
        model, optimizer = hooks.get("model"), hooks.get("optimizer")
        saved_state = {"model": model.state_dict() if model is not None else {},
                       "optimizer": optimizer.state_dict().get("state", {}) if optimizer is not None else {}}
        self.commits.stager.ensure_room(int(state.global_step), state_needed(saved_state))

    def _make_stager(self) -> CheckpointStager:
        return CheckpointStager(self.run, resumed_from=self.origin, **self.stager_options)

    def _link_tree(self, folder: Path, staging: Path) -> None:
        linked = True
        for src in sorted(p for p in folder.rglob("*") if p.is_file()):
            linked &= link_or_copy(src, staging / src.relative_to(folder))
        if not linked and not self._warned_copy:
            self._warned_copy = True
            log.warning("TieringCallback: %s is not on Tier 0's file system; checkpoints are copied", folder)


def resume_from(run: str, **resume_options: Any) -> str | None:
    """The folder to give ``Trainer.train(resume_from_checkpoint=...)``: the run's newest good
    checkpoint on this node (``ckpt.resume.resume_point``; options such as ``to``, ``verify``,
    ``settings`` go to it), or None when the run has no checkpoint yet (a fresh start)."""
    from ckpt.resume import resume_point  # deferred: start-up — SQLAlchemy, Alembic (tasks.resume)

    point = resume_point(run, **resume_options)
    return None if point is None else point.path


def _metrics(state: TrainerState, step: int) -> dict[str, float]:
    """The numbers the Trainer logged at ``step`` (loss, learning rate, eval metrics)."""
    out: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") == step:
            out.update({k: float(v) for k, v in entry.items()
                        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out
