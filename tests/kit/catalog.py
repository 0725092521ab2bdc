"""Helpers shared by the catalog tests: a fresh, upgraded catalog on each backend, manifests,
and a way to bring a replica into any state through legal moves only."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from core.manifest import FileEntry, Manifest, ParentRef
from db.catalog import Catalog
from db.entities import COPYING, CORRUPT, MISSING, PENDING, PRUNED, PRUNING, VERIFIED


@contextmanager
def at_revision(url: str, revision: str) -> Iterator[tuple]:
    """A catalog migrated only up to ``revision`` (an old release's): yields a connection in one
    transaction and the tables as they were then, to fill with that release's rows."""
    import sqlalchemy as sa

    from db.migrate import upgrade_connection
    from db.session import make_engine

    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            upgrade_connection(conn, revision)
        with engine.begin() as conn:
            md = sa.MetaData()
            md.reflect(conn)
            yield conn, md.tables
    finally:
        engine.dispose()


@pytest.fixture
def catalog(db_url):
    cat = Catalog.open(db_url, auto_upgrade=True)
    yield cat
    cat.close()


def manifest(run: str, step: int, *, part: int = 0, parts: int = 1, kind: str = "step", n_files: int = 2,
             size: int = 1000, salt: str = "", metrics: dict | None = None,
             parent: tuple[str, int, str] | None = None, node: str = "node-0", attempt: str = "") -> Manifest:
    files = tuple(FileEntry(f"shard-{part}-{i}.safetensors", size,
                            f"{zlib.crc32(f'{run}/{step}/{part}/{i}/{salt}{attempt}'.encode()):08x}")
                  for i in range(n_files))
    return Manifest(run=run, step=step, files=files, part=part, parts=parts, kind=kind, node=node,
                    metrics=metrics or {}, parent=ParentRef(*parent) if parent else None, attempt=attempt)


def checkpoint(cat: Catalog, run: str, step: int, **kw):
    """Register a single-part checkpoint (creating the run) and return its CheckpointInfo."""
    cat.ensure_run(run)
    return cat.register_part(manifest(run, step, **kw), actor="test")


def verified(cat: Catalog, checkpoint_id: int, tier: int, part: int = 0):
    """A replica brought to ``verified`` through claim -> verified; returns ReplicaInfo."""
    claim = cat.claim_copy(checkpoint_id, tier, part, f"file:///tier{tier}/{checkpoint_id}/{part}", node=None,
                           actor="test")
    assert claim.acquired
    return cat.transition(claim.replica.id, VERIFIED, expected=COPYING, claim_token=claim.replica.claim_token,
                          actor="test", bytes=2000)


def timed_hop(cat: Catalog, checkpoint_id: int, tier: int, *, seconds: float | None,
              first_byte: float | None = None, bytes: int = 5 * 10**9, part: int = 0):
    """A copy of ``part`` into ``tier`` recorded as the pipeline records it: claimed, then
    verified with the hop's duration and first-byte latency; returns ReplicaInfo."""
    claim = cat.claim_copy(checkpoint_id, tier, part, f"file:///tier{tier}/{checkpoint_id}/{part}", node=None,
                           actor="test")
    return cat.transition(claim.replica.id, VERIFIED, expected=COPYING, claim_token=claim.replica.claim_token,
                          actor="test", bytes=bytes, copy_seconds=seconds, first_byte_seconds=first_byte)


# Legal paths from a fresh claim (copying) to every state.
PATHS = {
    COPYING: [],
    VERIFIED: [VERIFIED],
    PRUNING: [VERIFIED, PRUNING],
    PRUNED: [VERIFIED, PRUNING, PRUNED],
    CORRUPT: [CORRUPT],
    MISSING: [MISSING],
}


def replica_in_state(cat: Catalog, checkpoint_id: int, tier: int, state: str):
    """A replica on ``tier`` in ``state`` (``pending`` is not reachable through the API once a
    claim exists, so it is the row ``claim_copy`` creates; callers test it separately)."""
    assert state != PENDING
    claim = cat.claim_copy(checkpoint_id, tier, 0, f"file:///tier{tier}/{checkpoint_id}", node=None, actor="test")
    rep = claim.replica
    for to in PATHS[state]:
        rep = cat.transition(rep.id, to, actor="test", claim_token=rep.claim_token if rep.state == PRUNING else None)
    return rep


def prunable_setup(cat: Catalog, run: str = "r"):
    """A run with step 100 verified on tier 2 and a newer step 200 verified (so 100 is neither
    the newest nor without another durable copy); returns step 100's CheckpointInfo."""
    old = checkpoint(cat, run, 100)
    verified(cat, old.id, 2)
    verified(cat, checkpoint(cat, run, 200).id, 1)
    return old


def prune_worker(url: str, replica_ids: list[int], barrier, results) -> None:
    """Run in a thread or a separate process: for each replica, wait for the other worker,
    then try to start its prune; report (replica id, 'won' or the error's class name)."""
    cat = Catalog(url)
    try:
        for rid in replica_ids:
            barrier.wait(timeout=60)
            try:
                cat.begin_prune(rid, actor="racer")
                results.put((rid, "won"))
            except Exception as exc:  # the loser's error is the outcome under test
                results.put((rid, type(exc).__name__))
    finally:
        cat.close()


def catalog_cli(monkeypatch, tmp_path, db_url: str, **env: str):
    """A ``run(*args) -> output`` of the real CLI (Typer's runner) on the catalog at ``db_url``,
    in ``tmp_path`` with ``CKPT_*`` cleared but for ``env`` (names without the prefix); a
    non-zero exit fails the test with the output."""
    import os

    from typer.testing import CliRunner

    from ckpt.cli import app

    for key in list(os.environ):
        if key.startswith("CKPT_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_CATALOG_URL", db_url)
    for key, value in env.items():
        monkeypatch.setenv(f"CKPT_{key}", value)
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    return run
