"""One line in the loop people already have: trainer integrations over ``CheckpointStager``.

- ``ckpt.integrations.hf.TieringCallback``: a ``transformers`` ``TrainerCallback``
  (``pip install ckpt-tiering[hf]``);
- ``ckpt.integrations.lightning.TieringCheckpointIO``: a Lightning ``CheckpointIO`` plugin
  (``pip install ckpt-tiering[lightning]``), and for Lightning's sharded strategies
  ``ckpt.integrations.lightning_sharded`` (``TieringFSDPStrategy``, ``TieringModelParallelStrategy``);
- ``ckpt.integrations.dcp.async_save_and_commit``: ``torch.distributed.checkpoint.async_save``
  with the commit and the announcement after the write (``pip install ckpt-tiering[torch]``).

Each module imports its library lazily (inside functions, or when the module itself is
imported), so the base install needs none of them. What they share lives here.

Parts: the HF callback and the Lightning plugin commit single-part checkpoints (the library
writes one checkpoint from one process) and refuse ``part``/``parts`` at once
(``single_part``); ``async_save_and_commit`` and the Lightning sharded strategies commit one
part per node of a DCP checkpoint, whose file names are the ranks' own, so the parts never
share a path.
"""

from __future__ import annotations

import errno
import json
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import BadInput
from core.layout import checkpoint_dirname, staging_name

if TYPE_CHECKING:
    from ckpt.client import CheckpointStager, SavedCheckpoint


def origin_of(resumed_from: tuple[str, int] | str | os.PathLike | None) -> tuple[str, int] | None:
    """``resumed_from`` as ``(run, step)``: given as such, or as the folder ``ckpt restore`` wrote
    (its ``manifest.json`` names the run and step it came from)."""
    if resumed_from is None:
        return None
    if isinstance(resumed_from, tuple):
        return str(resumed_from[0]), int(resumed_from[1])
    folder = Path(resumed_from)
    if folder.is_file():  # a Lightning .ckpt inside the restored folder
        folder = folder.parent
    manifests = sorted(folder.glob("manifest*.json"))
    if not manifests:
        raise BadInput(f"{folder}: no manifest.json; give resumed_from=(run, step) instead")
    data = json.loads(manifests[0].read_text())
    return str(data["run"]), int(data["step"])


def single_part(integration: str, stager_options: dict[str, Any], writer: str) -> None:
    """``BadInput`` (one line) when ``stager_options`` ask for a part of a multi-part checkpoint:
    ``writer`` says why the library's checkpoint is one part. Every rank would commit the same
    file names as a part of its own: other bytes at one path cannot sit side by side on Tier 1
    (the catalog refuses the second part), so the job is told before it trains."""
    part, parts = stager_options.get("part", 0), stager_options.get("parts", 1)
    if (part, parts) != (0, 1):
        raise BadInput(f"{integration} commits single-part checkpoints ({writer}); "
                       f"got part={part!r}, parts={parts!r}: create it without part/parts")


def staging_dir(stager: CheckpointStager, step: int) -> Path:
    """A fresh hidden folder on Tier 0, beside where ``step`` will be committed: what is written
    there is adopted by one rename (``stager.save(step, folder)``)."""
    parent = stager.checkpoint_dir(step).parent
    parent.mkdir(parents=True, exist_ok=True)
    return parent / staging_name(checkpoint_dirname(step))


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` to ``dst`` (no bytes move); copy when they sit on different file
    systems. True when linked."""
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copy2(src, dst)
    return False


def same_filesystem(a: Path, b: Path) -> bool:
    """Whether a rename from ``a`` into ``b`` (an existing folder, or its nearest existing parent) works."""
    while not b.exists():
        b = b.parent
    return a.stat().st_dev == b.stat().st_dev


class BackgroundCommits:
    """Commits of adopted folders, one at a time and in order, on a thread of their own: the
    training loop waits only for its library's write (and a rename or hard links into Tier 0),
    never for the CRC32C pass over the bytes, the manifest or the announcement. A failed
    commit is logged at once and raised by the next ``submit`` or by ``wait``/``close``."""

    def __init__(self, stager: CheckpointStager) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.stager = stager
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._pending: list[Future[SavedCheckpoint]] = []

    def submit(self, step: int, folder: Path, **save_kw: Any) -> Future[SavedCheckpoint]:
        """``stager.save(step, folder, **save_kw)`` on the commit thread; returns its Future
        (result: the ``SavedCheckpoint``)."""
        self.raise_error()
        fut = self._pool.submit(lambda: self.stager.save(step, folder, **save_kw))
        fut.add_done_callback(_log_failure)
        self._pending.append(fut)
        return fut

    def raise_error(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            if (exc := f.exception()) is not None:
                raise exc

    def wait(self, timeout: float | None = None) -> None:
        from concurrent.futures import wait

        _, not_done = wait(self._pending, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} checkpoint commit(s) still running")
        self.raise_error()

    def close(self, timeout: float | None = 300.0) -> None:
        try:
            self.wait(timeout)
        finally:
            self._pool.shutdown(wait=True)
            self.stager.close()


def _log_failure(fut: Future[Any]) -> None:
    import logging

    if not fut.cancelled() and fut.exception() is not None:
        logging.getLogger(__name__).error("checkpoint commit failed: %s", fut.exception())


def submit_staged(owner: Any, step: int, staging: Path, t0: float) -> None:
    """Hand ``staging`` (``staging_dir``) to ``owner.commits`` as ``step``: the stall since ``t0``
    recorded in ``owner.stalls``, the step in ``owner._committed``, the future in ``owner.saved``;
    a milestone when ``owner.milestone(step)`` says so. The one commit of the Lightning plugins."""
    stall = time.perf_counter() - t0
    owner.stalls[step] = stall
    owner._committed.add(step)
    owner.saved.append(owner.commits.submit(step, staging, stall_seconds=stall,
                                            milestone=bool(owner.milestone and owner.milestone(step))))
