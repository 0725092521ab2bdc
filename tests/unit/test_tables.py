"""The CLI's tables at 80 columns: an id, a state or a word is never folded in the middle; an id
too long for the room is shortened in its middle (``…``), and a path breaks after a ``/``."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console
from typer.testing import CliRunner

import ckpt.commands.catalog as catalog_commands
from ckpt.cli import app
from ckpt.tables import table
from db.catalog import Catalog
from tests.kit.catalog import checkpoint, verified

RUN = "llama-70b-sft-lr3e-5-warmup2000-cosine-seed1234-final"
WHOLE = (RUN, "committed", "verified", "milestone", "2026-12-05")


def fragments(text: str, words=WHOLE) -> list[str]:
    """Pieces of ``words`` printed without the rest of the word and without a ``…`` that says so."""
    return [t for t in text.split() for w in words
            if t != w and len(t) >= 3 and not t.isdigit() and t in w and "…" not in t]


def shown_whole_or_shortened(text: str, word: str) -> bool:
    return word in text.split() or any("…" in t and word.startswith(t.split("…")[0].split(":")[-1])
                                       and word.endswith(t.split("…")[1].split("/")[0]) for t in text.split())


def render(t, width: int = 80) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(t)
    return buf.getvalue()


def test_a_table_with_long_ids_at_80_columns_splits_no_word():
    t = table("at", "run", "step", "state", "url", "reason", right=("step",))
    for state in ("committed", "verified"):
        t.add_row("2026-12-05 16:00:34", RUN, "1000", state, f"file:///lustre/ckpt/{RUN}/step-00001000/part-0",
                  "kept: the newest verified checkpoint of the run, milestone")
    text = render(t)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not fragments(text), text
    assert shown_whole_or_shortened(text, RUN) and "committed" in text.split() and "verified" in text.split()
    assert "step-00001000/" in text.split() or "step-00001000/part-0" in text.split()  # a path breaks after a /


def test_a_table_that_fits_is_printed_whole():
    t = table("run", "state")
    t.add_row(RUN, "committed")
    text = render(t)
    assert RUN in text and "…" not in text


@pytest.fixture
def long_catalog(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    cat = Catalog.open(url, auto_upgrade=True)
    ck = checkpoint(cat, RUN, 1000, kind="milestone")
    verified(cat, ck.id, 1)
    checkpoint(cat, "short", 2000)
    cat.close()
    for key in [k for k in os.environ if k.startswith("CKPT_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CKPT_CATALOG_URL", url)
    monkeypatch.setattr(catalog_commands.out, "width", 80)  # the module's console, made at import
    return url


@pytest.mark.parametrize("command", [["ls"], ["audit"], ["show", RUN, "1000"], ["locate", RUN, "1000"],
                                     ["lineage", RUN, "1000"], ["latest", RUN]])
def test_the_catalog_commands_at_80_columns_split_no_id_or_state(long_catalog, command):
    result = CliRunner().invoke(app, command, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
    assert not fragments(result.output), result.output
