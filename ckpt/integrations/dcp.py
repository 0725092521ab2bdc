"""``torch.distributed.checkpoint.async_save`` with the commit and the announcement after the write.

    from ckpt.client import CheckpointStager
    from ckpt.integrations.dcp import async_save_and_commit

    stager = CheckpointStager("llama-pt")
    ...
    fut = async_save_and_commit({"model": model.state_dict(), "optim": optim.state_dict()}, stager, step)
    # training goes on; fut.result() is the SavedCheckpoint once committed on Tier 0

The training loop stalls only for DCP's own staging (the copy of the state dict to host
memory that ``async_save`` does before it returns). DCP then writes its files into a hidden
staging folder on Tier 0 from its own thread; when that write has finished, the folder is
adopted by the stager on a commit thread of ours (one rename, CRC32C pass, manifest, event),
never on DCP's thread and never on the training thread. The manifest records the measured
stall (the ``async_save`` call), not the commit.

As with ``dcp.async_save`` itself, wait for (or check) the previous future before the next save
if host memory for two staged copies is short. Single process without
``torch.distributed`` initialised: DCP runs with ``no_dist=True``. Several ranks on one node
share one checkpoint folder: pass the same ``staging`` path on each (the node's part); the
stager of one rank per node then commits it.

Resuming, one line per node: ``dcp.load(state_dict, checkpoint_id=resume_point(run, part=node_rank,
parts=nodes).path)`` (``ckpt.resume.resume_point``: this node's part and the ``.metadata``, read in
place where they lie, else fetched). Needs ``torch`` (``pip install ckpt-tiering[torch]``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckpt.integrations import staging_dir
from core.errors import StorageFull

if TYPE_CHECKING:
    from ckpt.client import CheckpointStager

log = logging.getLogger(__name__)

_pool: dict[str, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _commit_pool() -> ThreadPoolExecutor:
    """One commit thread for the process: commits run in the order their writes finished."""
    with _pool_lock:
        if "commit" not in _pool:
            _pool["commit"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-dcp-commit")
        return _pool["commit"]


def async_save_and_commit(state_dict: dict[str, Any], stager: CheckpointStager, step: int, *,
                          metrics: Mapping[str, float] | None = None, milestone: bool = False,
                          epoch_end: bool = False, staging: str | Path | None = None, commit: bool = True,
                          **dcp_kwargs: Any) -> Future:
    """``dcp.async_save(state_dict)`` into a staging folder on Tier 0, then (once DCP's write has
    finished) ``stager.save(step, folder)`` on a commit thread. Returns a Future of the
    ``SavedCheckpoint``; it carries DCP's error or the commit's, if any, and ``StorageFull``
    when Tier 0 has no room for this process's state even after this node's Tier 0 retention
    (then DCP was not started and nothing was written). ``commit=False``:
    this rank only writes (another rank of the node commits the shared ``staging`` folder).
    Other keywords go to ``dcp.async_save`` (``process_group``, ``async_checkpointer_type``...)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckpt.space import state_needed  # deferred: start-up — pydantic-settings (core.settings)

    t0 = time.perf_counter()
    out: Future = Future()
    try:
        stager.ensure_room(step, state_needed(state_dict))
    except StorageFull as exc:  # reported as DCP reports a failed write: on the future
        log.error("dcp.async_save of %s step %d not started: %s", stager.run, step, exc)
        out.stall_seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
        out.set_exception(exc)
        return out
    folder = Path(staging) if staging is not None else staging_dir(stager, step)
    dcp_kwargs.setdefault("no_dist", not (dist.is_available() and dist.is_initialized()))
    response = dcp.async_save(state_dict, checkpoint_id=str(folder), **dcp_kwargs)
    # AsyncSaveResponse (its upload_completion) or the Future itself
    written = cast("Future[Any]", getattr(response, "upload_completion", response))
    stall = time.perf_counter() - t0
    out.stall_seconds = stall  # type: ignore[attr-defined]

    def _commit() -> None:
        try:
            out.set_result(stager.save(step, folder, metrics=metrics, milestone=milestone, epoch_end=epoch_end,
                                       stall_seconds=stall) if commit else None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            log.error("commit of %s step %d failed: %s", stager.run, step, exc)
            out.set_exception(exc)

    def _written(fut: Future) -> None:
        exc = fut.exception()
        if exc is not None:
            log.error("dcp.async_save of %s step %d failed: %s", stager.run, step, exc)
            out.set_exception(exc)
        else:
            _commit_pool().submit(_commit)

    written.add_done_callback(_written)
    return out
