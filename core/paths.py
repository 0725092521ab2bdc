"""Confinement of paths that arrive from events, manifests and API calls (invariant 5)."""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from core.errors import PathEscape, quoted

_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safe_run_name(run: str) -> str:
    """A run name usable as one path segment on every tier; raises ``PathEscape`` otherwise."""
    if not isinstance(run, str) or not _RUN_RE.fullmatch(run) or ".." in run:
        raise PathEscape(f"invalid run name {quoted(run)}: use letters, digits, '.', '_' or '-' "
                         "(at most 128 characters)")
    return run


def safe_relpath(rel: str) -> str:
    """Normalise a relative, '/'-separated path or raise ``PathEscape``.

    Rejects absolute paths, ``..`` segments, empty segments, backslashes, NUL and control
    characters. Returns the path unchanged when it is clean.
    """
    if not isinstance(rel, str) or not rel:
        raise PathEscape(f"empty or non-string path {rel!r}")
    if "\\" in rel or any(ord(c) < 32 for c in rel):
        raise PathEscape(f"path {rel!r} contains a backslash or a control character")
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith("/"):
        raise PathEscape(f"absolute path {rel!r} is not allowed")
    parts = rel.split("/")
    if any(seg in ("", ".", "..") for seg in parts):
        raise PathEscape(f"path {rel!r} escapes or is not normalised (no '', '.', '..' segments)")
    return rel


def confine_local(root: str | os.PathLike, rel: str) -> Path:
    """Join ``rel`` under the local folder ``root`` and prove the result stays inside it.

    Symlinks are resolved: a link (anywhere on the way) that leaves ``root`` raises
    ``PathEscape``. The target need not exist.
    """
    safe_relpath(rel)
    root_real = Path(root).resolve()
    target = (root_real / rel).resolve()
    if target != root_real and root_real not in target.parents:
        raise PathEscape(f"path {rel!r} resolves outside the tier root {str(root_real)!r}")
    return target
