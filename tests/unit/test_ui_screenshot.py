"""scripts/ui_screenshot.py without a browser: how it starts Chromium, which pages it
shoots, how it reads `ckpt up`'s exports; and that the docs' UI chapter shows exactly its screenshots."""

import re
import shlex
from pathlib import Path

import pytest

from scripts import ui_screenshot as shot

REPO = Path(__file__).resolve().parents[2]
IMG = REPO / "docs" / "img"
IDS = dict(promote_run_id="fr-1", automation_id="au-2", artifact_id="ar-3")


def test_defaults_start_a_stack_and_write_into_docs_img():
    a = shot.parse_args([])
    assert a.api_url is None and a.out == IMG and a.run == "gpt-sft"
    a = shot.parse_args(["--api-url", "http://127.0.0.1:4200/api", "--out", "/tmp/x", "--width", "1200"])
    assert (a.api_url, a.out, a.width) == ("http://127.0.0.1:4200/api", Path("/tmp/x"), 1200)


def test_help_names_the_pages(capsys):
    with pytest.raises(SystemExit) as e:
        shot.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--api-url" in out and "rpo-automation.png" in out


def test_chromium_runs_headless_on_a_closed_network_driven_over_loopback(tmp_path):
    from scripts.ui_browser import browser_command

    cmd = browser_command("/usr/bin/chromium", port=9333, profile=tmp_path / "p", width=1400, height=900)
    assert cmd[0] == "/usr/bin/chromium" and cmd[-1] == "about:blank"
    assert {"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=9333",
            f"--user-data-dir={tmp_path / 'p'}", "--window-size=1400,900"} <= set(cmd)


def test_red_is_what_a_user_calls_red():
    from scripts.ui_browser import is_red

    assert is_red((220, 38, 38)) and is_red((239, 68, 68))  # Tailwind's red-600 / red-500
    assert not any(is_red(c) for c in [(22, 163, 74), (128, 128, 128), (250, 204, 21), None])


def test_pages_point_at_the_promotion_the_automation_and_the_status_artifact():
    pages = {p.file: p for p in shot.pages("http://h:4301/v2", run="r1", **IDS)}
    assert pages["flow-runs.png"].url == "http://h:4301/v2/runs"
    assert pages["flow-runs.png"].expect == "promote/r1/step-"
    assert pages["promote-run.png"].url == "http://h:4301/v2/runs/flow-run/fr-1?tab=TaskRuns"
    assert pages["rpo-automation.png"].url.endswith("/automations/automation/au-2")
    assert pages["rpo-automation.png"].expect == "ckpt-rpo-late"
    assert pages["run-status.png"].url.endswith("/artifacts/artifact/ar-3")


def test_exports_read_back_as_ckpt_up_quotes_them():
    values = {"CKPT_CATALOG_URL": "sqlite:////tmp/a dir/catalog.db", "PREFECT_API_URL": "http://127.0.0.1:4301/api"}
    printed = "Prefect UI   http://127.0.0.1:4301\n" + "".join(
        f"  export {k}={shlex.quote(v)}\n" for k, v in values.items()) + "Ctrl-C stops the stack\n"
    assert shot.parse_exports(printed) == values


def test_missing_browser_is_none(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shot.find_chromium() is None


def test_the_ui_chapter_shows_each_screenshot_the_script_makes_and_nothing_else():
    chapter = (REPO / "docs" / "ui.md").read_text()
    shown = set(re.findall(r"\(img/([^)\s]+)\)", chapter))
    on_disk = {p.name for p in IMG.glob("*.png")}
    made = {p.file for p in shot.pages("http://h/v2", run="r", **IDS)}
    assert shown == on_disk == made
    for name in on_disk:
        size = (IMG / name).stat().st_size
        assert (IMG / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < size <= shot.SIZE_WARN_BYTES, name
