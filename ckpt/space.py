"""Room on Tier 0 before a save writes: the check the stager (and each trainer integration,
before its library writes) makes, so a save never dies half-written on a full disk.

``Tier0Space.ensure_room(run, step, needed)``:
1. one ``statvfs`` of Tier 0 (less what this stager's background writes have still to put
   there); enough room: done. That is the whole cost on the job's hot path.
2. short: the staging folders of dead writers (a save killed midway) swept
   (``tasks.tier0_space.sweep_dead_staging``), then this node's Tier 0 retention
   (``tasks.tier0_space.retain_tier0_here``, the guarded prune: only copies already verified on
   a tier at least as durable go), again every ``POLL_SECONDS`` while promotions make more
   copies droppable, for up to ``settings.tier0_space_wait_seconds``;
3. still short: ``StorageFull`` with the numbers (free, needed, and what holds the room: live
   writers' staging folders, checkpoints waiting to be promoted), before a byte is written; the
   training loop decides (skip this save, save smaller, stop).

Whatever the outcome, the free space left after the save is compared with
``settings.tier_low_headroom_checkpoints`` checkpoints of this size; crossing below it logs a
warning and emits ``ckpt.tier.low`` (tier, node, numbers) once per crossing, not per save.
A catalog that cannot be reached makes retention a no-op (logged), never a crash of the save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.integrations import same_filesystem
from core.errors import StorageFull
from core.settings import Settings
from core.sizing import fmt_bytes
from core.space import Reading, folder_bytes, free_bytes, headroom, state_size, writer_stagings

if TYPE_CHECKING:
    from ckpt.client import CheckpointStager

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0  # between retention passes while waiting for room
TENSOR_OVERHEAD_BYTES = 512  # per tensor: its safetensors header entry, its index line
FILES_OVERHEAD_BYTES = 64 * 1024  # per save: index, manifest, each file's last block


def tensors_needed(data_bytes: int, tensors: int) -> int:
    """What a save of ``tensors`` arrays of ``data_bytes`` in all takes on disk, with headroom
    for headers, index, manifest and block rounding."""
    return data_bytes + tensors * TENSOR_OVERHEAD_BYTES + FILES_OVERHEAD_BYTES


def state_needed(state: object) -> int:
    """``tensors_needed`` of the arrays in a trainer's state (a state dict, a Lightning
    checkpoint dict, nested as they come)."""
    return tensors_needed(*state_size(state))


def ensure_room_for_folder(stager: CheckpointStager, step: int, folder: Path) -> None:
    """Before ``folder`` is linked into Tier 0 for ``step`` (``ckpt commit``, ``ckpt watch``):
    room for its bytes when they must be copied (another file system); nothing to check when
    they are hard-linked (no byte written)."""
    if not same_filesystem(folder, stager.checkpoint_dir(step).parent):
        stager.ensure_room(step, tensors_needed(folder_bytes(folder), 0))


class Tier0Space:
    """Free-space checks of one stager's Tier 0 at ``root``. ``on_low(reading, run, step)``
    announces a crossing below the headroom line (the stager sends ``ckpt.tier.low``)."""

    def __init__(self, settings: Settings, root: Path, *, on_low: Callable[[Reading, str, int], None]):
        self.settings, self.root, self.on_low = settings, root, on_low

    def ensure_room(self, run: str, step: int, needed: int, *, pending: int = 0) -> int:
        """Make sure ``needed`` bytes fit on Tier 0 beside ``pending`` bytes still being written;
        returns the bytes free before this save. Raises ``StorageFull`` (nothing written)."""
        free = free_bytes(self.root) - pending
        try:
            if free < needed:
                free = self._make_room(run, step, needed, pending, free)
        finally:
            self._watch(run, step, free - needed, needed)
        return free

    # --- short of room -----------------------------------------------------------------------
    def _make_room(self, run: str, step: int, needed: int, pending: int, free: int) -> int:
        t0 = time.monotonic()
        retention_on = self.settings.retention(0).lets_go
        deadline = t0 + (self.settings.tier0_space_wait_seconds if retention_on else 0)  # off: nothing to wait for
        before = free
        log.warning("Tier 0 at %s: %s free, %s/%d needs %s; running this node's Tier 0 retention",
                    self.root, fmt_bytes(max(free, 0)), run, step, fmt_bytes(needed))
        while True:
            for free_some in (self._sweep, self._retain):
                free_some()
                free = free_bytes(self.root) - pending
                if free >= needed:
                    log.info("room for %s/%d made in %.1f s", run, step, time.monotonic() - t0)
                    return free
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(POLL_SECONDS, left))
        count, waiting = self._waiting()
        live = [st for st in writer_stagings(self.root) if not st.dead]
        staging = (len(live), sum(st.bytes for st in live))
        tried = (f"retention of node {self.settings.node!r} freed {fmt_bytes(max(free - before, 0))} in "
                 f"{time.monotonic() - t0:.0f} s (tier0_space_wait_seconds={self.settings.tier0_space_wait_seconds:g})"
                 if retention_on else "Tier 0 retention is off (retention_tier0.enabled)")
        raise StorageFull(
            f"Tier 0 at {self.root} has {fmt_bytes(max(free, 0))} free, {run} step {step} needs {fmt_bytes(needed)}: "
            f"{tried}; held: {staging[0]} staging folder(s) of live writers ({fmt_bytes(staging[1])}), "
            f"{_waiting_text(count, waiting)}; nothing of this save was written",
            free=max(free, 0), needed=needed, waiting=None if count is None else (count, waiting), staging=staging)

    def _sweep(self) -> None:
        """Remove the staging folders of dead writers (a save killed midway) on this Tier 0."""
        from tasks import tier0_space  # deferred: start-up — Prefect, SQLAlchemy; the client imports this module

        try:
            tier0_space.sweep_dead_staging(self.settings, self.root, actor=f"stager:{self.settings.node}")
        except Exception as exc:  # noqa: BLE001 - the numbers still tell what holds the room
            log.warning("sweep of dead writers' staging failed: %s: %s", type(exc).__name__, exc)

    def _retain(self) -> None:
        from tasks import tier0_space  # deferred: start-up — Prefect, SQLAlchemy; the client imports this module

        try:
            done = tier0_space.retain_tier0_here(self.settings, actor=f"stager:{self.settings.node}")
        except Exception as exc:  # noqa: BLE001 - no catalog, no retention: the numbers still tell
            log.warning("Tier 0 retention for room failed: %s: %s", type(exc).__name__, exc)
            return
        pruned = [a for a in done if a.outcome == "pruned"]
        if pruned:
            log.info("Tier 0 retention dropped %d copies for room: %s", len(pruned),
                     ", ".join(f"{a.run}/{a.step}" for a in pruned))

    def _waiting(self) -> tuple[int | None, int]:
        from tasks import tier0_space  # deferred: start-up — Prefect, SQLAlchemy; the client imports this module

        try:
            return tier0_space.waiting_for_promotion(self.settings)
        except Exception as exc:  # noqa: BLE001
            log.warning("checkpoints waiting for promotion not known: %s: %s", type(exc).__name__, exc)
            return None, 0

    # --- headroom ----------------------------------------------------------------------------
    def _watch(self, run: str, step: int, free_after: int, needed: int) -> None:
        reading = Reading(0, free_after, needed, self.settings.tier_low_headroom_checkpoints)
        if headroom(0, self.root).crossed(reading):
            log.warning("Tier 0 of node %r at %s is low: %s free after %s/%d, %.1f checkpoints of %s "
                        "(the line is %g)", self.settings.node, self.root, fmt_bytes(max(free_after, 0)), run, step,
                        max(reading.headroom, 0), fmt_bytes(needed), reading.threshold)
            self.on_low(reading, run, step)


def _waiting_text(count: int | None, waiting: int) -> str:
    if count is None:
        return "what waits to be promoted is not known (catalog unreachable)"
    return (f"{count} checkpoint(s) ({fmt_bytes(waiting)}) on this node wait to be promoted to Tier 1 before "
            "retention may drop them")
