"""Fixtures for every test, all defined in the kit (``tests/kit/``):

- servers: ``pg_server``, ``pg_url``, ``sqlite_url``, ``db_url`` (SQLite and PostgreSQL),
  ``s3_endpoint``, ``s3_bucket`` (moto's S3 server), ``localstack_endpoint`` (an S3 that checks
  checksums; marker ``validating_s3``), ``prefect_server`` (SQLite),
  ``production_server`` (PostgreSQL + Redis, services apart), and fake AWS credentials for every test;
- ``settings_factory``: settings rooted in the test's temp folder;
- ``catalog``: a fresh, migrated catalog on ``db_url``;
- ``tiers``: local Tier 0 and Tier 1 stores in the test's temp folder.

PostgreSQL: ``CKPT_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``).
Each test that asks for ``pg_url`` gets a fresh database created from it and dropped after.
With ``CI=true`` an unreachable PostgreSQL fails those tests instead of skipping them.
"""

from tests.kit.catalog import catalog  # noqa: F401
from tests.kit.servers import (  # noqa: F401
    _aws_env,
    db_url,
    localstack_endpoint,
    moto_endpoint,
    pg_server,
    pg_url,
    prefect_server,
    production_server,
    s3_bucket,
    s3_endpoint,
    sqlite_url,
)
from tests.kit.settings import settings_factory  # noqa: F401
from tests.kit.stores import tiers  # noqa: F401


def pytest_collection_modifyitems(config, items):
    """The fault soak's file first, the rest in their order. Under pytest-xdist's ``loadfile`` a
    file is one worker's: the soak's takes that worker for minutes, so started first the other
    worker fills in around it, where collected last (``tests/soak`` sorts after ``integration``)
    it ran alone at the end while the other worker idled."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/soak/test_soak.py"))
