"""Two production stacks on one Redis never share a database: each claims its own, a live
owner's database is never taken, a dead stack's is taken over and emptied."""

from __future__ import annotations

import os
import subprocess

import pytest

from ckpt.production_stack import REDIS_OWNER_KEY, claim_redis_db, release_redis_db
from core.errors import ConfigError
from tests.kit.require import require
from tests.kit.servers import REDIS_URL, _redis_available

require(_redis_available(), "Redis")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_each_stack_claims_its_own_redis_database():
    other = os.getppid()  # a live process that is not this one
    mine = claim_redis_db(REDIS_URL)
    try:
        theirs = claim_redis_db(REDIS_URL, owner=other)
        try:
            assert theirs.db != mine.db
        finally:
            release_redis_db(theirs)
        with pytest.raises(ConfigError, match="held by a live process"):
            claim_redis_db(f"{REDIS_URL}/{mine.db}", owner=other)

        r = mine.client()
        r.set("left-by-a-dead-stack", 1)
        r.set(REDIS_OWNER_KEY, _dead_pid())
        again = claim_redis_db(f"{REDIS_URL}/{mine.db}", owner=other)
        assert again.db == mine.db
        assert not r.exists("left-by-a-dead-stack") and int(r.get(REDIS_OWNER_KEY)) == other
        r.close()
    finally:
        release_redis_db(mine)
