"""The configuration and CLI references of the docs site, generated from the code so that neither
can drift: the settings model (``core.settings.Settings``: every field, its ``CKPT_*`` name, type,
default and description) and the CLI (``ckpt.cli.app``: every command, its help and options).

``python -m scripts.reference_docs`` writes ``docs/reference/configuration.md`` and
``docs/reference/cli.md``; ``make docs`` runs it before building, and a unit test checks that the
committed files are what it writes now.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ckpt.cli import app
from core.settings import Settings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if value is PydanticUndefined:
        return "(required)"
    if hasattr(value, "model_dump"):
        dumped = {k: v for k, v in value.model_dump().items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in dumped.items()) or "(defaults)"
    return "unset" if value is None else str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def configuration() -> str:
    from pydantic import BaseModel

    lines = [
        "# Configuration reference",
        "",
        "Generated from `core.settings.Settings` by `python -m scripts.reference_docs`: do not edit.",
        "",
        "Sources, highest first: keyword arguments, `CKPT_*` environment variables, a `ckpt.toml` file",
        "(`CKPT_CONFIG` or `./ckpt.toml`), the embedded defaults. Nested fields use `__`, for example",
        "`CKPT_RETENTION_TIER1__KEEP_LAST=10`.",
        "",
        "| variable | type | default | what it does |",
        "|---|---|---|---|",
    ]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        lines.append(f"| `CKPT_{name.upper()}` | {_cell(_type_name(ann))} | {_cell(_default(field))} | "
                     f"{_cell(field.description or '')} |")
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((name, ann))
    seen: set[type] = set()
    for _name, model in nested:
        if model in seen:
            continue
        seen.add(model)
        users = ", ".join(f"`CKPT_{n.upper()}__*`" for n, m in nested if m is model)
        lines += ["", f"## {model.__name__} ({users})", "", _cell(model.__doc__ or ""), "",
                  "| field | type | default | what it does |", "|---|---|---|---|"]
        for fname, field in model.model_fields.items():
            lines.append(f"| `{fname.upper()}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} | "
                         f"{_cell(field.description or '')} |")
    return "\n".join(lines) + "\n"


def cli() -> str:
    import typer.main

    group = typer.main.get_command(app)
    lines = ["# CLI reference", "",
             "Generated from `ckpt.cli` by `python -m scripts.reference_docs`: do not edit.", "",
             "Errors print as one line: exit 2 for bad input or configuration, 1 for other failures.", ""]

    def walk(cmd: Any, path: list[str]) -> None:
        if hasattr(cmd, "commands"):  # a group (typer carries its own click)
            for sub in sorted(cmd.commands):
                walk(cmd.commands[sub], [*path, sub])
            return
        ctx = cmd.context_class(cmd, info_name=" ".join(path))
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        name = " ".join(path)
        lines.extend([f"## `{name}`", "", _cell(cmd.help or ""), "", f"```\n{name} {usage}\n```", ""])
        rows = []
        for p in cmd.params:
            if p.param_type_name == "option" and "--help" not in p.opts:
                if "default" in (p.help or ""):  # the help says it (a default that depends on others)
                    default = ""
                elif p.is_flag and p.secondary_opts:  # --x/--no-x: both spellings, and which one holds
                    default = f" (default: `{(p.opts if p.default else p.secondary_opts)[0]}`)"
                elif p.is_flag or p.default in (None, ()):
                    default = ""
                else:
                    default = f" (default: {p.default})"
                rows.append(f"| `{', '.join([*p.opts, *p.secondary_opts])}` | {_cell((p.help or '') + default)} |")
            elif p.param_type_name == "argument":
                rows.append(f"| `{p.name.upper() if p.name else ''}` | argument |")
        if rows:
            lines.extend(["| option | meaning |", "|---|---|", *rows, ""])

    walk(group, ["ckpt"])
    return "\n".join(lines).rstrip() + "\n"


def pages() -> dict[Path, str]:
    return {DOCS / "configuration.md": configuration(), DOCS / "cli.md": cli()}


def main() -> None:
    DOCS.mkdir(parents=True, exist_ok=True)
    for path, text in pages().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(DOCS.parent.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
