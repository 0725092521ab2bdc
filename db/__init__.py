"""The catalog: SQLAlchemy models, the ``Catalog`` API (plain dataclasses out, never ORM rows),
the replica state machine, Alembic migrations. The only package that imports SQLAlchemy; it
imports ``core`` and nothing above it."""
