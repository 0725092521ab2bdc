"""Alembic migrations without a server: a fresh SQLite file is created at head, and every migration says why."""

from __future__ import annotations

from db.catalog import Catalog


def test_open_with_auto_upgrade_creates_a_fresh_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'deep' / 'dir' / 'catalog.db'}"
    with Catalog.open(url, auto_upgrade=True) as cat:
        assert cat.list_runs() == []
    assert (tmp_path / "deep" / "dir" / "catalog.db").is_file()


def test_every_migration_says_why():
    from db.migrate import MIGRATIONS

    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        text = path.read_text()
        assert "Why:" in text and "<say why" not in text, path.name
