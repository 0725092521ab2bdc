"""A run's origin travels in its checkpoints' manifests: the catalog rebuilt from manifests alone
has the lineage, a run with an origin protects it from retirement before its first checkpoint,
a retired origin is recorded loudly, an unknown one stays pending until its checkpoint is
registered (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from ckpt.client import CheckpointStager
from core.errors import PruneRefused
from db.catalog import Catalog
from tasks.register import register_stored_part
from tests.kit.catalog import catalog_cli, checkpoint, manifest, verified
from tests.kit.settings import catalog_settings

BASE, CHILD = "base", "child"


def _tensors(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.full(256, seed, dtype=np.float32)}


def _job(settings, run: str, steps: tuple[int, ...], **origin) -> None:
    """A training job that never reaches the catalog: the manifests on Tier 0 are all it leaves."""
    with CheckpointStager(run, settings=settings, announce=False, shard_bytes=1 << 20, **origin) as st:
        for step in steps:
            st.save(step, _tensors(step))


_KILLED_JOB = """
import os, sys
import numpy as np
from ckpt.client import CheckpointStager
st = CheckpointStager("child", resumed_from=("base", 200), shard_bytes=1 << 20)
for step in (300, 600):
    st.save(step, {"w": np.full(256, step, dtype=np.float32)})
os._exit(0)  # killed right after save(): whatever the announcer had not done yet is lost
"""


def _child_job(settings, how: str) -> None:
    """The child run's job, resumed from base/200, that leaves its origin to the manifests only."""
    if how == "announce-off":
        _job(settings, CHILD, (300, 600), resumed_from=(BASE, 200))
    elif how == "catalog-unreachable":
        away = settings.model_copy(update={"catalog_url": "postgresql://nobody@127.0.0.1:9/none"})
        with CheckpointStager(CHILD, settings=away, resumed_from=(BASE, 200), shard_bytes=1 << 20) as st:
            for step in (300, 600):
                st.save(step, _tensors(step))
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "PREFECT_API_URL"))}
        env.update(CKPT_DATA_DIR=str(settings.data_dir), CKPT_NODE=settings.node,
                   CKPT_CATALOG_URL=settings.catalog_url)
        subprocess.run([sys.executable, "-c", _KILLED_JOB], env=env, check=True, timeout=120)


def _origin_edges(cat: Catalog, run: str, step: int) -> list[tuple[str, int, str, int, str]]:
    return [(e.child_run, e.child_step, e.parent_run, e.parent_step, e.relation)
            for e in cat.ancestors(run, step) if e.parent_run != e.child_run]


@pytest.fixture
def settings(settings_factory, db_url):
    return catalog_settings(settings_factory, db_url)


@pytest.mark.parametrize(("how", "parent_first"), [("announce-off", True), ("announce-off", False),
                                                   ("catalog-unreachable", False), ("killed-after-save", False)])
def test_catalog_rebuilt_from_manifests_alone_has_the_lineage(settings, how, parent_first, monkeypatch, tmp_path,
                                                              db_url):
    """The child job never registers its origin: registering the parts found on Tier 0 (what
    promote and reconcile do), in either order, gives the child's checkpoints their origin, and
    retention keeps base/200 as the child's parent."""
    _job(settings, BASE, (100, 200, 300))
    _child_job(settings, how)
    order = [(BASE, 100), (BASE, 200), (BASE, 300), (CHILD, 300), (CHILD, 600)]
    for run, step in order if parent_first else order[3:] + order[:3]:
        register_stored_part(settings, run, step, actor="test")
    with Catalog(settings.catalog_url) as cat:
        assert _origin_edges(cat, CHILD, 600) == [(CHILD, 300, BASE, 200, "resumed_from")]
        assert (cat.get_run(CHILD).parent_run, cat.get_run(CHILD).parent_step) == (BASE, 200)
        assert cat.rejections() == []
        for step in (100, 200, 300):  # base is durable: only the child keeps base/200
            verified(cat, cat.get_checkpoint(BASE, step).id, 1)
            verified(cat, cat.get_checkpoint(BASE, step).id, 2)
        assert {f.step: f.children for f in cat.retention_facts(run=BASE)}[200] == (CHILD,)
        with pytest.raises(PruneRefused, match=f"parent of {CHILD}"):
            cat.retire(BASE, 200, reason="no tier keeps it", actor="test")
    out = catalog_cli(monkeypatch, tmp_path, db_url)("lineage", CHILD, "600")
    assert f"{BASE}/200" in out and "resumed_from" in out


def test_register_many_from_manifests_links_origins_within_the_batch(catalog):
    catalog.ensure_run(BASE)
    catalog.ensure_run(CHILD)
    child = [manifest(CHILD, s, parent=(BASE, 200, "fine_tuned_from")) for s in (300, 400)]
    catalog.register_many([*child, manifest(BASE, 100), manifest(BASE, 200)], actor="import")
    assert _origin_edges(catalog, CHILD, 400) == [(CHILD, 300, BASE, 200, "fine_tuned_from")]


def test_unknown_origin_leaves_the_edge_pending_and_the_child_promotable(catalog, monkeypatch, tmp_path, db_url):
    catalog.ensure_run(CHILD)
    info = catalog.register_part(manifest(CHILD, 300, parent=(BASE, 200, "resumed_from")), actor="t")
    assert info.state == "committed"
    assert catalog.get_run(CHILD).parent_run == BASE and _origin_edges(catalog, CHILD, 300) == []
    assert "pending" in catalog_cli(monkeypatch, tmp_path, db_url)("lineage", CHILD, "300")
    checkpoint(catalog, BASE, 200)  # the parent's promotion finishes later
    assert _origin_edges(catalog, CHILD, 300) == [(CHILD, 300, BASE, 200, "resumed_from")]


def _retirable_base(cat: Catalog) -> None:
    """base/100..300 durable; 200 neither the newest nor the newest durable: retirable."""
    for step in (100, 200, 300):
        ck = checkpoint(cat, BASE, step)
        verified(cat, ck.id, 1)
        verified(cat, ck.id, 2)


def test_a_run_registered_with_its_origin_protects_it_before_its_first_checkpoint(catalog):
    _retirable_base(catalog)
    catalog.ensure_run(CHILD, parent=(BASE, 200))
    assert {f.step: f.children for f in catalog.retention_facts(run=BASE)}[200] == (CHILD,)
    with pytest.raises(PruneRefused, match=f"parent of {CHILD}"):
        catalog.retire(BASE, 200, reason="no tier keeps it", actor="test")
    assert catalog.retire(BASE, 100, reason="no tier keeps it", actor="test")


def test_a_retired_origin_is_recorded_loudly_and_never_resumed_from(catalog, caplog):
    _retirable_base(catalog)
    assert catalog.retire(BASE, 200, reason="no tier keeps it", actor="test")
    catalog.ensure_run(CHILD)
    with caplog.at_level(logging.WARNING):
        catalog.register_part(manifest(CHILD, 300, parent=(BASE, 200, "resumed_from")), actor="t")
    assert "RETIRED" in caplog.text and f"{BASE}/200" in caplog.text
    assert _origin_edges(catalog, CHILD, 300) == [(CHILD, 300, BASE, 200, "resumed_from")]  # history
    assert [e.reason for e in catalog.audit_log(run=CHILD) if e.action == "origin-retired"] != []
    offered = catalog.newest_verified(CHILD, follow_resumed=True)  # never a resume source: an older one is
    assert (offered.run, offered.step) == (BASE, 100)


def test_an_origin_registered_at_the_same_moment_as_its_child_is_still_linked(catalog, db_url):
    """PostgreSQL (SQLite serialises writers): base/200's registration is open, not committed,
    when the child's first checkpoint registers. The child waits for it (it locks its origin's
    run) and then links, instead of both missing the edge."""
    if catalog.engine.dialect.name != "postgresql":
        pytest.skip("SQLite runs one writer at a time")
    from sqlalchemy import text

    from db import register as reg
    from db.session import transaction

    catalog.ensure_run(BASE)
    catalog.ensure_run(CHILD, parent=(BASE, 200))
    other = Catalog(db_url)
    child_done = threading.Event()

    def child() -> None:
        other.register_part(manifest(CHILD, 300, parent=(BASE, 200, "resumed_from")), actor="child")
        child_done.set()

    worker = threading.Thread(target=child)
    try:
        with transaction(catalog.engine) as conn:
            reg.register_part(conn, manifest(BASE, 200), digest=manifest(BASE, 200).digest(), now=None, actor="base")
            worker.start()
            with catalog.engine.connect() as probe:  # until the child waits on a lock (or is done: unfixed)
                waiting = text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                               "AND datname = current_database()")
                for _ in range(600):
                    seen = probe.execute(waiting).scalar()
                    probe.rollback()  # a transaction sees pg_stat_activity as it first read it: a new one each time
                    if child_done.is_set() or seen:
                        break
                    child_done.wait(0.05)
        worker.join(timeout=60)
    finally:
        other.close()
    assert child_done.is_set()
    assert _origin_edges(catalog, CHILD, 300) == [(CHILD, 300, BASE, 200, "resumed_from")]


def test_cli_run_register_records_a_pending_branched_origin_that_protects_it(catalog, monkeypatch, tmp_path, db_url):
    cli = catalog_cli(monkeypatch, tmp_path, db_url)
    assert json.loads(cli("run", "register", CHILD, "--branched-from", f"{BASE}/200", "--json"))["parent_relation"] \
        == "branched_from"
    _retirable_base(catalog)  # registered after the child: the origin was pending until now
    with pytest.raises(PruneRefused, match=f"parent of {CHILD}"):
        catalog.retire(BASE, 200, reason="no tier keeps it", actor="test")
