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
        flow = created(f"{api}/flows/", {"name": "promote-checkpoint"})
        run = created(f"{api}/flow_runs/", {"flow_id": flow["id"], "name": "promote/ui-check/step-7",
                                            "state": {"type": "COMPLETED"}})
        page = shot.Page("flow-run.png", f"{shot.ui_base(api)}/runs/flow-run/{run['id']}",
                         "promote/ui-check/step-7", 600)
        size = shot.shoot(page, tmp_path, chromium=CHROMIUM, width=1000, budget_ms=20_000)
    finally:
        stop_process(proc)
    assert (tmp_path / "flow-run.png").read_bytes()[:4] == b"\x89PNG" and size > 10_000


def created(url: str, body: dict) -> dict:
    """POST until the server answers with the created object (a server just started on a busy
    machine may still answer 5xx for a moment); the last answer in the failure otherwise."""
    from tests.kit.agents import wait_for

    last: list[httpx.Response] = []

    def post():
        last[:] = [httpx.post(url, json=body, timeout=30)]
        return last[0].is_success and "id" in last[0].json()

    try:
        wait_for(f"POST {url}", post, timeout=60)
    except Exception as exc:
        answer = f"{last[0].status_code} {last[0].text[:500]}" if last else "no answer"
        raise AssertionError(f"{url}: {answer}") from exc
    return last[0].json()
