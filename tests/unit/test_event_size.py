"""Events over the orchestrator's size limit never leave: Prefect's server would answer 204 and
drop them (PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES, 1.5 MB by default)."""

from __future__ import annotations

import pytest

from ckpt.announce import completed_payload
from core import events
from core.errors import EventTooLarge
from core.manifest import FileEntry, Manifest
from tasks.prefect_events import emit


def test_a_completed_event_stays_small_whatever_the_checkpoint_holds():
    files = tuple(FileEntry(f"shard-{i:06d}.distcp", 1 << 30, "0" * 8) for i in range(200_000))
    m = Manifest(run="r" * 128, step=10**9, files=files, node="gpu-node-07", format="dcp")
    ev = events.build_event(events.COMPLETED, m.run, m.step, node=m.node, payload=completed_payload(m))
    assert ev["payload"]["files"] == 200_000
    assert len(str(ev)) < 4096  # counts and names only, never the file list


def test_an_event_over_the_limit_is_refused_before_anything_is_sent(monkeypatch):
    def never(*a, **k):
        raise AssertionError("an oversize event was posted")

    monkeypatch.setattr(events, "post_events", never)
    huge = {"notes": "x" * events.MAX_EVENT_BYTES}
    with pytest.raises(EventTooLarge, match="PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES"):
        emit(events.COMPLETED, "run-a", 1, payload=huge, api_url="http://127.0.0.1:9/api")


def test_the_limit_keeps_headroom_for_what_the_server_adds():
    body = events.build_event(events.COMPLETED, "run-a", 1)
    fits = events.MAX_EVENT_BYTES - events.EVENT_HEADROOM_BYTES
    assert events.check_size(body, max_bytes=fits + len(str(body)) * 2) is body
    with pytest.raises(EventTooLarge):
        events.check_size({**body, "payload": {"x": "y" * fits}})
