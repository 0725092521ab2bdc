"""``ckpt.tier.low`` from a training process reaches the real Prefect server's event feed (what
the UI's event page lists), with the tier and node labels an automation or a filter matches."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.kit.agents import recorded_events
from tests.kit.settings import catalog_settings
from tests.kit.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.prefect


def test_low_tier0_headroom_is_in_the_servers_event_feed(prefect_server, settings_factory, sqlite_url, tmp_path):
    from ckpt.client import CheckpointStager
    from core import events

    with mounted_tmpfs(tmp_path / "nvme", "4m") as tier0:
        settings = catalog_settings(settings_factory, sqlite_url, runs=("low-run",), tier0_url=str(tier0),
                                    prefect_api_url=prefect_server, tier_low_headroom_checkpoints=3)
        rng = np.random.default_rng(0)
        with CheckpointStager("low-run", settings=settings) as st:  # 1 MiB: fewer than 3 more fit after 100
            st.save(100, {"w": rng.standard_normal(256 * 1024, dtype=np.float32)})
        deadline = time.monotonic() + 60
        while not (seen := recorded_events(prefect_server, events.TIER_LOW, "low-run")) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert len(seen) == 1
    res = seen[0]["resource"]
    assert res["ckpt.tier"] == "0" and res["ckpt.node"] == "node-0" and res["ckpt.step"] == "100"
    assert seen[0]["payload"]["threshold"] == 3
