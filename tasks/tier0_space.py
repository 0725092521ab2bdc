"""Room on this node's Tier 0 for the next save: the one way the training side asks for it.

``retain_tier0_here`` applies Tier 0 retention to this node's NVMe only, through the same
guarded prune as every other retention (a copy goes only while a verified copy at least as
durable protects it, checked on its tier at that moment), so asking for room can never lose a
checkpoint: what is not yet promoted stays. ``waiting_for_promotion`` says how much of this
node's Tier 0 is held for that reason, for the error a save raises when room did not come.
``sweep_dead_staging`` removes the staging folders whose writer is gone (a save or fetch
killed midway: nothing else would ever free that room); the room check and reconcile run it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from core.settings import Settings
from core.space import STAGING_IDLE_S, Staging, writer_stagings
from db.entities import PRUNED, PRUNING
from tasks.base import log, open_catalog
from tasks.prune import prune_replica
from tasks.retention import PruneAction, apply_retention, plan_retention

WAITING_LIMIT = 200  # unpromoted checkpoints looked at; a node with more is far behind anyway


def retain_tier0_here(settings: Settings, *, actor: str) -> list[PruneAction]:
    """Tier 0 retention of ``settings.node``, applied now; each action with its outcome."""
    if not settings.retention(0).lets_go:
        return []
    plan = plan_retention(settings, tiers=(0,), node=settings.node)
    return apply_retention(settings, plan, prune=prune_replica, actor=actor)


def waiting_for_promotion(settings: Settings) -> tuple[int, int]:
    """(checkpoints, bytes) on this node's Tier 0 that the catalog has not seen promoted to
    Tier 1 yet (at most ``WAITING_LIMIT`` checkpoints looked at)."""
    count = total = 0
    with open_catalog(settings.catalog_url) as cat:
        for ck in cat.unpromoted(limit=WAITING_LIMIT):
            here = [r for r in cat.replicas(ck.id, tier=0)
                    if r.node == settings.node and r.state not in (PRUNING, PRUNED)]
            if here:
                count += 1
                total += sum(r.bytes or 0 for r in here)
    return count, total


def sweep_dead_staging(settings: Settings, root: Path, *, actor: str) -> list[Staging]:
    """Remove the staging folders of dead writers in the run folders of this node's Tier 0 at
    ``root`` (``core.space.writer_stagings``); the ones removed. Each is audited before it goes
    where the catalog can be reached (staging is no checkpoint: an unreachable catalog does not
    keep the room held); a link is removed itself, never followed; one gone meanwhile is skipped."""
    removed = []
    for st in writer_stagings(root):
        if not st.dead:
            continue
        why = (f"staging of a dead writer (pid {st.pid} gone on node {settings.node}, or no write for "
               f"{STAGING_IDLE_S:.0f} s), {st.bytes} bytes")
        _audit(settings, f"staging:{st.path.parent.name}/{st.path.name}@tier0:{settings.node}", why,
               actor=actor, run=st.path.parent.name)
        try:
            if st.path.is_symlink() or not st.path.is_dir():
                st.path.unlink()
            else:
                shutil.rmtree(st.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("Tier 0 at %s: could not remove %s: %s", root, st.path, exc)
            continue
        removed.append(st)
    if removed:
        log.info("Tier 0 at %s: removed %d staging folder(s) of dead writers (%d bytes)", root, len(removed),
                 sum(st.bytes for st in removed))
    return removed


def _audit(settings: Settings, subject: str, reason: str, *, actor: str, run: str) -> None:
    try:
        with open_catalog(settings.catalog_url) as cat:
            cat.record_deletion(subject, reason, actor=actor, run=run)
    except Exception as exc:  # noqa: BLE001 - the catalog down never keeps a dead writer's room held
        log.warning("deletion of %s not audited (catalog: %s: %s)", subject, type(exc).__name__, exc)
