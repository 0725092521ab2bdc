"""Checkpoints on disk and their replicas in the catalog: write a real checkpoint folder and
commit it with its manifest, find its folders and files on a tier, damage its bytes, and read
back the states of its replicas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from core.layout import checkpoint_dirname
from core.manifest import Manifest


def ckpt_dir(root: Path | str, run: str, step: int) -> Path:
    """The folder of a checkpoint under a tier root (``<root>/<run>/step-NNNNNNNN``)."""
    return Path(root) / run / checkpoint_dirname(step)


def committed_ago(root: Path | str, run: str, step: int, seconds: float) -> None:
    """Date a committed checkpoint's files ``seconds`` back, as if the job had written it then (a
    part whose completed event was lost, seen by a reconcile pass later)."""
    import os
    import time

    then = time.time() - seconds
    for path in ckpt_dir(root, run, step).rglob("*"):
        os.utime(path, (then, then))


def commit_manifest(folder: Path, run: str, step: int, **manifest: Any) -> Manifest:
    """Commit a checkpoint folder: its manifest is built from the bytes there and written last."""
    from core.manifest_build import build_manifest, write_manifest

    m = build_manifest(folder, run, step, **manifest)
    write_manifest(folder, m)
    return m


def write_checkpoint(tier0_root: Path | str, run: str, step: int, *, shards: int = 2, shard_bytes: int = 1 << 20,
                     kind: str = "step", part: int = 0, parts: int = 1, node: str = "node-0",
                     metrics: dict[str, float] | None = None, tags: dict[str, str] | None = None,
                     seed: int = 0) -> Manifest:
    """A Hugging Face sharded safetensors checkpoint (part) committed on Tier 0 with its manifest."""
    from safetensors.numpy import save_file

    folder = ckpt_dir(tier0_root, run, step)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed * 1_000_003 + step * 101 + part)
    weight_map = {}
    for i in range(shards):
        name = (f"model-p{part:02d}-{i:05d}.safetensors" if parts > 1
                else f"model-{i + 1:05d}-of-{shards:05d}.safetensors")
        tensor = f"layer{part}.{i}.weight"
        save_file({tensor: rng.standard_normal(shard_bytes // 4, dtype=np.float32)}, str(folder / name))
        weight_map[tensor] = name
    if parts > 1 and part == 0:  # rank 0 writes the index of every part's shards
        weight_map = {f"layer{p}.{i}.weight": f"model-p{p:02d}-{i:05d}.safetensors"
                      for p in range(parts) for i in range(shards)}
    if part == 0:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": parts * shards * shard_bytes}, "weight_map": weight_map}))
    return commit_manifest(folder, run, step, part=part, parts=parts, node=node, kind=kind, metrics=metrics,
                           tags=tags, fmt="hf-sharded")


def shard_paths(root: Path | str, run: str, step: int) -> list[Path]:
    return sorted(ckpt_dir(root, run, step).glob("*.safetensors"))


def published_files(root: Path | str, run: str, step: int) -> list[str]:
    """Relative paths under a checkpoint folder, staging files included (they must not linger)."""
    d = ckpt_dir(root, run, step)
    if not d.exists():
        return []
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def flip_bit(path: Path, offset: int | None = None) -> None:
    """Flip one bit of a stored file in place: same size, wrong bytes (silent corruption).
    ``offset`` counts from the end when negative; by default two thirds into the file, which in
    a safetensors shard is tensor data, not the header."""
    size = path.stat().st_size
    pos = size - size // 3 if offset is None else offset % size if offset < 0 else offset
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x10]))


def truncate(path: Path, keep: float = 0.5) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(int(path.stat().st_size * keep))


def same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def open_catalog(settings):
    """A catalog on the settings' URL (close it, or use it in a ``with``)."""
    from db.catalog import Catalog

    return Catalog(settings.catalog_url)


def replica_states(settings, run: str, step: int) -> dict[tuple[int, int], str]:
    """{(tier, part): state} of a checkpoint's replicas (Tier 0 of every node folded)."""
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(run, step)
        return {(r.tier, r.part): r.state for r in cat.replicas(ck.id)}


def expire_claims(settings) -> int:
    """Make every live claim's lease lapse now, as if its worker died a lease ago (tests never
    wait on a wall clock for a lease to run out); returns how many were expired."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from db.models import Replica

    replicas = Replica.__table__
    cat = open_catalog(settings)
    try:
        past = datetime.now(UTC) - timedelta(days=1)
        with cat.engine.begin() as conn:
            return conn.execute(update(replicas).where(replicas.c.lease_expires_at.is_not(None))
                                .values(lease_expires_at=past)).rowcount
    finally:
        cat.close()
