"""The Prefect UI as scripts/ui_screenshot.py sees it: a server on a port other than 4200
renders a flow run from its own API in headless Chromium. Chromium is optional (the script
needs it, `make test` does not): without it this test skips."""

import httpx
import pytest

from ckpt.local_stack import start_prefect_server, stop_process
from scripts import ui_screenshot as shot

CHROMIUM = shot.find_chromium()

pytestmark = [pytest.mark.prefect, pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: only scripts/ui_screenshot.py needs it")]


def test_ui_on_another_port_renders_a_flow_run_in_chromium(tmp_path):
    proc, api = start_prefect_server(tmp_path / "prefect", port=None, ui=True)
    try:
        assert not api.endswith(":4200/api")
        flow = httpx.post(f"{api}/flows/", json={"name": "promote-checkpoint"}, timeout=10).json()
        run = httpx.post(f"{api}/flow_runs/", json={"flow_id": flow["id"], "name": "promote/ui-check/step-7",
                                                    "state": {"type": "COMPLETED"}}, timeout=10).json()
        page = shot.Page("flow-run.png", f"{shot.ui_base(api)}/runs/flow-run/{run['id']}",
                         "promote/ui-check/step-7", 600)
        size = shot.shoot(page, tmp_path, chromium=CHROMIUM, width=1000, budget_ms=20_000)
    finally:
        stop_process(proc)
    assert (tmp_path / "flow-run.png").read_bytes()[:4] == b"\x89PNG" and size > 10_000
