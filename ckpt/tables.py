"""The command line's tables: fitted to the terminal when printed, so that an id, a state or a
word is never folded in the middle on a narrow terminal. Text wraps between words; only a path
column (a URL, a reason or detail that carries a path) may break a long path, after a ``/``;
an id too long for the room left is shortened in its middle (``--json`` prints it whole). And
the audit's actor read as a role (``event``, ``reconcile/<node>``, ``cli``, ``retention``), its
flow run left to ``--json``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PATH_COLUMNS = frozenset({"url", "reason", "detail", "outcome"})  # may break a long path after a '/'
PROSE = 20  # a path column keeps this much while others give room down to their longest word
NARROWEST = 12  # an id, then a path column, gives room down to this before any column gives more
ELLIPSIS = "…"


@dataclass
class FitTable:
    """A table whose column widths are chosen at print time for the console's width: every
    column as wide as its longest cell while the row fits; else the widest column gives room a
    character at a time, in rounds: each column down to its longest word (cells wrap between
    words), a path column to ``PROSE`` at least; a path column down to its longest word too; a
    column of longer words (an id) down to ``NARROWEST``, its words shortened in the middle; a
    path column down to ``NARROWEST`` (paths break after a ``/``); then any column."""

    columns: tuple[str, ...]
    title: str | None = None
    right: tuple[str, ...] = ()
    rows: list[tuple[list[Text], str | None]] = field(default_factory=list)

    def add_row(self, *cells: str | Text, style: str | None = None) -> None:
        """Cells as ``rich.table.Table.add_row`` takes them: a string is read as markup."""
        self.rows.append(([c if isinstance(c, Text) else Text.from_markup(c) for c in cells], style))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        room = options.max_width - (Measurement.get(console, options, self._table([1] * len(self.columns))).maximum
                                    - len(self.columns))  # what the table's own gaps leave to the cells
        widths = fit_widths(self._columns_cells(), room, [c in PATH_COLUMNS for c in self.columns])
        t = self._table(widths)
        for cells, style in self.rows:
            t.add_row(*(fit_cell(c, w, path=col in PATH_COLUMNS)
                        for c, w, col in zip(cells, widths, self.columns, strict=True)), style=style)
        yield t

    def _table(self, widths: list[int]) -> Table:
        """A header rule and two spaces between columns, no frame: the columns keep the width."""
        t = Table(title=self.title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
        for col, width in zip(self.columns, widths, strict=True):
            t.add_column(col, width=width, overflow="fold", justify="right" if col in self.right else "left")
        return t

    def _columns_cells(self) -> list[list[str]]:
        return [[col] + [cells[i].plain for cells, _ in self.rows] for i, col in enumerate(self.columns)]


def table(*columns: str, title: str | None = None, right: tuple[str, ...] = ()) -> FitTable:
    """A table of ``columns`` fitted to the terminal when printed; ``right``: the columns aligned
    right (numbers)."""
    return FitTable(columns, title=title, right=right)


def _longest_line(text: str) -> int:
    return max((Text(line).cell_len for line in text.splitlines() or [""]), default=0)


def _longest_word(text: str, *, path: bool = False) -> int:
    """The widest word of ``text``; of a path column, the widest piece between two ``/``."""
    words = [piece for word in text.split() for piece in (_path_pieces(word) if path else [word])]
    return max((Text(word).cell_len for word in words), default=0)


def _path_pieces(word: str) -> list[str]:
    """``file:///a/b`` -> ``file:///``, ``a/``, ``b``: where a path may break."""
    return re.findall(r"[^/]*/+|[^/]+", word)


def fit_widths(columns: list[list[str]], room: int, path: list[bool]) -> list[int]:
    """The content width of each column (``columns``: each one's header and cells) so that they
    sum to ``room`` or less, by the rounds ``FitTable`` names."""
    widths = [max(_longest_line(c) for c in cells) for cells in columns]
    words = [max(_longest_word(c, path=p) for c in cells) for cells, p in zip(columns, path, strict=True)]
    floors = ([max(w, min(width, PROSE)) if p else w for w, width, p in zip(words, widths, path, strict=True)],
              words,
              [w if p else min(w, NARROWEST) for w, p in zip(words, path, strict=True)],
              [min(w, NARROWEST) for w in words],
              [1] * len(columns))
    for floor in floors:
        while sum(widths) > room:
            i = max(range(len(widths)), key=lambda k: (widths[k] - floor[k] > 0, widths[k]))
            if widths[i] <= floor[i]:
                break
            widths[i] -= 1
    return widths


def fit_cell(cell: Text, width: int, *, path: bool) -> Text:
    """``cell`` made to fit ``width`` between its words: a path column's longer words broken
    after a ``/``, another column's shortened in the middle."""
    if _longest_word(cell.plain) <= width:
        return cell
    words = [_break_path(w, width) if path else _shorten(w, width) for w in cell.plain.split(" ")]
    return Text(" ".join(words), style=cell.style)


def _shorten(word: str, width: int) -> str:
    """``checkpoint-run-with-a-long-name`` in 15 -> ``checkpo…ng-name``."""
    if len(word) <= width:
        return word
    keep = max(width - 1, 0)
    return word[: (keep + 1) // 2] + ELLIPSIS + word[len(word) - keep // 2:] if keep else ELLIPSIS


def _break_path(word: str, width: int) -> str:
    """A path in lines of at most ``width``, broken after a ``/``; a name between two ``/``
    longer than that is shortened in the middle, as an id is."""
    pieces = [_shorten(p, width) for p in _path_pieces(word)]
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(lines)


def actor_role(actor: str) -> str:
    """``reconcile/node-0 flow-run:1f2e…`` -> ``reconcile/node-0``, ``event agent:node-0 pid:42``
    (a part promoted by its agent, no flow run) -> ``event agent:node-0``; an actor recorded before
    roles (``flow-run:<id>``) reads ``flow run <first 8 of its id>``."""
    role, _, _ = actor.partition(" flow-run:")
    role, _, _ = role.partition(" pid:")
    if role.startswith("flow-run:"):
        return f"flow run {role.removeprefix('flow-run:')[:8]}"
    return role
