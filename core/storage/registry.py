"""Storage backends by URL scheme: each backend module registers a ``Backend`` (its schemes, a
factory that builds the store and its own configuration from the ``Settings`` object, and a
check of its URLs); ``open_store`` and the settings validator ask the registry, never a
backend by name. A URL without ``://`` is a plain path (the ``file`` backend's). One backend
may be the fallback, asked about schemes no backend registered (fsspec: any protocol it knows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import ConfigError

if TYPE_CHECKING:
    from core.settings import Settings
    from core.storage.base import TierStore

PLAIN_PATH = "file"  # the scheme a URL without one (a path) is given
DEFAULT_IO_BUFFER = 4 * 1024 * 1024  # a store's read/write buffer when no settings are given


def io_buffer(settings: Settings | None) -> int:
    """The read/write buffer every backend's store uses: ``io_buffer_bytes`` from the settings."""
    return settings.io_buffer_bytes if settings is not None else DEFAULT_IO_BUFFER


@dataclass(frozen=True)
class Backend:
    """One storage backend as the registry knows it.

    ``factory(url, tier, settings)`` returns a fresh store (``settings`` None: the defaults);
    ``object_store`` says whether it may hold Tier 2 (keeps the promises of an object store:
    durable across the cluster, Object Lock where asked), with ``example`` the URL shape shown to
    a user; ``url_problem(url)`` says why a URL is refused (None when it is fine); ``accepts``
    is the fallback's test of a scheme nobody registered."""

    name: str
    schemes: tuple[str, ...]
    factory: Callable[[str, int, Settings | None], TierStore]
    object_store: bool = False
    example: str = ""
    url_problem: Callable[[str], str | None] | None = None
    accepts: Callable[[str], bool] | None = None


_by_scheme: dict[str, Backend] = {}
_fallback: list[Backend] = []


def register(backend: Backend, *, fallback: bool = False) -> Backend:
    """Register ``backend`` for its schemes (lower case; a later registration of a scheme
    replaces the earlier one); ``fallback`` also asks it about unregistered schemes."""
    for scheme in backend.schemes:
        _by_scheme[scheme.lower()] = backend
    if fallback:
        if backend.accepts is None:
            raise ValueError(f"the fallback backend {backend.name} needs an accepts() test of schemes")
        _fallback[:] = [backend]
    return backend


def unregister(scheme: str) -> None:
    """Forget ``scheme`` (tests that register a backend of their own)."""
    _by_scheme.pop(scheme.lower(), None)


def schemes() -> tuple[str, ...]:
    """The registered schemes, sorted."""
    return tuple(sorted(_by_scheme))


def scheme_of(url: str) -> str:
    """``url``'s scheme in lower case; ``file`` for a plain path."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else PLAIN_PATH


def backend_for(url: str) -> Backend:
    """The backend registered for ``url``'s scheme (else the fallback's, when it accepts it);
    ``ConfigError`` naming the scheme and the registered ones otherwise (never the URL itself,
    which may hold a secret)."""
    scheme = scheme_of(url)
    backend = _by_scheme.get(scheme)
    if backend is not None:
        return backend
    for fb in _fallback:
        if fb.accepts is not None and fb.accepts(scheme):
            return fb
    also = f", or any protocol {_fallback[0].name} knows" if _fallback else ""
    raise ConfigError(f"no storage backend for URL scheme {scheme!r}: registered schemes are "
                      f"{', '.join(schemes())} (and plain paths){also}")


def open_store(url: str, tier: int, settings: Settings | None = None) -> TierStore:
    """A fresh store for ``url`` at ``tier``, built by its backend's factory."""
    backend = backend_for(url)
    if backend.url_problem is not None and (problem := backend.url_problem(url)) is not None:
        raise ConfigError(problem)  # the URL itself is not echoed: it may hold the secret
    return backend.factory(url, tier, settings)


def tier2_url_problem(url: str) -> str | None:
    """Why ``url`` may not be the Tier 2 root (None when it may): no backend for its scheme, a
    backend that is not an object store, or the backend's own check of its URLs."""
    examples = " or ".join(b.example for b in sorted(set(_by_scheme.values()), key=lambda b: b.name)
                           if b.object_store and b.example) or "an object store URL"
    try:
        backend = backend_for(url)
    except ConfigError as exc:
        return f"tier2_url must look like {examples}: {exc}"
    if not backend.object_store:
        return (f"tier2_url must look like {examples}: Tier 2 is an object store, and {scheme_of(url)!r} "
                f"URLs open the {backend.name} backend, which is not one")
    return backend.url_problem(url) if backend.url_problem is not None else None
