"""A small real tmpfs for full-disk tests: ``mounted_tmpfs(folder, size)`` mounts one (this
needs root), yields the folder and unmounts it after. Where mounting is not allowed the test is
skipped; with ``CI=true`` it fails instead, so CI never passes a full-disk test by skipping it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.kit.require import require


@contextmanager
def mounted_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (created) with a tmpfs of ``size`` (``mount -o size=``: ``2m``, ``512k``) on it."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        require(f"cannot mount a tmpfs on {folder}: {done.stderr.strip() or done.returncode}",
                "a real tmpfs (full-disk tests)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)
