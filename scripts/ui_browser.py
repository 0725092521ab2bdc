"""Headless Chromium driven over the DevTools protocol, as a user drives the Prefect UI: it logs
in with the API auth string (types it into the UI's login form and presses Enter), opens pages,
waits until they show what they are meant to show, reads their text and colours, and captures
them as PNGs. One browser, one tab, a fresh profile; used by scripts/ui_screenshot.py and the
browser test (tests/integration/test_ui_chromium.py).

Flags that matter on a closed network: without ``--disable-background-networking`` and its
neighbours Chromium waits on update, sync and field-trial servers it can never reach.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from ckpt.processes import free_port

BROWSER_FLAGS = ("--headless", "--no-sandbox",  # root in a container has no user namespaces; our own loopback UI
                 "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--force-device-scale-factor=1")


_BADGES_JS = r"""(names, states) => {
  const shown = e => e instanceof HTMLElement && (e.offsetParent !== null || e.getClientRects().length > 0);
  const ctx = Object.assign(document.createElement('canvas'), {width: 1, height: 1}).getContext('2d');
  const rgba = c => { ctx.clearRect(0, 0, 1, 1); ctx.fillStyle = c; ctx.fillRect(0, 0, 1, 1);
                      return [...ctx.getImageData(0, 0, 1, 1).data]; };  // any CSS colour (oklch too)
  const colour = e => {  // its text colour, or its background where the text is black, white or grey
    for (; e; e = e.parentElement) {
      const s = getComputedStyle(e);
      for (const c of [s.color, s.backgroundColor]) {
        const [r, g, b, a] = rgba(c);
        if (a > 80 && Math.max(r, g, b) - Math.min(r, g, b) > 30) return [r, g, b];
      }
    }
    return null;
  };
  const out = {};
  const own = e => shown(e) && states.includes(e.innerText.trim());
  const badges = [...document.querySelectorAll('body *')].filter(e => own(e) && ![...e.children].some(own));
  for (const badge of badges) {  // the row it belongs to: the nearest box naming one run, and only one
    for (let box = badge.parentElement; box; box = box.parentElement) {
      const named = names.filter(n => box.innerText.includes(n));
      if (named.length > 1) break;
      if (named.length === 1) { out[named[0]] = [badge.innerText.trim(), colour(badge)]; break; }
    }
  }
  return out;
}"""
_LOGIN_OUTCOME_JS = r"""(() => {
  const refused = document.querySelector('.text-destructive');
  if (refused && refused.innerText.trim()) return refused.innerText.trim();
  if (document.body && document.body.innerText.includes('Authentication failed')) return 'Authentication failed';
  if (!location.pathname.endsWith('/login') && !document.querySelector('input[type=password]')) return 'in';
  return null;
})()"""
STATES = ("Completed", "Failed", "Crashed", "Running", "Pending", "Scheduled", "Cancelled", "Late")


class BrowserError(RuntimeError):
    """The browser did not start, or a page did not show what it should (with what it showed)."""


def browser_command(chromium: str, *, port: int, profile: Path, width: int, height: int) -> list[str]:
    """Chromium listening for the DevTools protocol on loopback ``port``, on a blank page."""
    return [chromium, *BROWSER_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={port}", "about:blank"]


class Browser:
    """One headless Chromium and one tab. Use as a context manager (the process and its fresh
    profile are gone afterwards)."""

    def __init__(self, chromium: str, *, width: int = 1400, height: int = 900, timeout: float = 60.0):
        self.width, self.height, self.timeout = width, height, timeout
        self._profile = tempfile.TemporaryDirectory(prefix="ckpt-ui-browser-", ignore_cleanup_errors=True)
        self._log = Path(self._profile.name) / "chromium.log"
        port = free_port()
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(browser_command(chromium, port=port, profile=Path(self._profile.name) / "p",
                                                         width=width, height=height),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._ids = 0
        try:
            self._ws = self._connect(port)
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _connect(self, port: int) -> Any:
        import httpx
        from websockets.sync.client import connect

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                tabs = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
                page = next(t for t in tabs if t.get("type") == "page")
                return connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
            except (httpx.HTTPError, StopIteration, OSError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BrowserError(f"Chromium did not start (exit {self.proc.poll()}): {self.log()[-2000:]}")
            time.sleep(0.3)

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        self._ids += 1
        me = self._ids
        self._ws.send(json.dumps({"id": me, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=self.timeout))
            if msg.get("id") == me:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            details = r["exceptionDetails"]
            raise BrowserError(f"{expression[:80]}: {details.get('exception', {}).get('description') or details}")
        return r.get("result", {}).get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, expression: str, what: str, timeout: float | None = None) -> Any:
        """Until ``expression`` is truthy in the page; its value. ``BrowserError`` with the
        page's URL and text when it never is."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:  # the page is navigating: its context went away
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{what} not shown at {self.evaluate('location.href')} after "
                                   f"{timeout or self.timeout:.0f}s; the page shows: {self.text()[:1500]!r}")
            time.sleep(0.3)

    def wait_text(self, text: str, timeout: float | None = None) -> None:
        self.wait_for(f"document.body && document.body.innerText.includes({json.dumps(text)})", repr(text), timeout)

    def login(self, ui_base: str, auth_string: str) -> None:
        """As a user logs in: open the UI, which shows its login form when the API needs auth;
        type the auth string and press Enter; wait until the UI has left the login page."""
        self.open(f"{ui_base}/runs")
        self.wait_for("!!document.querySelector('input[type=password]')", "the UI's login form")
        self.evaluate("document.querySelector('input[type=password]').focus()")
        self.call("Input.insertText", text=auth_string)
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      **({"text": "\r"} if kind == "keyDown" else {}))
        outcome = self.wait_for(_LOGIN_OUTCOME_JS, "the UI after login")
        if outcome != "in":
            raise BrowserError(f"the UI refused the API auth string: {outcome}")

    def run_states(self, names: list[str]) -> dict[str, tuple[str, tuple[int, int, int] | None]]:
        """For each of the flow runs ``names`` listed on the page: the state its badge reads and
        the colour a user sees on it (the badge's text colour, or its background where the text
        is black, white or grey); runs without a badge in their own row are left out."""
        found = self.evaluate(f"({_BADGES_JS})({json.dumps(names)}, {json.dumps(STATES)})") or {}
        return {name: (state, tuple(rgb) if rgb else None) for name, (state, rgb) in found.items()}  # type: ignore[misc]

    def wait_for_states(self, names: list[str], timeout: float | None = None) -> dict[str, tuple[str, Any]]:
        """``run_states`` once every one of ``names`` has its badge (the list fills in as it loads)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            shown = self.run_states(names)
            if set(names) <= shown.keys():
                return shown
            if time.monotonic() > deadline:
                raise BrowserError(f"no state badge for {sorted(set(names) - shown.keys())}; shown: {shown}")
            time.sleep(0.5)

    def screenshot(self, png: Path, *, height: int | None = None) -> int:
        """The visible page (``width`` x ``height``) as a PNG; its size in bytes."""
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=height or self.height,
                  deviceScaleFactor=1, mobile=False)
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        png.write_bytes(data)
        return len(data)

    def close(self) -> None:
        """Close the tab's socket, end Chromium and every process it started (its renderer, GPU
        and crash handler live in its session and may outlive it, writing into the profile), then
        remove the profile."""
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the rest of its session: start_new_session
        for _ in range(20):  # a child killed a moment ago may still be flushing into the profile
            try:
                shutil.rmtree(self._profile.name)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.25)
        self._profile.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_red(rgb: tuple[int, int, int] | None) -> bool:
    """A colour a user reads as red (Prefect's failed state: a red badge)."""
    return rgb is not None and rgb[0] > 150 and rgb[0] > rgb[1] + 60 and rgb[0] > rgb[2] + 40
