"""prune: delete one replica's files through the catalog's guarded prune.

``catalog.begin_prune`` decides, in one transaction, whether this copy may go (another verified
copy at least as durable exists; not the newest verified checkpoint of its run; not pinned or
aliased); a refusal raises ``PruneRefused``, a normal outcome that retention reports. The part's
manifest (its commit marker) is deleted first, so a half-deleted part never looks committed;
then its files. A prune interrupted after the manifest went is resumed by the next call
(the replica is still ``pruning``); one that fails before deleting anything returns the replica
to ``verified``.
"""

from __future__ import annotations

from dataclasses import dataclass

from core import events
from core.errors import CkptError, ConfigError
from core.layout import part_key
from core.settings import Settings
from db.entities import PRUNED, PRUNING, VERIFIED, ReplicaInfo
from tasks.base import delete_part, log, open_catalog, open_tier
from tasks.retry import pipeline_task


@dataclass(frozen=True)
class Pruned:
    replica_id: int
    run: str
    step: int
    tier: int
    part: int
    deleted: int  # objects deleted
    bytes: int | None


def prune_replica(settings: Settings, replica_id: int, *, actor: str = "cli", reason: str | None = None) -> Pruned:
    """Guarded delete of one replica; raises ``PruneRefused`` when the catalog says no."""
    with open_catalog(settings.catalog_url) as cat:
        rep = cat.get_replica(replica_id)
        if rep.tier == 0 and rep.node and rep.node != settings.node:
            raise ConfigError(f"replica {replica_id} is on node {rep.node!r}'s Tier 0; prune it there")
        resumed = rep.state == PRUNING  # a prune interrupted after its first delete: finish it
        if not resumed:
            rep = cat.begin_prune(replica_id, actor=actor, reason=reason)
        parts = cat.get_checkpoint(rep.run, rep.step).parts
        with open_tier(settings, rep.tier) as store:
            try:
                deleted = int(store.delete(part_key(rep.run, rep.step, rep.part, parts)))
            except BaseException:
                # only while the manifest is provably still there is it still a good copy; when
                # that can't be told, the replica stays ``pruning`` and the next call finishes it
                if not resumed and _still_committed(store, part_key(rep.run, rep.step, rep.part, parts)):
                    _abandon(cat, rep, actor)
                raise
            why = ("finishing an interrupted prune" if resumed else "prune") + (f": {reason}" if reason else "")
            deleted += delete_part(cat, store, rep.run, rep.step, rep.part, parts, reason=why, actor=actor)
        cat.transition(rep.id, PRUNED, expected=PRUNING, actor=actor, reason=reason)
    events.announce(events.PRUNED, rep.run, rep.step, part=rep.part, parts=parts, node=rep.node or "",
           extra_id=f"tier{rep.tier}", payload={"tier": rep.tier, "bytes": rep.bytes, "url": rep.url})
    return Pruned(replica_id=rep.id, run=rep.run, step=rep.step, tier=rep.tier, part=rep.part,
                  deleted=deleted, bytes=rep.bytes)


def _still_committed(store, key: str) -> bool:
    try:
        return store.stat(key) is not None
    except Exception:  # noqa: BLE001 - unknown counts as gone: never return a doubtful copy to verified
        return False


def _abandon(cat, rep: ReplicaInfo, actor: str) -> None:
    """Nothing was deleted: ``pruning -> verified``, the copy stays usable."""
    try:
        cat.transition(rep.id, VERIFIED, expected=PRUNING, actor=actor, reason="prune abandoned before delete")
    except CkptError as exc:
        log.warning("replica %s: could not abandon the prune: %s", rep.id, exc)


prune_task = pipeline_task(prune_replica, name="prune")
