"""The tokens of claims whose answer was lost (``tasks.claim.claim_token``): kept for the next
claim of the same thing in this process, handed to one caller at a time, never kept when the
process is going, and bounded."""

from __future__ import annotations

import pytest

from core.errors import CatalogUnavailable
from tasks import claim


@pytest.fixture(autouse=True)
def no_lost_tokens(monkeypatch):
    monkeypatch.setattr(claim, "_lost", {})


def _lose(*what: object) -> str:
    """A claim of ``what`` whose call raised (the answer lost): its token."""
    with pytest.raises(CatalogUnavailable), claim.claim_token(*what) as token:
        raise CatalogUnavailable("connection dropped after COMMIT")
    return token


def test_the_next_claim_of_the_same_replica_gets_the_lost_token_and_only_one_caller_does():
    lost = _lose("copy", "sqlite:///c", 7, 1, 0)
    with claim.claim_token("copy", "sqlite:///c", 7, 1, 0) as first, \
            claim.claim_token("copy", "sqlite:///c", 7, 1, 0) as second:
        assert first == lost and second != lost
    with claim.claim_token("copy", "sqlite:///c", 7, 1, 0) as third:  # answered: nothing kept
        assert third not in (lost, second)


def test_another_replica_or_catalog_never_gets_the_token():
    lost = _lose("copy", "sqlite:///c", 7, 1, 0)
    for what in (("copy", "sqlite:///c", 7, 1, 1), ("copy", "sqlite:///d", 7, 1, 0), ("prune", "sqlite:///c", 7)):
        with claim.claim_token(*what) as token:
            assert token != lost


def test_a_process_going_away_keeps_nothing():
    class Going(BaseException):
        pass

    with pytest.raises(Going), claim.claim_token("prune", "sqlite:///c", 3):
        raise Going
    assert claim._lost == {}


def test_the_kept_tokens_are_bounded_oldest_first(monkeypatch):
    monkeypatch.setattr(claim, "_LOST_KEPT", 3)
    tokens = [_lose("prune", "sqlite:///c", rid) for rid in range(5)]
    assert list(claim._lost.values()) == tokens[2:]
