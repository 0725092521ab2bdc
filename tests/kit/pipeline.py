"""The promotion pipeline's test helpers: settings wired to a real catalog with runs
registered (``pipeline_settings``) and a recorder of the events the pipeline announces."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tests.kit.settings import catalog_settings


def pipeline_settings(settings_factory, db_url: str, *, runs: tuple[str, ...] = ("run-a",), **overrides: Any):
    """Settings on a fresh, migrated catalog at ``db_url`` with ``runs`` registered; no retries
    delays (tests that exercise retries set their own)."""
    overrides.setdefault("task_retries", 0)
    overrides.setdefault("copy_parallelism", 2)
    return catalog_settings(settings_factory, db_url, runs=runs, **overrides)


@dataclass
class Recorder:
    """A ``notify`` that records what the pipeline would announce: (event, run, step, part, extra)."""

    seen: list[tuple[str, str, int, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, name: str, run: str, step: int, *, part: int = 0, parts: int = 1, node: str = "",
                 payload: dict[str, Any] | None = None, extra_id: str = "", **_: Any) -> bool:
        with self.lock:
            self.seen.append((name, run, step, part, extra_id))
        return True

    def names(self) -> list[str]:
        return [s[0].rsplit(".", 1)[-1] for s in self.seen]
