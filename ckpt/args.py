"""Command-line numbers (those that name a checkpoint, and every other whole number): read by the
one rule for a step arriving as text (``core.layout.parse_number``: ASCII digits only, where click's ``int`` would take
``1_00``, ``100\\n`` or full-width digits) and bounded by ``core.layout.check_ref``. A refusal is
a ``BadArgument``, which ``ckpt.cli.main`` records in the catalog as every rejected input is."""

from __future__ import annotations

from collections.abc import Callable

from core.errors import BadArgument, BadInput
from core.layout import check_ref, parse_number


def _number(what: str) -> Callable[[str | int], int]:
    def parse(value: str | int) -> int:
        try:
            return parse_number(value, what)
        except BadInput as exc:
            raise BadArgument(str(exc)) from None

    parse.__name__ = what  # click names the type after the parser in --help
    return parse


step_arg, part_arg, parts_arg = _number("step"), _number("part"), _number("parts")


def count_arg(what: str, lo: int, hi: int) -> Callable[[str | int], int]:
    """Any other whole-number option (a tier, a limit, a node count, a port), read by the same
    rule and bounded to ``lo``..``hi``."""
    number = _number(what)

    def parse(value: str | int) -> int:
        n = number(value)
        if not lo <= n <= hi:
            raise BadArgument(f"{what} {n} is out of range: {lo}..{hi}")
        return n

    parse.__name__ = what
    return parse


def checkpoint_ref(step: int, part: int = 0, parts: int = 1) -> None:
    """``BadArgument`` unless ``--step``, ``--part`` and ``--parts`` name a checkpoint part in range."""
    try:
        check_ref(step, part, parts)
    except BadInput as exc:
        raise BadArgument(f"invalid --step/--part/--parts: {exc}") from None


tier_arg, durable_tier_arg = count_arg("tier", 0, 2), count_arg("tier", 1, 2)
