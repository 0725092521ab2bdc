"""Lightning's sharded strategies: each node commits its ranks' files of the folder the strategy
writes, as its part of the checkpoint.

    from ckpt.integrations.lightning_sharded import TieringModelParallelStrategy

    strategy = TieringModelParallelStrategy(run="lit-tp", save_distributed_checkpoint=True, ...)
    trainer = L.Trainer(..., strategy=strategy)

Why a strategy: FSDP with ``state_dict_type="sharded"`` and ``ModelParallelStrategy``'s
distributed checkpoint write their folder through ``torch.distributed.checkpoint`` themselves
and call no ``CheckpointIO`` (Lightning issue #20205); the strategy's ``save_checkpoint`` is the
one place every rank passes once its files are written.

The layout is Lightning's and DCP's own: ``<dirpath>/<name>.ckpt/`` holds ``__<rank>_<i>.distcp``
of every rank and, from global rank 0, DCP's ``.metadata`` and Lightning's ``meta.pt``. A
node's part (part = node rank, parts = the number of nodes) is the files of its own ranks, plus
rank 0's others on rank 0's node: the parts never share a path, whether ``dirpath`` is
node-local or shared. After the save and a barrier, the node's local rank 0 hard-links them into
Tier 0 (copied across file systems) and commits them off the training thread, as
``TieringCheckpointIO`` does; a file the strategy writes again (``last.ckpt``) is unlinked first
by the rank that writes it, so a committed link keeps its bytes. A step is committed once.
Before the write, every node's Tier 0 must have room for the checkpoint: otherwise every rank
raises ``StorageFull`` together (a vote), before a byte is written, so no rank waits in DCP's
collectives for one that stopped. The same strategies with a full state dict write one ``.ckpt``
from global rank 0 through the ``CheckpointIO``: ``TieringCheckpointIO`` commits those.

Resuming, one line: ``trainer.fit(model, ckpt_path=strategy.resume_path())``, on every rank.
Each node gets the run's newest checkpoint whose parts all have a good copy (one attempt's),
whole, in a folder it can read (``ckpt.resume.resume_point`` with every part: DCP spreads the
entries every rank holds alike, the optimizer's hyper-parameters and step counters, over the
ranks' files, so a rank reads other ranks' files too, and Lightning's ``meta.pt`` is rank 0's;
however many nodes wrote it, since DCP reshards on load); ``None`` (a fresh start) when the run
has none yet. The launch's attempt (the stager's ``attempt``, else the launcher's) is recorded
as resuming from that step, so the steps it saves again supersede the older attempt's. Lightning
loads every rank from global rank 0's path; such a folder is often on rank 0's node alone (its
Tier 0, a fetch), so the strategy loads each rank from the path its own ``resume_path`` gave,
once the ranks agree on the step.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from ckpt.client import CheckpointStager
from ckpt.integrations import BackgroundCommits, link_or_copy, origin_of, staging_dir, submit_staged
from ckpt.space import state_needed
from core.errors import BadInput, ConflictError, StorageFull

_RANK_FILE = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")  # torch DCP's FileSystemWriter, one per rank and thread


class ShardedCommits:
    """The commit of a sharded save, mixed in before a Lightning strategy class
    (``class S(ShardedCommits, FSDPStrategy)``); ``tiering`` sets it up."""

    def tiering(self, run: str, resumed_from: tuple[str, int] | str | os.PathLike | None,
                milestone: Callable[[int], bool] | None, stager_options: dict[str, Any]) -> None:
        if {"part", "parts"} & set(stager_options):
            raise BadInput("the part of a sharded checkpoint is the node's (its node rank of the number of "
                           "nodes): create the strategy without part/parts")
        self.run, self.origin, self.milestone = run, origin_of(resumed_from), milestone
        self.stager_options = stager_options
        self.commits: BackgroundCommits | None = None
        self.saved: list = []  # Futures of this node's commits (result: SavedCheckpoint)
        self.stalls: dict[int, float] = {}
        self._committed: set[int] = set()
        self._node_of: list[int] | None = None  # global rank -> node rank
        self._resumed: dict[str, int] = {}  # folder resume_path gave this rank -> its step
        self._own_path = False  # while loading a resume_path folder: each rank keeps its own path

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        t0 = time.perf_counter()
        strategy: Any = self
        step = int(checkpoint.get("global_step", 0))
        folder = Path(strategy.broadcast(filepath))
        self._setup(strategy)
        for f in self._files(folder, {strategy.global_rank}):
            f.unlink()  # a new inode: a committed hard link keeps its bytes
        self._ensure_room(strategy, step, checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        strategy.barrier("ckpt-tiering sharded save")  # every rank of the node has written
        if self.commits is None or step in self._committed:
            return
        staging = staging_dir(self.commits.stager, step)
        mine = {r for r, n in enumerate(self._node_of or []) if n == strategy.node_rank}
        for f in self._files(folder, mine):
            link_or_copy(f, staging / f.name)
        submit_staged(self, step, staging, t0)

    def resume_path(self, **resume_options: Any) -> str | None:
        """The folder to give ``Trainer.fit(ckpt_path=...)`` on this rank: the whole of the run's
        newest checkpoint whose parts all have a good copy, readable on this node
        (``ckpt.resume.resume_point``; ``to``, ``verify`` go to it; the settings and the attempt
        are the stager's), or None when the run has no checkpoint yet."""
        from ckpt.resume import resume_point  # deferred: start-up — SQLAlchemy, Alembic (tasks.resume)

        # every part, however many nodes wrote it: DCP reshards on load, so a relaunch on fewer nodes resumes too
        point = resume_point(self.run, settings=self.stager_options.get("settings"),
                             attempt=self.stager_options.get("attempt"), **resume_options)
        if point is None:
            return None
        self._resumed[point.path] = point.step
        return point.path

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load; of a ``resume_path`` folder, from each rank's own path once every
        rank's was given by ``resume_path`` for the same step (``ConflictError`` on every rank
        otherwise: the nodes would load different checkpoints into one model)."""
        strategy: Any = self
        mine = self._resumed.get(str(checkpoint_path), -1)
        steps = strategy.all_gather(torch.tensor([mine], device=strategy.root_device)).flatten().tolist()
        if set(steps) == {-1}:  # a path of the user's own: Lightning loads every rank from rank 0's
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        if len(set(steps)) != 1:
            given = ", ".join("another path" if s < 0 else f"step {s}" for s in steps)
            raise ConflictError(f"{self.run}: the ranks resume from different checkpoints ({given}, by global "
                                "rank); give every rank strategy.resume_path()")
        self._own_path = True
        try:
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        finally:
            self._own_path = False

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The strategy's broadcast, except while a ``resume_path`` folder loads: each rank keeps
        its own path (the load's one broadcast), since rank 0's folder may be on its node alone."""
        if self._own_path:
            return obj
        return super().broadcast(obj, src)  # type: ignore[misc]

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every checkpoint this node saved so far is committed on Tier 0 (and announced)."""
        if self.commits is not None:
            self.commits.wait(timeout)

    def teardown(self) -> None:
        """End of ``fit``: wait for the node's commits and let pending events leave."""
        super().teardown()  # type: ignore[misc]
        if self.commits is not None:
            self.commits.close()
            self.commits = None

    def _setup(self, strategy: Any) -> None:
        """At the first save (every rank is there): each rank's node, and the node's stager on its
        local rank 0."""
        if self._node_of is None:
            nodes = strategy.all_gather(torch.tensor([strategy.node_rank], device=strategy.root_device))
            self._node_of = [int(n) for n in nodes.flatten().tolist()]
        if self.commits is None and strategy.local_rank == 0:
            self.commits = BackgroundCommits(CheckpointStager(
                self.run, resumed_from=self.origin, part=strategy.node_rank, parts=strategy.num_nodes,
                **self.stager_options))

    def _ensure_room(self, strategy: Any, step: int, checkpoint: dict[str, Any]) -> None:
        """Room on every node's Tier 0, or ``StorageFull`` on every rank (one vote)."""
        full: StorageFull | None = None
        if self.commits is not None:
            try:
                self.commits.stager.ensure_room(step, state_needed(checkpoint))
            except StorageFull as exc:
                full = exc
        if not strategy.reduce_boolean_decision(full is None, all=True):
            raise full or StorageFull(f"{self.run} step {step}: another node's Tier 0 has no room; nothing was written")

    @staticmethod
    def _files(folder: Path, ranks: set[int]) -> list[Path]:
        """The files of ``folder`` that ``ranks`` wrote: their ``__<rank>_<i>.distcp``, and every
        other file when global rank 0 is among them."""
        if not folder.is_dir():
            return []
        out = []
        for f in sorted(folder.iterdir()):
            m = _RANK_FILE.match(f.name)
            if f.is_file() and (int(m["rank"]) in ranks if m else 0 in ranks):
                out.append(f)
        return out


class TieringModelParallelStrategy(ShardedCommits, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose every distributed checkpoint is also committed, one part per
    node, as step ``global_step`` of ``run``. ``resumed_from``, ``milestone`` and ``stager_options``
    (``settings``, ``project``, ``announce``...) as for ``TieringCheckpointIO``; every other
    keyword goes to ``ModelParallelStrategy``, whose ``save_distributed_checkpoint`` must stay on."""

    def __init__(self, run: str, *, resumed_from: tuple[str, int] | str | os.PathLike | None = None,
                 milestone: Callable[[int], bool] | None = None, stager_options: dict[str, Any] | None = None,
                 **strategy_options: Any) -> None:
        if not strategy_options.get("save_distributed_checkpoint", True):
            raise BadInput("save_distributed_checkpoint=False saves one .ckpt from global rank 0: "
                           "use TieringCheckpointIO with ModelParallelStrategy instead")
        super().__init__(**strategy_options)
        self.tiering(run, resumed_from, milestone, dict(stager_options or {}))


class TieringFSDPStrategy(ShardedCommits, FSDPStrategy):
    """``FSDPStrategy(state_dict_type="sharded")`` whose every checkpoint is also committed, one
    part per node; arguments as for ``TieringModelParallelStrategy``."""

    def __init__(self, run: str, *, resumed_from: tuple[str, int] | str | os.PathLike | None = None,
                 milestone: Callable[[int], bool] | None = None, stager_options: dict[str, Any] | None = None,
                 **strategy_options: Any) -> None:
        if strategy_options.setdefault("state_dict_type", "sharded") != "sharded":
            raise BadInput('state_dict_type="full" saves one .ckpt from global rank 0: '
                           "use TieringCheckpointIO with FSDPStrategy instead")
        super().__init__(**strategy_options)
        self.tiering(run, resumed_from, milestone, dict(stager_options or {}))
