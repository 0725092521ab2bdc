"""Alembic, driven from code: the config is built here (no alembic.ini), so ``ckpt db upgrade``
works from an installed package. Migrations live in ``db/migrations/versions`` and only move
forward.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection

MIGRATIONS = Path(__file__).resolve().parent / "migrations"

# Alembic (with Mako and what they import: memory in every agent) is imported only to migrate:
# the schema check every process makes (Catalog.check_schema) reads the scripts' revisions as
# text and the version table with one query. An agent, its fork server and its part processes
# each held those pages for a check that needs neither.
_REVISION = re.compile(r"""^(down_)?revision\s*(?::[^=\n]*)?=\s*(?:["']([^"']+)["']|None)""", re.MULTILINE)


def alembic_config(connection: Connection | None = None) -> Config:
    from alembic.config import Config  # deferred: memory — only a migration needs Alembic

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def script_revisions() -> dict[str, str | None]:
    """``revision -> down_revision`` of every migration script, read as text (Alembic's own
    reading of them is checked against this by tests/unit/test_migrations.py)."""
    out: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        found = {bool(m.group(1)): m.group(2) for m in _REVISION.finditer(path.read_text(encoding="utf-8"))}
        if False in found:
            out[str(found[False])] = found.get(True)
    return out


def head_revision() -> str:
    revisions = script_revisions()
    heads = set(revisions) - {down for down in revisions.values() if down}
    if len(heads) == 1:
        return heads.pop()
    from alembic.script import ScriptDirectory  # deferred: memory — a history this reader cannot follow

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None  # the package ships its migrations
    return head


def known_revisions() -> set[str]:
    return set(script_revisions())


def current_revision(connection: Connection) -> str | None:
    """The revision in the database's ``alembic_version`` table (None: no schema yet)."""
    from sqlalchemy import inspect, text

    if not inspect(connection).has_table("alembic_version"):
        return None
    versions = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    if len(versions) > 1:
        raise ValueError(f"the catalog's alembic_version has several heads: {sorted(versions)}")
    return versions[0] if versions else None


def upgrade_connection(connection: Connection, target: str = "head") -> None:
    from alembic import command  # deferred: memory — only a migration needs Alembic

    command.upgrade(alembic_config(connection), target)
