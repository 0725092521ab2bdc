"""One verified TLS context per CA file for the agent's Prefect clients, not one per client.

Prefect builds a new ``ssl.SSLContext`` from the CA bundle (certifi's, or
``PREFECT_API_SSL_CERT_FILE``) for every client it opens, and a promote run opens about seven
(the engine's, the events and log workers', the run observers', the version check, the fast
path's): ~15 ms of CPU each to parse the bundle, about a fifth of the agent's CPU per promotion
(measured with py-spy on an agent promoting 1 MiB parts). httpx's own advice is to build the
context once and pass it to each client; Prefect gives no setting to pass one, so
``share_verified_contexts`` gives the two Prefect modules that build them an ``ssl`` whose
``create_default_context`` returns one context per (purpose, CA file, its mtime) when called
with a CA file, the verified form, which neither module changes after creating it. The
``ssl`` module itself, and every other caller, is left alone; a call without a CA file (Prefect's
``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` form, which turns verification off on the context it
gets) still gets a fresh context. The agent does it when ``CKPT_PREFECT_REUSE`` is on (the
default), before it forks its fork server, which then builds the context for Prefect's CA file
once (deployments/fast_path.py ``_prebuild``) so that no warm process builds it again.
"""

from __future__ import annotations

import os
import ssl
import threading
import types
from typing import Any

# the Prefect modules that build a context per client (prefect 3.x), by attribute ``ssl``
PREFECT_MODULES = ("prefect.client.orchestration", "prefect._internal.version_checking")


class SharedVerifiedContexts(types.ModuleType):
    """``ssl`` as seen by the modules it replaces: everything is the real module's, except that
    ``create_default_context(cafile=...)`` returns one shared context per (purpose, file, mtime)."""

    def __init__(self) -> None:
        super().__init__("ssl")
        self._lock = threading.Lock()
        self._made: dict[tuple[Any, ...], ssl.SSLContext] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)

    def create_default_context(self, purpose: Any = ssl.Purpose.SERVER_AUTH, *, cafile: str | None = None,
                               capath: str | None = None, cadata: Any = None) -> ssl.SSLContext:
        if cafile is None or capath is not None or cadata is not None:
            return ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
        try:
            key: tuple[Any, ...] = (purpose, cafile, os.stat(cafile).st_mtime_ns)
        except OSError:  # let ssl say what is wrong with the file
            return ssl.create_default_context(purpose, cafile=cafile)
        with self._lock:
            ctx = self._made.get(key)
            if ctx is None:
                ctx = self._made[key] = ssl.create_default_context(purpose, cafile=cafile)
            return ctx


def share_verified_contexts() -> bool:
    """Give Prefect's client modules the shared contexts (idempotent); False when a module is
    not where this Prefect keeps it (nothing is changed then)."""
    import importlib

    modules = []
    for name in PREFECT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            return False
        if not isinstance(getattr(module, "ssl", None), (types.ModuleType,)):
            return False
        modules.append(module)
    shared = next((m.ssl for m in modules if isinstance(m.ssl, SharedVerifiedContexts)), None) \
        or SharedVerifiedContexts()
    for module in modules:
        module.ssl = shared  # type: ignore[attr-defined]
    return True
