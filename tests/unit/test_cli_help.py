"""Every command's ``--help`` reads cleanly on an 80-column terminal: each paragraph reflowed to
the width (no line broken early where a docstring's line ended), no word, option or variable
name cut or broken across lines, and no markup printed literally."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
import typer.main
from typer.testing import CliRunner

from ckpt.cli import app

WIDTH = 80
HELP_WIDTH = WIDTH - 2  # click wraps its help two columns inside the terminal
STRAY = ("``", "[bold", "[/", "\b", "\\b", "…", "│")  # markup, an ellipsis cut, a panel's border


def _paths(cmd, path: tuple[str, ...] = ()):
    yield path
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _paths(sub, (*path, name))


COMMANDS = list(_paths(typer.main.get_command(app)))


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(WIDTH), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def early_breaks(text: str) -> list[str]:
    """Lines of a paragraph (the description, or an option's help carried on) that end before
    the next line's first word would have filled them: a line break that the source put there."""
    lines = text.splitlines()
    bad = []
    in_section = False
    for a, b in pairwise(lines):
        if re.fullmatch(r"\S.*:", a):
            in_section = True
        indent_a, indent_b = len(a) - len(a.lstrip()), len(b) - len(b.lstrip())
        if not a.strip() or not b.strip() or indent_a != indent_b or a.startswith("Usage:"):
            continue
        if in_section and indent_a <= 2:  # two entries of a list, not one paragraph
            continue
        if len(a) + 1 + len(b.split()[0]) <= HELP_WIDTH:
            bad.append(f"{a!r} | {b.split()[0]!r}")
    return bad


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(("ckpt", *p)))
def test_help_at_80_columns_has_no_stray_markup_and_no_broken_word(path):
    text = _help(path)
    assert not [s for s in STRAY if s in text], text
    assert not [line for line in text.splitlines() if len(line) > WIDTH], text
    assert not [line for line in text.splitlines() if re.search(r"\w-$", line)], text  # a word broken at a hyphen
    assert not early_breaks(text), early_breaks(text)


def test_the_check_sees_a_paragraph_broken_early():
    broken = "Usage: ckpt x\n\n  One checkpoint: its record and history (every state\n  change with its actor).\n"
    assert early_breaks(broken) == ["'  One checkpoint: its record and history (every state' | 'change'"]
