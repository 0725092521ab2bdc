"""One node of a cluster drill: a process that resumes its part cold, loads it and checks it.

Contract of ``drill_node``: resumes ``part`` of ``parts`` of ``run`` with ``tasks.resume.resume``
as a node that has nothing of its own (no Tier 0, the node label ``<node>-drill-<part>``) and
only ``tier`` to read from, so the drill measures that tier alone: Tier 1 read in place where it
is mounted here, else fetched (Tier 1 over fsspec, Tier 2) into ``dest``, a scratch folder that
is removed after. The part (its files plus the checkpoint-wide files its format needs) is then
loaded with the format's own loader and checked against the manifest
(``core.load_check``). Returns a ``NodeOutcome``; a failure to resume or to load is an outcome
with ``ok=False`` and the reason, never an exception (the drill records every node).

The bound's share of a node (``drain``): the same files read raw from the same tier with the
same streams, nothing checked, loaded or kept. The drill starts every node's drain at once, so
the bound is the tier's bandwidth as N nodes get it together (one process reading everything
would see a tier, and a machine, that N nodes do not).

As a process (``python -m tasks.drill_node SPEC_JSON``): imports everything, prints ``ready``,
waits for ``go`` on stdin (the common start; anything else, or the drill process gone, and it
exits doing nothing), then prints the outcome as one JSON line; then waits for ``drain`` (the
bound's common start; anything else and it exits) and prints its drain as one JSON line
(``{"bytes", "drained_at", "detail"}``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.errors import CkptError, CorruptCheckpoint, NotFound
from core.layout import checkpoint_prefix
from core.load_check import ManifestFile, framework, load_and_check
from core.settings import Settings

# light at import (no catalog, no Prefect): benchmarks/cluster_restore.py's node processes import it
# before they prepare; the pipeline modules are imported where they are used, and first in warm_up
from core.tiers import Tier
from db.entities import VERIFIED


@dataclass(frozen=True)
class NodeOutcome:
    part: int
    ok: bool
    started_at: float  # time.time() of the start signal as this node saw it
    loaded_at: float  # time.time() when its part was loaded and checked (or it failed)
    step: int | None = None
    tier_bytes: dict[str, int] = field(default_factory=dict)  # bytes read per tier ("local": the fetched copy)
    tensors: int = 0
    loader: str = ""
    source: str = ""
    detail: str | None = None


def drill_settings(settings: Settings, tier: int, part: int) -> Settings:
    """The settings of a cold node that may read ``tier`` only."""
    return settings.model_copy(update={
        "tier0_url": None, "node": f"{settings.node}-drill-{part}",
        "tier1_url": settings.tier1_url if tier == Tier.SHARED else None,
        "tier2_url": settings.tier2_url if tier == Tier.OBJECT else None})


def drill_node(settings: Settings, run: str, step: int, part: int, parts: int, tier: int, dest: Path,
               actor: str = "drill") -> NodeOutcome:
    """See the module contract. ``settings``: the cluster's own (this function narrows them)."""
    started = time.time()
    cold = drill_settings(settings, tier, part)
    try:
        return _resume_and_load(cold, run, step, part, parts, tier, dest, actor, started)
    except (CkptError, NotFound, OSError) as exc:
        return NodeOutcome(part, False, started, time.time(), detail=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def _resume_and_load(cold: Settings, run: str, step: int, part: int, parts: int, tier: int, dest: Path,
                     actor: str, started: float) -> NodeOutcome:
    from tasks.base import open_catalog  # deferred: start-up (keeps this module light: see warm_up)
    from tasks.replicas import TierStores  # deferred: start-up (keeps this module light: see warm_up)
    from tasks.resume import IN_PLACE, resume  # deferred: start-up (keeps this module light: see warm_up)

    with TierStores(cold) as stores:
        mounted = Tier(tier).shared_fs and stores.get(tier).in_place(checkpoint_prefix(run, step)) is not None
    point = resume(cold, run, part=part, parts=parts, to=None if mounted else dest, actor=actor)
    if point is None or point.step != step:
        got = "no checkpoint" if point is None else f"step {point.step}"
        return NodeOutcome(part, False, started, time.time(), detail=f"resumed {got}, not step {step}: "
                           f"{point.note if point else ''}"[:500])
    assert cold.catalog_url is not None
    with open_catalog(cold.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step)
        files = cat.files(ck.id)
    mine = part_files(files, part)
    try:
        checked = load_and_check(point.path, [ManifestFile(f.path, f.size, f.checksum) for f in mine], ck.format)
    except CorruptCheckpoint as exc:
        in_place = [p.tier for p in point.parts if p.source == IN_PLACE]
        if in_place:  # the copy on its tier is what failed: no one may trust it any more
            owner = next((f.part for f in mine if f.path == exc.path), part)
            _mark_corrupt(cold, ck.id, in_place[0], owner, exc, actor)
        raise
    loaded = time.time()
    tier_bytes: dict[str, int] = {}
    for p in point.parts:
        if p.source == IN_PLACE:
            tier_bytes[str(p.tier)] = tier_bytes.get(str(p.tier), 0) + checked.bytes
        else:
            tier_bytes[str(p.tier)] = tier_bytes.get(str(p.tier), 0) + p.bytes_moved
            tier_bytes["local"] = tier_bytes.get("local", 0) + checked.bytes
    source = ", ".join(sorted({f"tier {p.tier} {p.source}" for p in point.parts}))
    return NodeOutcome(part, True, started, loaded, step, tier_bytes, checked.tensors, checked.loader, source)


def _mark_corrupt(settings: Settings, checkpoint_id: int, tier: int, part: int, exc: Exception, actor: str) -> None:
    from tasks.base import open_catalog  # deferred: start-up (keeps this module light: see warm_up)
    from tasks.replicas import mark_bad  # deferred: start-up (keeps this module light: see warm_up)

    assert settings.catalog_url is not None
    with open_catalog(settings.catalog_url) as cat:
        for r in cat.replicas(checkpoint_id, tier):
            if r.part == part and r.state == VERIFIED:
                mark_bad(cat, r, "corrupt", f"drill: loading failed: {exc}", actor=actor)


def part_files(files: list[Any], part: int) -> list[Any]:
    """The files a node resuming ``part`` reads: its own and the checkpoint-wide files its format
    needs that another part holds (``tasks.resume.wide_files``)."""
    from tasks.resume import wide_files  # deferred: start-up (keeps this module light: see warm_up)

    return [f for f in files if f.part == part] + wide_files(files, [part])


def part_keys(settings: Settings, run: str, step: int, part: int) -> dict[str, int]:
    """The keys of ``part_files`` of ``run``/``step`` and their sizes, from the catalog."""
    from tasks.base import open_catalog  # deferred: start-up (keeps this module light: see warm_up)

    assert settings.catalog_url is not None
    with open_catalog(settings.catalog_url) as cat:
        files = cat.files(cat.get_checkpoint(run, step).id)
    prefix = checkpoint_prefix(run, step)
    return {f"{prefix}/{f.path}": f.size for f in part_files(files, part)}


def drain(settings: Settings, tier: int, objects: Mapping[str, int], *, streams: int | None = None) -> int:
    """Read ``objects`` (key -> size) raw from ``tier`` as a resume reads them, nothing checked
    or kept; the bytes read. The same streams: as many files at once as a fetch from that tier
    (``tasks.restore.fetch_streams``) unless ``streams`` says, each read as the store reads it
    for a fetch: on S3 an object of the ranged size as ranged GETs (their bytes dropped), any
    other one GET streamed in the fetch's chunks. Before, every object was one GET, so on S3 the
    bound was measured with other requests than the resume it bounds."""
    from tasks.replicas import TierStores  # deferred: start-up (keeps this module light: see warm_up)
    from tasks.restore import fetch_streams  # deferred: start-up (keeps this module light: see warm_up)

    def one(key: str) -> int:
        size = objects[key]
        reads_ranged = getattr(store, "reads_ranged", None)
        if reads_ranged is not None and reads_ranged(size):
            return int(store.read_ranges_into(key, null, size)[0])  # type: ignore[attr-defined]
        n = 0
        with store.open_read(key) as fh:
            while chunk := fh.read(store.read_chunk_bytes):  # as a fetch reads
                n += len(chunk)
        return n

    with TierStores(settings) as stores:
        store = stores.get(tier)
        local = bool(objects) and store.in_place(next(iter(objects)).rpartition("/")[0]) is not None
        width = streams or fetch_streams(settings, local)
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            with ThreadPoolExecutor(max(1, width)) as pool:
                return sum(pool.map(one, objects))
        finally:
            os.close(null)


def warm_up(settings: Settings, run: str) -> None:
    """What a trainer has done before it resumes: imported its loaders and the client,
    connected to the catalog once and built its S3 client (botocore parses its service model:
    CPU time, more on a loaded machine; the process's stores share the client),
    so that the drill times the resume, not the interpreter."""
    import tasks.copy  # deferred: start-up (warm_up is a node's import step)
    import tasks.restore  # deferred: start-up (warm_up is a node's import step)
    import tasks.resume  # deferred: start-up (warm_up is a node's import step)  # noqa: F401
    from tasks.base import open_catalog  # deferred: start-up (warm_up is a node's import step)
    from tasks.replicas import TierStores  # deferred: start-up (warm_up is a node's import step)

    framework()
    assert settings.catalog_url is not None
    with open_catalog(settings.catalog_url) as cat:
        cat.get_run(run)
    with TierStores(settings) as stores:
        if stores.configured(2):
            stores.get(2)


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    settings = Settings(**json.loads(Path(spec["settings"]).read_text()))
    warm_up(settings, spec["run"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":  # the drill was stopped before the start: do nothing
        sys.exit(3)
    outcome = drill_node(settings, spec["run"], spec["step"], spec["part"], spec["parts"], spec["tier"],
                         Path(spec["dest"]), spec.get("actor", "drill"))
    print(json.dumps(asdict(outcome)), flush=True)
    cold = drill_settings(settings, spec["tier"], spec["part"])
    try:
        keys, detail = part_keys(cold, spec["run"], spec["step"], spec["part"]), None
    except (CkptError, NotFound, OSError) as exc:
        keys, detail = {}, f"{type(exc).__name__}: {exc}"[:500]
    if sys.stdin.readline().strip() != "drain":
        return
    n = 0
    if detail is None:
        try:
            n = drain(cold, spec["tier"], keys)
        except (CkptError, NotFound, OSError) as exc:
            detail = f"{type(exc).__name__}: {exc}"[:500]
    print(json.dumps({"bytes": n, "drained_at": time.time(), "detail": detail}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
