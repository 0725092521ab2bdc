"""The client registers its run, and the run's origin, in the catalog (SQLite and PostgreSQL)."""

from __future__ import annotations

import numpy as np
import pytest

from ckpt.client import CheckpointStager
from db.catalog import Catalog, upgrade


def _tensors(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1024, seed, dtype=np.float32)}


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch):
    monkeypatch.setattr("ckpt.announce.EMIT_BACKOFF_SECONDS", 0.01)  # events go nowhere here
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def _stager(settings, run, **kw):
    # events go nowhere (nothing listens there); registration still happens
    return CheckpointStager(run, settings=settings, shard_bytes=1 << 20, **kw)


def _base(settings_factory, db_url, step):
    """Settings on the catalog ``db_url`` and run "base" with checkpoint ``step`` committed on
    Tier 0 (not yet registered: its promotion has not run)."""
    upgrade(db_url)
    s = settings_factory(catalog_url=db_url, prefect_api_url="http://127.0.0.1:9/api")
    with _stager(s, "base") as st:
        return s, st.save(step, _tensors(1))


def test_run_is_registered_with_its_origin(settings_factory, db_url):
    s, base = _base(settings_factory, db_url, 10)
    cat = Catalog(db_url)
    try:
        assert cat.get_run("base").parent_run is None
        cat.register_part(base.manifest, actor="test")  # what the promote flow does
        with _stager(s, "child", resumed_from=("base", 10)) as st:
            st.save(11, _tensors(2))
        child = cat.get_run("child")
        assert (child.parent_run, child.parent_step, child.parent_relation) == ("base", 10, "resumed_from")
    finally:
        cat.close()


def test_origin_not_yet_in_the_catalog_is_recorded_later(settings_factory, db_url):
    """Resuming from a checkpoint whose promotion is still running: the run is registered at
    once with its origin, pending (it protects the origin already; its checkpoints can be
    promoted); the edge comes as soon as the catalog has the origin."""
    s, base = _base(settings_factory, db_url, 20)
    cat = Catalog(db_url)
    try:
        child = _stager(s, "child2", fine_tuned_from=("base", 20))
        saved = child.save(21, _tensors(2))
        child._announcer._q.join()
        run = cat.get_run("child2")
        assert (run.parent_run, run.parent_step, run.parent_relation) == ("base", 20, "fine_tuned_from")
        cat.register_part(saved.manifest, actor="test")
        assert cat.ancestors("child2", 21) == []  # pending
        cat.register_part(base.manifest, actor="test")
        child.close()
        edges = cat.ancestors("child2", 21)
        assert [(e.parent_run, e.parent_step, e.relation) for e in edges] == [("base", 20, "fine_tuned_from")]
    finally:
        cat.close()
