"""Fault injection for the soak: the catalog and tier stores the pipeline steps open are wrapped
so that the N-th call of an operation can kill the worker (a ``BaseException`` no ``except
Exception`` catches; every later call of that worker raises too, as after SIGKILL, so its
cleanup cannot run), start an outage (a transient ``CatalogUnavailable`` /
``StorageUnavailable`` from that call on, until the operation ends), fill Tier 1 (``StorageFull``
from every Tier 1 write from that call on, until the operation ends: reads and deletes still
work, as on a full disk) or pause the worker (its ``hold`` runs there, with injection off:
others take its work over; then it goes on). A plan may aim at one tier's store (``tier=2``: the
S3 upload, read-back or delete).

The injection points are ``tasks.base.Catalog`` (what ``open_catalog`` constructs) and
``tier_store`` wherever a step module imported it; nothing in product code changes.

Two more kinds act below the store: ``S3Faults`` answers chosen HTTP requests to the S3
server with errors (a proxy in front of moto, so botocore's own retries and the store's
error mapping run for real), and ``Clock`` runs the worker's clock off by an offset.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import CatalogUnavailable, StorageFull, StorageUnavailable


class Killed(BaseException):
    """The worker process died here (SIGKILL): nothing after this point of it runs."""


# store methods that read or change bytes, and catalog methods that read or commit state: a
# fault before or after each one covers every gap between a storage operation and its commit
STORE_CALLS = {"open_read", "stat", "list", "read_small", "verify_object", "put_verified", "write_small_atomic",
               "flush", "delete", "delete_prefix", "delete_part", "sweep_staging", "local_path",
               "bury", "exhume", "delete_tomb"}  # a claim's fenced delete: set aside, put back, then deleted
CATALOG_SKIP = {"close", "engine", "url", "check_schema"}
TIER1_WRITES = {"put_verified", "write_small_atomic"}  # what a full Tier 1 refuses (``tier1_full``)


@dataclass
class Plan:
    """What to do to one operation: ``kind`` in {'', 'kill', 'catalog_outage', 'storage_outage',
    'tier1_full', 'pause'};
    fire at the ``at``-th (0-based) wrapped call that matches ``target`` ('store', 'catalog' or
    '' for any) and ``method`` (a method name, or '' for any), ``after`` the call instead of
    before it. A targeted store method (``put_verified``, ``delete``...) puts the fault exactly
    between a storage operation and its catalog commit."""

    kind: str = ""
    at: int = 0
    after: bool = False
    target: str = ""
    method: str = ""
    tier: int | None = None  # only calls of this tier's store (a store target)

    def label(self) -> str:
        if not self.kind:
            return ""
        where = f"{self.target or 'any'}{self.tier if self.tier is not None else ''}"
        where += f".{self.method}" if self.method else ""
        return f"+{self.kind}@{where}#{self.at}{'a' if self.after else 'b'}"


@dataclass
class Injector:
    plan: Plan = field(default_factory=Plan)
    calls: int = 0
    dead: bool = False
    catalog_down: bool = False
    storage_down: bool = False
    tier1_full: bool = False
    fired: str = ""
    counts: Counter = field(default_factory=Counter)
    enabled: bool = False
    hold: Callable[[], None] | None = None  # what happens while a paused worker stands still

    def start(self, plan: Plan) -> None:
        self.plan, self.calls, self.fired = plan, 0, ""
        self.dead = self.catalog_down = self.storage_down = self.tier1_full = False
        self.enabled = True

    def stop(self) -> str:
        self.enabled = False
        self.dead = self.catalog_down = self.storage_down = self.tier1_full = False
        return self.fired

    def around(self, what: str, fn: Any, args: tuple, kwargs: dict, name: str = "", tier: int | None = None) -> Any:
        if not self.enabled:
            return fn(*args, **kwargs)
        if self.dead:
            raise Killed(f"worker already dead ({what})")
        if what == "catalog" and self.catalog_down:
            raise CatalogUnavailable("injected catalog outage")
        if what == "store" and self.storage_down:
            raise StorageUnavailable("injected storage outage")
        if what == "store" and self.tier1_full and tier == 1 and name in TIER1_WRITES:
            raise StorageFull("injected: no space left on Tier 1")
        p = self.plan
        matches = ((not p.target or p.target == what) and (not p.method or p.method == name)
                   and (p.tier is None or p.tier == tier))
        fire = False
        if matches and not self.fired and p.kind:
            fire = self.calls == p.at
            self.calls += 1
        if fire and not p.after:
            self._fire(what, name, tier)
        result = fn(*args, **kwargs)
        if fire and p.after:
            self._fire(what, name, tier)
        return result

    def _fire(self, what: str, name: str = "", tier: int | None = None) -> None:
        kind = self.plan.kind
        if kind == "storage_outage" and what != "store":
            kind = "catalog_outage"
        if kind == "catalog_outage" and what != "catalog":
            kind = "storage_outage"
        label = f"{kind}_{'after' if self.plan.after else 'before'}_{what}" + (f".{name}" if name else "")
        label += "@tier2" if what == "store" and tier == 2 else ""
        self.fired = label
        self.counts[label] += 1
        if kind == "pause":
            self.enabled = False  # what runs meanwhile is other workers, not this one
            try:
                if self.hold is not None:
                    self.hold()
            finally:
                self.enabled = True
            return
        if kind == "kill":
            self.dead = True
            raise Killed(label)
        if kind == "tier1_full":
            self.tier1_full = True
            raise StorageFull("injected: no space left on Tier 1")
        if kind == "catalog_outage":
            self.catalog_down = True
            raise CatalogUnavailable("injected catalog outage")
        self.storage_down = True
        raise StorageUnavailable("injected storage outage")


class _Proxy:
    def __init__(self, inner: Any, injector: Injector, what: str, methods: set[str] | None, tier: int | None = None):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_inj", injector)
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_methods", methods)
        object.__setattr__(self, "_tier", tier)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() sees the wrapped store, as the product checks it
        return type(self._inner)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        wrapped = (name in self._methods) if self._methods is not None else (
            callable(attr) and not name.startswith("_") and name not in CATALOG_SKIP)
        if not wrapped or not callable(attr):
            return attr
        inj, what, tier = self._inj, self._what, self._tier

        def call(*args: Any, **kwargs: Any) -> Any:
            return inj.around(what, attr, args, kwargs, name, tier)
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
        return _Proxy(real_store(settings, tier), injector, "store", STORE_CALLS, tier)

    monkeypatch.setattr(base, "Catalog", catalog_factory)
    for name, mod in list(sys.modules.items()):
        if not (name.startswith(("tasks.", "flows."))):
            continue
        if getattr(mod, "tier_store", None) is real_store:
            monkeypatch.setattr(mod, "tier_store", store_factory)


# --- S3 errors over HTTP --------------------------------------------------------------------
# kind -> (HTTP status, S3 error code) answered; ``s3_transient`` fails ``count`` requests and then
# lets them through (botocore's retries absorb it), the others fail every request from ``at`` on
S3_ERRORS = {
    "s3_transient": ((503, "SlowDown"), (500, "InternalError"), (503, "ServiceUnavailable")),
    "s3_unavailable": ((503, "ServiceUnavailable"),),  # persistent: beyond every retry
    "s3_denied": ((403, "AccessDenied"),),  # permanent: a revoked key, a bucket policy
}


@dataclass
class S3Plan:
    """What the S3 server answers during one operation: from the ``at``-th (0-based) request
    whose HTTP method is ``method`` ('' for any), ``kind``'s error (``variant`` picks one of a
    kind's errors): ``count`` times for ``s3_transient``, else to every matching request."""

    kind: str = ""
    at: int = 0
    method: str = ""
    count: int = 1
    variant: int = 0

    def error(self) -> tuple[int, str]:
        choices = S3_ERRORS[self.kind]
        return choices[self.variant % len(choices)]

    def label(self) -> str:
        if not self.kind:
            return ""
        status, code = self.error()
        return f"+{self.kind}({status} {code})@{self.method or 'any'}#{self.at}"


class S3Faults:
    """The hook of a ``tests.kit.s3_proxy.S3Proxy`` in front of moto: armed for one operation
    with an ``S3Plan``; counts the requests it answered with an error (``failed``)."""

    def __init__(self) -> None:
        import threading

        self.plan = S3Plan()
        self.seen = 0
        self.failed = 0
        self.lock = threading.Lock()

    def arm(self, plan: S3Plan) -> None:
        with self.lock:
            self.plan, self.seen, self.failed = plan, 0, 0

    def disarm(self) -> int:
        with self.lock:
            failed, self.plan = self.failed, S3Plan()
            return failed

    def __call__(self, req: Any) -> tuple[int, str] | None:
        with self.lock:
            p = self.plan
            if not p.kind or (p.method and req.method != p.method):
                return None
            n, self.seen = self.seen, self.seen + 1
            if n < p.at or (p.kind == "s3_transient" and n >= p.at + p.count):
                return None
            self.failed += 1
            return p.error()


# --- the worker's clock -------------------------------------------------------------------------
class Clock:
    """The worker's wall clock, ``offset`` off (0 outside a skewed operation).

    ``install`` replaces ``datetime`` in the modules that read Python's clock for stamps and
    ages (``datetime.now``): the writer's manifest stamp (``core.manifest``), scrub's grace,
    and ``db.clock.host_now``, which is the catalog's clock only where the catalog is a
    SQLite file on the workers' one host. Leases, claims and retention ages must
    read the catalog's clock (PostgreSQL's ``now()``), so a skewed worker changes none of them.
    On SQLite every worker shares the host's clock, so worker clocks cannot drift apart: there
    ``db.clock`` keeps the true clock and the skew reaches the writer's stamps and the rest.
    """

    def __init__(self) -> None:
        from datetime import timedelta

        self.offset = timedelta(0)

    def install(self, monkeypatch: Any, *, catalog_on_host: bool) -> None:
        import datetime as _dt

        clock = self

        class SkewedDatetime(_dt.datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:  # type: ignore[override]
                return _dt.datetime.now(tz) + clock.offset

        import core.manifest
        import db.clock
        import tasks.scrub

        modules = [core.manifest, tasks.scrub] + ([] if catalog_on_host else [db.clock])
        for mod in modules:
            assert getattr(mod, "datetime", None) is _dt.datetime, mod.__name__
            monkeypatch.setattr(mod, "datetime", SkewedDatetime)
