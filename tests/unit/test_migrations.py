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


def test_revisions_read_as_text_are_alembics():
    from alembic.script import ScriptDirectory

    from db.migrate import alembic_config, head_revision, known_revisions, script_revisions

    scripts = ScriptDirectory.from_config(alembic_config())
    assert script_revisions() == {s.revision: s.down_revision for s in scripts.walk_revisions()}
    assert head_revision() == scripts.get_current_head()
    assert known_revisions() == {s.revision for s in scripts.walk_revisions()}


def test_schema_check_refuses_a_catalog_behind_or_ahead_of_this_ckpt(tmp_path):
    import sqlite3

    import pytest

    from core.errors import SchemaOutdated
    from db.catalog import upgrade
    from db.migrate import head_revision

    with pytest.raises(SchemaOutdated, match="no schema yet"):
        Catalog(f"sqlite:///{tmp_path / 'empty.db'}")
    for rev, says in (("0001", "this ckpt needs " + head_revision()), ("9999", "newer than this ckpt")):
        path = tmp_path / f"at-{rev}.db"
        upgrade(f"sqlite:///{path}")
        with sqlite3.connect(path) as db:
            db.execute("UPDATE alembic_version SET version_num = ?", (rev,))
        with pytest.raises(SchemaOutdated, match=says):
            Catalog(f"sqlite:///{path}")


def test_an_agent_and_its_warm_processes_never_load_alembic(tmp_path):
    """The schema check every process makes reads the scripts as text: Alembic and Mako (with
    what they pull in, ~7 MB of an agent's memory) load only to migrate."""
    import subprocess
    import sys
    from pathlib import Path

    from db.catalog import upgrade

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    upgrade(url)
    code = ("import importlib, sys\n"
            "from deployments.processes import PRELOAD\n"
            "for m in PRELOAD + ['deployments.agent', 'prefect.runner']:\n"
            "    importlib.import_module(m)\n"
            "from db.catalog import Catalog, preload\n"
            "preload()\n"
            "with Catalog(sys.argv[1]) as cat:\n"
            "    cat.list_runs()\n"
            "print(sorted(m for m in ('alembic', 'mako') if m in sys.modules))\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code, url], cwd=root, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
