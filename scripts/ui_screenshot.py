#!/usr/bin/env python3
"""Screenshots of a promotion in the Prefect UI, as shown in the README (``docs/img/``).

    python scripts/ui_screenshot.py                  # starts `ckpt up`, stops it afterwards
    python scripts/ui_screenshot.py --api-url "$PREFECT_API_URL"   # a running `ckpt up --no-auth`

It starts ``ckpt up`` (API auth on) on a free port and takes the exports it prints (with
``--api-url`` it attaches to a running stack instead, in a shell that holds those exports),
trains a tiny run with the client (``<run>-pt`` step 1000; once it is promoted, ``<run>``
resumed from it, steps 100 and 200, ``--interval`` seconds apart; milestones 1000 and 200,
which their promote runs archive to Tier 2 inline), sends one hostile event (a run name that
escapes the tier root, which the node's agent refuses before any run), waits until every promote flow run has
finished, logs in to the UI in headless Chromium with the API auth string
(``PREFECT_API_AUTH_STRING``, typed into the UI's login form) and checks, then captures, four
pages:

    flow-runs.png       the flow runs list (promote/<run>/step-<n>)
    promote-run.png     one promote flow run: its task-run graph and task runs
    rpo-automation.png  the automation ckpt-rpo-late
    run-status.png      the status artifact run-<run> (markdown)

What is checked is what a user looks for (``check_pages``): the promote runs of each saved
step, completed, in the flow runs list, and no run for the hostile event, whose refusal
(``ckpt.checkpoint.rejected``) the event's own page shows with the hostile run name; the
promote run's task runs, and in its Artifacts tab the run's status page; on the status
artifact, its at-a-glance answers (the newest durable checkpoint, the RPO line, the failed
promote runs, the bytes per tier) and the newest verified step. A page that does not show its
text in time (a spinner, an error page, a UI that calls a wrong API) fails the script with the
text it did show; nothing blank is saved. Chromium is driven over the DevTools protocol
(scripts/ui_browser.py). Needs Chromium (Debian: ``apt-get install chromium``) and the
project's venv; ``make test`` runs it in tests/integration/test_ui_chromium.py (with
``CI=true`` a missing Chromium fails that test).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: this checkout's packages
    sys.path.insert(0, str(REPO))

from ckpt.client import CheckpointStager  # noqa: E402
from core import events  # noqa: E402
from core.events import AUTH_STRING_ENV  # noqa: E402
from deployments.automations import AUTOMATION_NAME  # noqa: E402
from flows.artifacts import artifact_key  # noqa: E402
from scripts.ui_browser import Browser, BrowserError, is_red  # noqa: E402
from tasks import prefect_events  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "img"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
SIZE_WARN_BYTES = 200_000  # the README's images stay small


@dataclass(frozen=True)
class Page:
    file: str     # PNG name under the output folder
    url: str
    expect: str   # text the rendered DOM must hold
    height: int   # window height: what is captured (the width is --width)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ui_screenshot.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNGs (default: docs/img)")
    p.add_argument("--api-url", default=None,
                   help="attach to the `ckpt up` whose Prefect API this is (run in a shell holding its "
                        "exports); default: start `ckpt up` and stop it afterwards")
    p.add_argument("--port", type=int, default=4300,
                   help="Prefect port of the started stack (ckpt up --port: an error if taken)")
    p.add_argument("--dir", type=Path, default=None, help="data folder of the started stack (default: a temp folder)")
    p.add_argument("--run", default="gpt-sft", help="run to train (its parent is <run>-pt)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds of \"training\" between the run's saves")
    p.add_argument("--chromium", default=None,
                   help=f"browser binary (default: the first of {', '.join(BROWSERS)} on PATH)")
    p.add_argument("--width", type=int, default=1400, help="window width in CSS pixels")
    p.add_argument("--budget-ms", type=int, default=30_000, help="how long a page may take to show its text")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the stack and the promotions")
    return p.parse_args(argv)


def find_chromium(explicit: str | None = None) -> str | None:
    for name in (explicit,) if explicit else BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def pages(ui_base: str, *, run: str, promote_run_id: str, automation_id: str, artifact_id: str) -> list[Page]:
    """What is shot, with the text each page must show once rendered. ``ui_base``: the UI's
    root with the current UI's base path (``http://127.0.0.1:4200/v2``)."""
    return [
        Page("flow-runs.png", f"{ui_base}/runs", f"promote/{run}/step-", 1250),
        Page("promote-run.png", f"{ui_base}/runs/flow-run/{promote_run_id}?tab=TaskRuns", "mark-complete", 900),
        Page("rpo-automation.png", f"{ui_base}/automations/automation/{automation_id}", AUTOMATION_NAME, 330),
        Page("run-status.png", f"{ui_base}/artifacts/artifact/{artifact_id}", "Newest verified checkpoint", 1200),
    ]


def parse_exports(text: str) -> dict[str, str]:
    """The ``export K=V`` lines ``ckpt up`` prints (values shell-quoted)."""
    out = {}
    for line in text.splitlines():
        words = shlex.split(line.strip()) if line.strip().startswith("export ") else []
        if len(words) == 2 and "=" in words[1]:
            key, _, value = words[1].partition("=")
            out[key] = value
    return out


def start_stack(root: Path, port: int, timeout: float) -> tuple[subprocess.Popen, dict[str, str]]:
    """``ckpt up`` in a child process; returns it and the exports it printed once ready."""
    log = root / "ckpt-up.log"
    root.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "up", "--dir", str(root / "stack"),
                                 "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(),
                                     # the promotions shown are the event-driven ones, not reconcile's
                                     "CKPT_RECONCILE_INTERVAL_SECONDS": "3600"},
                                start_new_session=True)  # a Ctrl-C reaches this script, which stops it
    deadline = time.monotonic() + timeout
    while "Ctrl-C stops the stack" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_stack(proc)
            raise SystemExit(f"`ckpt up` did not come up; its output:\n{log.read_text()}")
        time.sleep(0.5)
    return proc, parse_exports(log.read_text())


def stop_stack(proc: subprocess.Popen) -> None:
    """SIGTERM, which ``ckpt up`` handles as Ctrl-C (a SIGINT may be ignored where this script
    runs in the background); SIGKILL if it is not down in two minutes."""
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _pythonpath() -> str:
    """This checkout first, for ``ckpt up`` too."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def train(run: str, *, parent: str | None = None, steps: tuple[int, ...], milestone: int,
          interval: float = 0.0) -> list[str]:
    """A tiny job with the client, in this process's environment: ``steps`` of ``run`` (the
    first resumed from ``parent`` step 1000, if given), ``interval`` seconds of "training"
    between saves (the status page's save interval and ΔMFU come from it). Returns the flow
    runs to wait for: a promote per step (it archives the milestone inline)."""
    import numpy as np

    rng = np.random.default_rng(steps[0])
    origin = (parent, 1000) if parent else None
    with CheckpointStager(run, resumed_from=origin) as stager:
        for i, step in enumerate(steps):
            if i:
                time.sleep(interval)
            stager.save(step, {"w": rng.standard_normal((512, 512), dtype=np.float32)}, milestone=step == milestone,
                        metrics={"loss": 2.0 - step / 1000}, parent=origin if i == 0 else None)
    return [f"promote/{run}/step-{s}" for s in steps]


def _post(api_url: str, path: str, body: dict) -> Any:
    import httpx

    r = httpx.post(f"{api_url}{path}", json=body, timeout=10, headers=prefect_events.auth_headers())
    r.raise_for_status()
    return r.json()


HOSTILE_RUN = "../../etc"  # a run name that escapes the tier root: its promote run must fail


def send_hostile_event(api_url: str, node: str) -> None:
    """A completed-checkpoint event whose run name escapes the tier root, as a hostile or broken
    client could send: the node's agent refuses it (a catalog record and a
    ``ckpt.checkpoint.rejected`` event in the feed), no flow run starts."""
    import uuid

    ev = events.build_event(events.COMPLETED, "hostile", 1, node=node)
    ev["id"] = str(uuid.uuid4())
    ev["payload"] = {**ev.get("payload", {}), "run": HOSTILE_RUN, "step": 1, "node": node}
    events.post_events(api_url, [ev], headers=prefect_events.auth_headers())


def wait_rejection(api_url: str, timeout: float) -> dict[str, Any]:
    """Until the event feed holds the agent's ``ckpt.checkpoint.rejected`` for the hostile run;
    that event (JSON)."""
    deadline = time.monotonic() + timeout
    while True:
        found = _post(api_url, "/events/filter", {"filter": {"event": {"name": [events.REJECTED]}}, "limit": 50})
        hits = [e for e in found.get("events", []) if HOSTILE_RUN in json.dumps(e)]
        if hits:
            return hits[0]
        if time.monotonic() > deadline:
            raise SystemExit(f"no {events.REJECTED} for the hostile run after {timeout:.0f}s")
        time.sleep(1)


def wait_flow_runs(api_url: str, names: list[str], timeout: float, *, state: str = "COMPLETED") -> dict[str, str]:
    """Until a flow run of each name has reached ``state``; their ids by name. Fails at once on
    one that ended otherwise (FAILED or CRASHED where COMPLETED is wanted)."""
    deadline = time.monotonic() + timeout
    ended = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"} - {state}
    while True:
        runs = _post(api_url, "/flow_runs/filter", {"flow_runs": {"name": {"any_": names}}, "limit": 200})
        bad = [(r["name"], r["state_type"]) for r in runs if r["state_type"] in ended]
        if bad:
            raise SystemExit(f"flow runs did not end {state}: {bad}")
        done = {r["name"]: r["id"] for r in runs if r["state_type"] == state}
        if set(names) <= done.keys():
            return done
        if time.monotonic() > deadline:
            raise SystemExit(f"not {state} after {timeout:.0f}s: {sorted(set(names) - done.keys())}")
        time.sleep(1)


def ui_base(api_url: str) -> str:
    """The UI's root for this API, from the server's own ``/ui-settings``; refuses a UI that
    would call another API than ``api_url`` (its pages would render errors)."""
    import httpx

    root = api_url.rstrip("/").removesuffix("/api")
    ui = httpx.get(f"{root}/ui-settings", timeout=10).json()
    if ui["api_url"].rstrip("/") != api_url.rstrip("/"):
        raise SystemExit(f"the UI at {root} calls {ui['api_url']}, not {api_url}: "
                         "start the server with PREFECT_SERVER_UI_API_URL set to its API URL")
    base = (ui.get("v2_base_url") if ui.get("default_ui") == "v2" else ui.get("v1_base_url")) or "/"
    return root + base.rstrip("/")


def busiest_promote(api_url: str, run: str, flow_runs: dict[str, str]) -> str:
    """The promote run with the most task runs, the milestone first among equals: on a stack
    whose reconcile runs often, reconcile may have done a promotion before its event-driven
    run, which then only registers and finds it done."""
    ids = [flow_runs[f"promote/{run}/step-{s}"] for s in (200, 100)] + [flow_runs[f"promote/{run}-pt/step-1000"]]
    counts = [_post(api_url, "/task_runs/count", {"flow_runs": {"id": {"any_": [i]}}}) for i in ids]
    return ids[counts.index(max(counts))]


def lookup(api_url: str, run: str, flow_runs: dict[str, str]) -> dict[str, str]:
    """Ids of what is shot: a promote run (``busiest_promote``), the RPO automation, the newest
    version of the run's status artifact."""
    autos = [a for a in _post(api_url, "/automations/filter", {}) if a["name"] == AUTOMATION_NAME]
    arts = _post(api_url, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": [artifact_key("run", run)]}}})
    if not autos or not arts:
        raise SystemExit(f"missing in the UI: {'' if autos else AUTOMATION_NAME} "
                         f"{'' if arts else artifact_key('run', run)}")
    return {"promote_run_id": busiest_promote(api_url, run, flow_runs), "automation_id": autos[0]["id"],
            "artifact_id": arts[0]["latest_id"]}


def check_pages(browser: Browser, base: str, *, run: str, hostile: str, ids: dict[str, str]) -> None:
    """What a user checks in the UI after `ckpt up` promoted a run and refused a hostile event;
    ``BrowserError`` (with what the page showed) at the first that does not hold."""
    browser.open(f"{base}/runs")
    promotes = [f"promote/{run}-pt/step-1000", f"promote/{run}/step-100", f"promote/{run}/step-200"]
    for name in promotes:
        browser.wait_text(name)
    if "malformed-event" in browser.text():
        raise BrowserError("the hostile event started a flow run: the agent must refuse it before any run")
    shown = browser.wait_for_states(promotes)
    # the refusal is in the event feed: the event's own page names it and the hostile run
    browser.open(f"{base}/events/event/{hostile}")
    browser.wait_text("rejected")
    browser.wait_text(HOSTILE_RUN)
    wrong = {name: shown[name] for name in promotes if shown[name][0] != "Completed" or is_red(shown[name][1])}
    if wrong:
        raise BrowserError(f"promote runs not shown completed: {wrong}")
    browser.open(f"{base}/runs/flow-run/{ids['promote_run_id']}?tab=TaskRuns")
    for task in ("mark-complete", "Completed"):  # the checkpoint's follow-ups; its parts' hops were the agent's
        browser.wait_text(task)
    # one click from the run: its Artifacts tab holds the hop table of its parts (each part's
    # Tier 1 hop with its attempts) and the training run's status page (stable key)
    browser.open(f"{base}/runs/flow-run/{ids['promote_run_id']}?tab=Artifacts")
    browser.wait_text(artifact_key("promote", run))
    browser.wait_text(artifact_key("run", run))
    browser.open(f"{base}/artifacts/artifact/{ids['artifact_id']}")
    # the answers a platform engineer looks for first: the newest durable checkpoint (200, the
    # newest saved), nothing late past the RPO, no failed promote run of this run (the hostile
    # event's is another run's), each tier's bytes
    for text in ("At a glance", "Newest durable checkpoint", "step 200", "Late past the RPO", "Failed promote runs",
                 "Bytes per tier", "Tier 2 (object store)", "Newest verified checkpoint", run):
        browser.wait_text(text)
    for text in ("none yet", "not repaired", "not known"):
        if text in browser.text():
            raise BrowserError(f"the status page of {run} shows {text!r}: {browser.text()[:2000]}")


def shoot(browser: Browser, page: Page, out: Path) -> int:
    """Open ``page`` and, once it shows ``page.expect``, capture it into ``out/page.file``; the
    PNG's size in bytes (nothing is saved for a page that never shows its text)."""
    browser.open(page.url)
    browser.wait_text(page.expect)
    time.sleep(1.0)  # what loads after the text (charts, badges) settles
    return browser.screenshot(out / page.file, height=page.height)


def session(api_url: str, *, run: str, interval: float, timeout: float) -> tuple[str, dict[str, str]]:
    """Train ``<run>-pt`` and ``<run>`` (see the module's docstring) and send the hostile event,
    in this process's environment (the exports of the stack); (the hostile event's refusal as
    the UI's event page names it, ``<date>/<event id>``; the ids of what is shot) once every
    promote run has finished."""
    parent = f"{run}-pt"
    flow_runs = wait_flow_runs(api_url, train(parent, steps=(1000,), milestone=1000), timeout)
    # once the parent is in the catalog, the child's first checkpoint links to it
    send_hostile_event(api_url, os.environ.get("CKPT_NODE", "node-0"))
    flow_runs |= wait_flow_runs(api_url, train(run, parent=parent, steps=(100, 200), milestone=200,
                                               interval=interval), timeout)
    rejected = wait_rejection(api_url, timeout)
    return f"{rejected['occurred'][:10]}/{rejected['id']}", lookup(api_url, run, flow_runs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        raise SystemExit("no Chromium found (Debian: apt-get install chromium), or name it with --chromium")
    stack, tmp = None, None
    try:
        if args.api_url:
            api_url = args.api_url
        else:
            tmp = tempfile.TemporaryDirectory(prefix="ckpt-shot-")
            root = args.dir or Path(tmp.name)
            print(f"starting `ckpt up` under {root} ...", flush=True)
            stack, exports = start_stack(root, args.port, args.timeout)
            os.environ.update(exports)  # the job below runs with exactly what `ckpt up` printed
            api_url = exports["PREFECT_API_URL"]
        base = ui_base(api_url)
        print(f"training {args.run}-pt and {args.run} against {api_url} ...", flush=True)
        hostile, ids = session(api_url, run=args.run, interval=args.interval, timeout=args.timeout)
        args.out.mkdir(parents=True, exist_ok=True)
        with Browser(chromium, width=args.width, timeout=args.budget_ms / 1000 + 30) as browser:
            browser.login(base, os.environ.get(AUTH_STRING_ENV, ""))
            check_pages(browser, base, run=args.run, hostile=hostile, ids=ids)
            for page in pages(base, run=args.run, **ids):
                size = shoot(browser, page, args.out)
                warn = f"  (over {SIZE_WARN_BYTES // 1000} KB)" if size > SIZE_WARN_BYTES else ""
                print(f"{args.out / page.file}: {size // 1024} KiB, {page.url}{warn}", flush=True)
    finally:
        if stack is not None:
            stop_stack(stack)
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
