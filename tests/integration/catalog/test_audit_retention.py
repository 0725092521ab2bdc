"""Audit retention through the CLI on a real catalog (both backends): entries older than
CKPT_AUDIT_RETAIN_DAYS are exported to a gzip'd JSON-lines file, then deleted; younger ones,
rejections included, stay listed by ``ckpt audit``."""

from __future__ import annotations

import gzip
import json
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from db.rows import audit
from tests.kit.catalog import catalog_cli, checkpoint, verified


@pytest.fixture
def cli(catalog, db_url, monkeypatch, tmp_path):
    return catalog_cli(monkeypatch, tmp_path, db_url, AUDIT_RETAIN_DAYS="30",
                       AUDIT_EXPORT_DIR=str(tmp_path / "exported"))


def _age(catalog, ids, days: float) -> None:
    with catalog.engine.begin() as conn:
        conn.execute(update(audit).where(audit.c.id.in_(ids)).values(at=catalog.clock() - timedelta(days=days)))


def test_old_entries_are_exported_then_deleted_and_recent_rejections_stay(cli, catalog, tmp_path):
    ck = checkpoint(catalog, "run-a", 10)
    verified(catalog, ck.id, 1)
    catalog.record_rejection("event:bad", "malformed event", actor="t", run="run-a", step=20)
    entries = catalog.audit_log(limit=1000)
    old, kept = [e for e in entries if e.action != "reject"], [e for e in entries if e.action == "reject"]
    _age(catalog, [e.id for e in old], 40)
    _age(catalog, [e.id for e in kept], 29)  # inside the retention: stays

    done = json.loads(cli("audit", "--expire", "--json"))

    assert done["exported"] == done["deleted"] == len(old) > 0
    export = Path(done["file"])
    assert export.parent == tmp_path / "exported" and not list(export.parent.glob("*.tmp"))
    with gzip.open(export, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    assert [(r["id"], r["action"], r["subject"]) for r in rows] == [(e.id, e.action, e.subject)
                                                                   for e in sorted(old, key=lambda e: e.id)]
    listed = json.loads(cli("audit", "--json"))
    assert listed[0]["action"] == "reject" and listed[0]["reason"] == "malformed event"  # still first
    assert {e["action"] for e in listed} == {"reject", "expire-audit"}  # and the expiry is itself audited
    assert json.loads(cli("audit", "--expire", "--json"))["exported"] == 0  # nothing more is old enough
