"""The command line's tables: cells fold (wrap, inside a word where they must) instead of being
cut short with an ellipsis, so that a long run name, URL or reason is read whole on a narrow
terminal; and the audit's actor read as a role (``event``, ``reconcile/<node>``, ``cli``,
``retention``), its flow run left to ``--json``."""

from __future__ import annotations

from rich.table import Table


def table(*columns: str, title: str | None = None, right: tuple[str, ...] = ()) -> Table:
    """A table of ``columns`` whose cells fold; ``right``: the columns aligned right (numbers)."""
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, overflow="fold", justify="right" if col in right else "left")
    return t


def actor_role(actor: str) -> str:
    """``reconcile/node-0 flow-run:1f2e…`` -> ``reconcile/node-0``, ``event agent:node-0 pid:42``
    (a part promoted by its agent, no flow run) -> ``event agent:node-0``; an actor recorded before
    roles (``flow-run:<id>``) reads ``flow run <first 8 of its id>``."""
    role, _, _ = actor.partition(" flow-run:")
    role, _, _ = role.partition(" pid:")
    if role.startswith("flow-run:"):
        return f"flow run {role.removeprefix('flow-run:')[:8]}"
    return role
