"""The one way a test depends on a real component it cannot always have (a server, an optional
package, a kernel feature): ``require`` skips where it is missing, but under ``CI=true`` the
test fails instead, so the CI run proves every such test ran.

    require(_redis_available(), "Redis")               # None/"" = there; else why not
    torch = require_module("torch", "the torch extra")  # like pytest.importorskip

At module level both skip or fail the whole module (``allow_module_level``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(missing: str | None, what: str) -> None:
    """``missing`` is why ``what`` is unavailable (None or "" when it is there): skip, or
    under ``CI=true`` fail with that reason."""
    if not missing:
        return
    if IN_CI:
        pytest.fail(f"{what} is required with CI=true but unavailable: {missing}", pytrace=False)
    pytest.skip(f"{what} unavailable: {missing}", allow_module_level=True)


def require_module(name: str, what: str | None = None) -> ModuleType:
    """Import ``name`` (``pytest.importorskip`` under the CI rule); ``what`` says how to get it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(f"cannot import {name}: {exc}", what or name)
        raise  # unreachable: require skipped or failed
