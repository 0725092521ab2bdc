"""restore drill: time how long a cold machine takes to get the newest milestone back.

Contract of ``restore_drill``: picks the newest committed milestone (of ``run``, or of all
runs) and, for each durable tier holding a verified copy of it (1, then 2), restores it with
that tier alone (no fallback: a drill measures one tier) into an empty scratch folder, reads
the result back in full against the catalog's manifest (bytes and format), records the
recovery time per tier (``Catalog.record_drill``: ok, seconds, bytes, what went wrong) and
removes the scratch folder. A tier without a verified copy is skipped and said so; a restore
or a check that fails is recorded ``ok=False`` (its bad replica is marked by the restore).
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import transfer
from core.errors import BadInput, CkptError, NotFound
from core.layout import checkpoint_prefix
from core.policy import is_milestone
from core.settings import MilestonePolicy, Settings
from core.storage.local import LocalStore
from db.catalog import Catalog
from db.entities import CKPT_COMMITTED, VERIFIED, CheckpointInfo, DrillResult
from tasks.base import log, open_catalog, registered_manifest
from tasks.drill_node import NodeOutcome
from tasks.restore import restore_checkpoint
from tasks.retry import pipeline_task

DRILL_TIERS = (1, 2)


@dataclass
class DrillReport:
    run: str | None
    step: int | None
    results: list[DrillResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def rows(self) -> list[dict[str, Any]]:
        return [drill_row(r) for r in self.results]


def drill_row(r: DrillResult) -> dict[str, Any]:
    """One drill as a flat record (the artifact's table, ``ckpt drills --json``)."""
    return {"at": r.at.isoformat(), "run": r.run, "step": r.step, "tier": r.tier, "ok": r.ok,
            "seconds": round(r.seconds, 3), "bytes": r.bytes,
            "MB/s": round(r.bytes / 1e6 / r.seconds, 1) if r.seconds > 0 else 0.0, "detail": r.detail or ""}


def newest_milestone(cat: Catalog, run: str | None, policy: MilestonePolicy) -> CheckpointInfo | None:
    """The newest committed milestone of ``run`` (by step), or across runs (by commit time),
    by the same rule the archive uses (``core.policy.is_milestone``)."""
    found = [c for c in cat.list_checkpoints(run)
             if c.state == CKPT_COMMITTED and is_milestone(c.kind, c.step, c.tags, policy)]
    if not found:
        return None
    if run is not None:
        return max(found, key=lambda c: c.step)
    return max(found, key=lambda c: (c.committed_at or c.created_at, c.step))


def restore_drill(settings: Settings, *, run: str | None = None, scratch: str | Path | None = None,
                  tiers: tuple[int, ...] = DRILL_TIERS, actor: str = "cli") -> DrillReport:
    """Drill the newest milestone on each tier in ``tiers``; see the module contract."""
    base = Path(scratch) if scratch else Path(settings.data_dir).expanduser().absolute() / "drills"
    with open_catalog(settings.catalog_url) as cat:
        ck = newest_milestone(cat, run, settings.milestones)
        if ck is None:
            return DrillReport(run, None, skipped=[f"no committed milestone{' of ' + run if run else ''} to drill"])
        held = {loc.tier for loc in cat.locations(ck.run, ck.step)}
        report = DrillReport(ck.run, ck.step)
        for tier in tiers:
            if tier not in held or not settings.tier_url(tier):
                report.skipped.append(f"tier {tier}: no verified copy of {ck.run}/step-{ck.step}")
                continue
            ok, seconds, detail = _drill_one(cat, settings, ck, tier, base / f"drill-{uuid.uuid4().hex[:8]}", actor)
            report.results.append(cat.record_drill(ck.run, ck.step, tier, ok=ok, seconds=seconds,
                                                   bytes=ck.total_bytes if ok else 0, detail=detail, actor=actor))
            log.info("drill %s/step-%d tier %d: %s in %.2f s %s", ck.run, ck.step, tier,
                     "ok" if ok else "FAILED", seconds, detail or "")
    return report


def _drill_one(cat: Catalog, settings: Settings, ck: CheckpointInfo, tier: int, scratch: Path,
               actor: str) -> tuple[bool, float, str | None]:
    """Restore from ``tier`` alone into ``scratch`` (removed after), check it; (ok, seconds, detail)."""
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    started = time.monotonic()
    try:
        restore_checkpoint(settings, ck.run, scratch / prefix, step=ck.step, preference=(tier,),
                           fallback=False, actor=actor)
        seconds = time.monotonic() - started
        restored = LocalStore(scratch, 0, buffer_bytes=settings.io_buffer_bytes)
        for part in range(ck.parts):
            manifest = registered_manifest(cat, restored, ck.id, ck.run, ck.step, part, ck.parts,
                                                   attempt=ck.attempt)
            transfer.verify_part(restored, prefix, manifest, parallelism=settings.copy_parallelism,
                                 buffer_bytes=settings.io_buffer_bytes, deep=True)
        return True, seconds, None
    except (CkptError, NotFound) as exc:
        return False, time.monotonic() - started, f"{type(exc).__name__}: {exc}"[:500]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


restore_drill_task = pipeline_task(restore_drill, name="restore-drill", retries=0)


# --- the cluster drill: N nodes resume their parts at once ------------------------------------
NODE_READY_TIMEOUT_S = 120.0  # a node process imports the product before it says ready
NODE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ClusterDrill:
    """One cluster drill of ``run``/``step`` from ``tier``, as recorded (``result``) with each
    node's outcome (``tasks.drill_node.NodeOutcome``)."""

    result: DrillResult
    outcomes: list[Any]
    drained: list[int] = field(default_factory=list)  # bytes each node read raw for the bound, by part

    def row(self) -> dict[str, Any]:
        return cluster_row(self.result)


def cluster_row(r: DrillResult) -> dict[str, Any]:
    """A drill as a flat record with its cluster figures (``ckpt drill --json``, the artifact)."""
    return drill_row(r) | {"nodes": r.nodes, "rto_seconds": round(r.seconds, 3),
                           "bound_seconds": None if r.bound_seconds is None else round(r.bound_seconds, 3),
                           "tier_bytes": r.tier_bytes or {}, "node_seconds": r.node_seconds or []}


def newest_on_tier(cat: Catalog, run: str, tier: int) -> CheckpointInfo | None:
    """The newest committed checkpoint of ``run`` with a verified copy of every part on ``tier``."""
    for ck in sorted((c for c in cat.list_checkpoints(run) if c.state == CKPT_COMMITTED),
                     key=lambda c: c.step, reverse=True):
        held = {r.part for r in cat.replicas(ck.id, tier) if r.state == VERIFIED}
        if held >= set(range(ck.parts)):
            return ck
    return None


def cluster_drill(settings: Settings, *, run: str | None = None, nodes: int | None = None,
                  tiers: tuple[int, ...] = DRILL_TIERS, scratch: str | Path | None = None,
                  actor: str = "cli") -> tuple[list[ClusterDrill], list[str]]:
    """Drill ``run`` (default: the run of the newest milestone) on each tier of ``tiers``: its
    newest checkpoint held whole there, every part resumed at once by its own process (``nodes``
    must be the checkpoint's parts; default: that). Returns the recorded drills and what was
    skipped, and why."""
    base = Path(scratch) if scratch else Path(settings.data_dir).expanduser().absolute() / "drills"
    done, skipped = [], []
    with open_catalog(settings.catalog_url) as cat:
        if run is None:
            newest = newest_milestone(cat, None, settings.milestones)
            if newest is None:
                return [], ["no committed milestone to drill (give --run)"]
            run = newest.run
        for tier in tiers:
            ck = newest_on_tier(cat, run, tier) if settings.tier_url(tier) else None
            if ck is None:
                skipped.append(f"tier {tier}: no checkpoint of {run} held whole there")
                continue
            if nodes is not None and nodes != ck.parts:
                raise BadInput(f"{run}/step-{ck.step} has {ck.parts} part(s): a drill resumes each on its own "
                               f"node, so --nodes must be {ck.parts}, not {nodes}")
            where = base / f"cluster-{uuid.uuid4().hex[:8]}"
            try:
                outcomes, go, (bound, drained) = _run_nodes(settings, ck, tier, where, actor)
            finally:
                shutil.rmtree(where, ignore_errors=True)
            done.append(ClusterDrill(_record(cat, ck, tier, outcomes, go, bound, actor), outcomes, drained))
    return done, skipped


def require_drilled(drills: list[ClusterDrill], skipped: list[str]) -> None:
    """``NotFound`` naming why, when ``cluster_drill`` drilled no tier: a drill from cron, CI or
    the schedule that found nothing to drill has not shown that anything can be recovered, so
    it must not end as a success."""
    if not drills:
        raise NotFound("restore drill: nothing was drilled (" + "; ".join(skipped or ["no tier to drill"]) + ")")


def _run_nodes(settings: Settings, ck: CheckpointInfo, tier: int, where: Path,
               actor: str) -> tuple[list[Any], float, tuple[float | None, list[int]]]:
    """Start one process per part, wait until all are ready, start them at once; when each has
    said its outcome, start their drains at once (``tasks.drill_node``: the bound). Their
    outcomes, the common start (time.time()) and the bound with each node's bytes (``_bound``)."""
    import json
    import subprocess
    import sys

    where.mkdir(parents=True, exist_ok=True)
    spec_file = where / "settings.json"
    spec_file.write_text(settings.model_dump_json())
    procs = []
    try:
        for part in range(ck.parts):
            spec = {"settings": str(spec_file), "run": ck.run, "step": ck.step, "part": part, "parts": ck.parts,
                    "tier": tier, "dest": str(where / f"node-{part}"), "actor": actor}
            procs.append(subprocess.Popen([sys.executable, "-m", "tasks.drill_node", json.dumps(spec)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            line = _readline(p, NODE_READY_TIMEOUT_S)
            if line.strip() != "ready":
                raise CkptError(f"a drill node did not start: {line.strip()[:200] or 'no output'}")
        go = _say(procs, "go")
        outcomes = []
        for part, p in enumerate(procs):
            line = _readline(p, NODE_TIMEOUT_S)
            try:
                outcomes.append(NodeOutcome(**json.loads(line)))
            except (ValueError, TypeError):
                outcomes.append(NodeOutcome(part, False, go, time.time(),
                                            detail=f"node process exited {p.poll()}: {line.strip()[:200]}"))
        return outcomes, go, _bound(procs, ck, tier)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _say(procs: list[Any], word: str) -> float:
    """Send ``word`` to every node at once (the common start); when (time.time())."""
    at = time.time()
    for p in procs:
        try:
            p.stdin.write(f"{word}\n")
            p.stdin.flush()
        except OSError:  # a node that already exited: its missing answer says so
            pass
    return at


def _bound(procs: list[Any], ck: CheckpointInfo, tier: int) -> tuple[float | None, list[int]]:
    """Every node drains its part raw at once: (first start -> last byte, the bytes each node
    read), the seconds None when a node could not read its files back (the drill is recorded
    either way)."""
    import json

    start = _say(procs, "drain")
    ends: list[float] = []
    drained: list[int] = []
    for part, p in enumerate(procs):
        line = _readline(p, NODE_TIMEOUT_S)
        try:
            got = json.loads(line)
        except ValueError:
            got = {"detail": f"node process exited {p.poll()}"}
        if got.get("detail") or "drained_at" not in got:
            log.warning("drill %s/step-%d: no bound measured on tier %d: part %d: %s", ck.run, ck.step, tier,
                        part, got.get("detail"))
            return None, drained
        ends.append(got["drained_at"])
        drained.append(got["bytes"])
    return max(ends) - start, drained


def _readline(proc: Any, timeout: float) -> str:
    """One line of ``proc``'s stdout, or '' when it exits or ``timeout`` passes first."""
    import threading

    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return got[0] if got else ""


def _record(cat: Catalog, ck: CheckpointInfo, tier: int, outcomes: list[Any], go: float, bound: float | None,
            actor: str) -> DrillResult:
    ok = all(o.ok for o in outcomes)
    tier_bytes: dict[str, int] = {}
    for o in outcomes:
        for t, n in o.tier_bytes.items():
            tier_bytes[t] = tier_bytes.get(t, 0) + n
    node_seconds = [round(o.loaded_at - go, 4) for o in outcomes]
    failed = [f"part {o.part}: {o.detail}" for o in outcomes if not o.ok]
    detail = "; ".join(failed)[:1000] if failed else ", ".join(sorted({o.source for o in outcomes}))
    result = cat.record_drill(ck.run, ck.step, tier, ok=ok, seconds=max(node_seconds),
                              bytes=tier_bytes.get(str(tier), 0), detail=detail, actor=actor,
                              nodes=len(outcomes), bound_seconds=bound, tier_bytes=tier_bytes,
                              node_seconds=node_seconds)
    log.info("cluster drill %s/step-%d tier %d, %d nodes: %s, RTO %.2f s, bound %s s", ck.run, ck.step, tier,
             len(outcomes), "ok" if ok else "FAILED", result.seconds, "-" if bound is None else f"{bound:.2f}")
    return result


cluster_drill_task = pipeline_task(cluster_drill, name="cluster-drill", retries=0)
