"""Alembic environment of the catalog. Run through ``db.migrate`` (``ckpt db upgrade``), which
builds the Alembic config in code and passes an open connection; no alembic.ini is needed.

``render_as_batch=True`` makes ALTERs work on SQLite (copy-and-move of the table).
"""

from __future__ import annotations

from alembic import context

from db.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=True,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
