"""Fault injection for the soak: the catalog and tier stores the pipeline steps open are wrapped
so that the N-th call of an operation can kill the worker (a ``BaseException`` no ``except
Exception`` catches; every later call of that worker raises too, as after SIGKILL, so its
cleanup cannot run) or start an outage (a transient ``CatalogUnavailable`` /
``StorageUnavailable`` from that call on, until the operation ends).

The injection points are ``tasks.base.Catalog`` (what ``open_catalog`` constructs) and
``tier_store`` wherever a step module imported it; nothing in product code changes.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from core.errors import CatalogUnavailable, StorageUnavailable


class Killed(BaseException):
    """The worker process died here (SIGKILL): nothing after this point of it runs."""


# store methods that read or change bytes, and catalog methods that read or commit state: a
# fault before or after each one covers every gap between a storage operation and its commit
STORE_CALLS = {"open_read", "stat", "list", "read_small", "verify_object", "put_verified", "write_small_atomic",
               "flush", "delete", "delete_prefix", "delete_part", "sweep_staging", "local_path"}
CATALOG_SKIP = {"close", "engine", "url", "check_schema"}


@dataclass
class Plan:
    """What to do to one operation: ``kind`` in {'', 'kill', 'catalog_outage', 'storage_outage'};
    fire at the ``at``-th (0-based) wrapped call that matches ``target`` ('store', 'catalog' or
    '' for any) and ``method`` (a method name, or '' for any), ``after`` the call instead of
    before it. A targeted store method (``put_verified``, ``delete``...) puts the fault exactly
    between a storage operation and its catalog commit."""

    kind: str = ""
    at: int = 0
    after: bool = False
    target: str = ""
    method: str = ""

    def label(self) -> str:
        if not self.kind:
            return ""
        where = f"{self.target or 'any'}{'.' + self.method if self.method else ''}"
        return f"+{self.kind}@{where}#{self.at}{'a' if self.after else 'b'}"


@dataclass
class Injector:
    plan: Plan = field(default_factory=Plan)
    calls: int = 0
    dead: bool = False
    catalog_down: bool = False
    storage_down: bool = False
    fired: str = ""
    counts: Counter = field(default_factory=Counter)
    enabled: bool = False

    def start(self, plan: Plan) -> None:
        self.plan, self.calls, self.fired = plan, 0, ""
        self.dead = self.catalog_down = self.storage_down = False
        self.enabled = True

    def stop(self) -> str:
        self.enabled = False
        self.dead = self.catalog_down = self.storage_down = False
        return self.fired

    def around(self, what: str, fn: Any, args: tuple, kwargs: dict, name: str = "") -> Any:
        if not self.enabled:
            return fn(*args, **kwargs)
        if self.dead:
            raise Killed(f"worker already dead ({what})")
        if what == "catalog" and self.catalog_down:
            raise CatalogUnavailable("injected catalog outage")
        if what == "store" and self.storage_down:
            raise StorageUnavailable("injected storage outage")
        p = self.plan
        matches = (not p.target or p.target == what) and (not p.method or p.method == name)
        fire = False
        if matches and not self.fired and p.kind:
            fire = self.calls == p.at
            self.calls += 1
        if fire and not p.after:
            self._fire(what, name)
        result = fn(*args, **kwargs)
        if fire and p.after:
            self._fire(what, name)
        return result

    def _fire(self, what: str, name: str = "") -> None:
        kind = self.plan.kind
        if kind == "storage_outage" and what != "store":
            kind = "catalog_outage"
        if kind == "catalog_outage" and what != "catalog":
            kind = "storage_outage"
        label = f"{kind}_{'after' if self.plan.after else 'before'}_{what}" + (f".{name}" if name else "")
        self.fired = label
        self.counts[label] += 1
        if kind == "kill":
            self.dead = True
            raise Killed(label)
        if kind == "catalog_outage":
            self.catalog_down = True
            raise CatalogUnavailable("injected catalog outage")
        self.storage_down = True
        raise StorageUnavailable("injected storage outage")


class _Proxy:
    def __init__(self, inner: Any, injector: Injector, what: str, methods: set[str] | None):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_inj", injector)
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_methods", methods)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        wrapped = (name in self._methods) if self._methods is not None else (
            callable(attr) and not name.startswith("_") and name not in CATALOG_SKIP)
        if not wrapped or not callable(attr):
            return attr
        inj, what = self._inj, self._what

        def call(*args: Any, **kwargs: Any) -> Any:
            return inj.around(what, attr, args, kwargs, name)
        return call

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._inj.enabled and self._inj.dead:
            return  # a dead worker releases nothing
        closer = getattr(self._inner, "__exit__", None)
        if closer is not None:
            closer(*exc)

    def close(self) -> None:
        if self._inj.enabled and self._inj.dead:
            return
        self._inner.close()


def install(monkeypatch: Any, injector: Injector) -> None:
    """Wrap what every step opens: ``Catalog`` in ``tasks.base`` and ``tier_store`` everywhere
    a step module bound it."""
    import tasks.base as base
    from db.catalog import Catalog

    real_store = base.tier_store

    def catalog_factory(*args: Any, **kwargs: Any) -> Any:
        return _Proxy(Catalog(*args, **kwargs), injector, "catalog", None)

    def store_factory(settings: Any, tier: int) -> Any:
        return _Proxy(real_store(settings, tier), injector, "store", STORE_CALLS)

    monkeypatch.setattr(base, "Catalog", catalog_factory)
    for name, mod in list(sys.modules.items()):
        if not (name.startswith(("tasks.", "flows."))):
            continue
        if getattr(mod, "tier_store", None) is real_store:
            monkeypatch.setattr(mod, "tier_store", store_factory)
