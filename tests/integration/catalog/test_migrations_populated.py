"""`ckpt db upgrade` on a populated catalog: a catalog created at revision 0001 and filled
through plain SQL (as a deployment of that release left it) upgrades to head with every run,
checkpoint, file, replica and audit row intact and readable through the catalog API."""

from __future__ import annotations

from datetime import UTC, datetime

from db.catalog import Catalog, upgrade
from db.migrate import head_revision
from tests.kit.catalog import at_revision


def _populate_at_0001(url: str) -> None:
    now = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    with at_revision(url, "0001") as (conn, t):
        conn.execute(t["runs"].insert(), [dict(id=1, name="run-old", created_at=now, tags={})])
        conn.execute(t["checkpoints"].insert(), [dict(
            id=1, run_id=1, step=100, kind="step", state="complete", format="hf-sharded", parts=1,
            parts_registered=1, total_bytes=4096, file_count=1, metrics={"loss": 1.5}, tags={},
            created_at=now, committed_at=now, verified_tiers=2)])
        conn.execute(t["checkpoint_files"].insert(), [dict(
            id=1, checkpoint_id=1, part=0, path="model.safetensors", size=4096, algorithm="crc32c",
            checksum="0badf00d")])
        rows = [dict(id=i + 1, checkpoint_id=1, tier=tier, part=0, node="node-0" if tier == 0 else None,
                     url=f"file:///tier{tier}/run-old/step-00000100", state="verified", bytes=4096,
                     verified_at=now, created_at=now, updated_at=now) for i, tier in enumerate((0, 1))]
        conn.execute(t["replicas"].insert(), rows)
        if "checkpoint_parts" in t:
            conn.execute(t["checkpoint_parts"].insert(), [dict(
                checkpoint_id=1, part=0, node="node-0", manifest_digest="d" * 64, bytes=4096, file_count=1,
                registered_at=now)])
        conn.execute(t["audit_log"].insert(), [dict(
            id=1, at=now, actor="old-release", subject="checkpoint:run-old/100", action="register",
            run="run-old", step=100)])


def test_upgrade_from_0001_keeps_a_populated_catalog(db_url):
    _populate_at_0001(db_url)
    assert upgrade(db_url) == head_revision()
    cat = Catalog(db_url)
    try:
        ck = cat.get_checkpoint("run-old", 100)
        assert (ck.total_bytes, ck.file_count, ck.parts) == (4096, 1, 1)
        assert [(f.path, f.size, f.checksum) for f in cat.files(ck.id)] == [("model.safetensors", 4096, "0badf00d")]
        assert sorted((r.tier, r.state) for r in cat.replicas(ck.id)) == [(0, "verified"), (1, "verified")]
        assert any(e.actor == "old-release" for e in cat.history("run-old", 100))
    finally:
        cat.close()


def test_upgrade_records_the_attempt_of_checkpoints_saved_before_attempts(db_url):
    """A catalog's checkpoints from before attempts (the unnamed one) get their attempt's row
    (revision 0011), so they are a history: a launch that never resumed is refused above them."""
    import pytest

    from core.errors import ReusedRunName
    from tests.kit.catalog import manifest

    _populate_at_0001(db_url)
    upgrade(db_url)
    cat = Catalog(db_url)
    try:
        with pytest.raises(ReusedRunName, match="history of attempt \\(unnamed\\)"):
            cat.register_part(manifest("run-old", 200, attempt="slurm-7-r0"), actor="test")
        assert [ck.attempt for ck in cat.list_checkpoints("run-old")] == [""]
    finally:
        cat.close()
