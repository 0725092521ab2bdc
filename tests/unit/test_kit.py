"""The test kit's own rules: a missing component skips a test only outside CI (``require``), and
a wait that times out shows why its last check failed (``wait_for``)."""

from __future__ import annotations

import pytest

import tests.kit.require as req
from tests.kit.agents import wait_for


def test_a_missing_component_skips_outside_ci_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(req, "IN_CI", False)
    req.require(None, "Redis")  # there: nothing happens
    req.require("", "Redis")
    with pytest.raises(pytest.skip.Exception, match="Redis unavailable: connection refused"):
        req.require("connection refused", "Redis")
    with pytest.raises(pytest.skip.Exception, match="cannot import no_such_module_xyz"):
        req.require_module("no_such_module_xyz", "the xyz extra")
    assert req.require_module("json").dumps([1]) == "[1]"

    monkeypatch.setattr(req, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="Redis is required with CI=true but unavailable: connection"):
        req.require("connection refused", "Redis")
    with pytest.raises(pytest.fail.Exception, match="the xyz extra is required with CI=true"):
        req.require_module("no_such_module_xyz", "the xyz extra")


def test_wait_for_returns_the_first_truthy_value():
    calls = iter([None, 0, "ready"])
    assert wait_for("it", lambda: next(calls), timeout=30, interval=0) == "ready"


def test_wait_for_timeout_shows_the_last_exception_of_the_check():
    def check():
        raise KeyError("checkpoint run-a/100 is not registered")

    with pytest.raises(AssertionError, match=r"waiting for the promotion; the last check raised KeyError: "
                                             r"'checkpoint run-a/100 is not registered'") as exc:
        wait_for("the promotion", check, timeout=0.05, interval=0.01)
    assert isinstance(exc.value.__cause__, KeyError)


def test_wait_for_timeout_shows_the_last_falsy_value():
    with pytest.raises(AssertionError, match=r"waiting for two rows; the last check returned \[\]"):
        wait_for("two rows", list, timeout=0.05, interval=0.01)
