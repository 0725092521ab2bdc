"""The Prefect UI in a real browser, as a user sees it: `ckpt up` (API auth on) promotes a run
saved with the client and refuses a hostile event; headless Chromium logs in with the API auth
string, as a user types it into the UI's login form, and finds the promote runs completed, the
hostile event refused (no run; its rejection on the event feed), the promote run's task runs
and the run's status artifact (scripts/ui_screenshot.py's checks). Without Chromium this test
skips; with ``CI=true`` it fails (``.ci/run`` installs Debian's chromium)."""

import pytest

from scripts import ui_screenshot as shot
from scripts.ui_browser import Browser, BrowserError
from tests.kit.require import require
from tests.kit.up import TAKEN, stack_port

CHROMIUM = shot.find_chromium()
RUN = "ui-check"

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def chromium() -> str:
    require("" if CHROMIUM else "not found (Debian: apt-get install chromium; .ci/run installs it)", "Chromium")
    assert CHROMIUM is not None
    return CHROMIUM


def test_a_user_logged_in_sees_the_promotion_the_refused_hostile_event_and_the_status_page(chromium, tmp_path,
                                                                                           monkeypatch):
    for attempt in range(3):  # P or P + 1 taken meanwhile by another worker's server: another pair
        try:
            proc, exports = shot.start_stack(tmp_path / f"stack{attempt}", stack_port(), timeout=240)
            break
        except SystemExit as exc:
            if TAKEN not in str(exc) or attempt == 2:
                raise
    try:
        for key, value in exports.items():
            monkeypatch.setenv(key, value)
        api = exports["PREFECT_API_URL"]
        secret = exports["PREFECT_API_AUTH_STRING"]
        base = shot.ui_base(api)
        hostile, ids = shot.session(api, run=RUN, interval=0.5, timeout=240)
        with Browser(chromium, width=1400, timeout=90) as browser:
            with pytest.raises(BrowserError, match="the UI refused the API auth string"):
                browser.login(base, secret + "-wrong")  # the UI keeps a wrong secret out
            browser.login(base, secret)
            shot.check_pages(browser, base, run=RUN, hostile=hostile, ids=ids)
            page = shot.pages(base, run=RUN, **ids)[0]
            assert shot.shoot(browser, page, tmp_path) > 0
    finally:
        shot.stop_stack(proc)
    assert (tmp_path / page.file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
