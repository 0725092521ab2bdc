"""Imports of the project's own modules sit at the top of a module, unless there is a reason.

A function-local import of a project module must say on its line why it is not at the top:
``# deferred: cycle`` (the imported module imports this one, directly or not) or
``# deferred: start-up`` (a light entry point below would otherwise load a heavy library or a
slow module), optionally followed by the detail (``# deferred: cycle — core.storage.fsspec
imports this module``). Everything else is hoisted, so that a reader sees a module's
dependencies in one place and a monkeypatch of a module's name reaches every caller.

The light entry points are what a user's process imports before it does anything: the CLI
(``ckpt --help`` imports every command module), the training-side client and its trainer
integrations, the per-node agent, the event helpers. Each is imported here in a fresh
interpreter, and must not load a heavy library it does not load today.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests.kit.require import require

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "db", "tasks", "flows", "ckpt", "deployments", "benchmarks", "scripts")
LABEL = re.compile(r"# deferred: (cycle|start-up)\b")


# --- function-local imports say why -------------------------------------------------------------
def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (real comments only, never text in a string)."""
    lines = iter(source.splitlines(keepends=True))
    return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(lambda: next(lines, ""))
            if tok.type == tokenize.COMMENT}


def _is_project_import(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
    return any(alias.name.split(".")[0] in PACKAGES for alias in node.names)


def _local_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Imports anywhere inside a function (or method) body, nested ones included."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def unlabelled_lines(source: str, filename: str = "<source>") -> list[int]:
    """Lines of the function-local imports of project modules in ``source`` whose (first) line
    carries no ``# deferred: cycle`` or ``# deferred: start-up`` comment."""
    comments = _comments(source)
    return [node.lineno for node in _local_imports(ast.parse(source, filename=filename))
            if _is_project_import(node) and not LABEL.search(comments.get(node.lineno, ""))]


def unlabelled_local_imports(package: str) -> list[str]:
    """``path:line: source`` of each unlabelled function-local project import in ``package``."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        bad += [f"{path.relative_to(ROOT)}:{n}: {lines[n - 1].strip()}" for n in unlabelled_lines(source, str(path))]
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_function_local_imports_of_project_modules_say_why(package):
    bad = unlabelled_local_imports(package)
    assert not bad, ("import these at the top of the module, or say why not on the import's line with "
                     "`# deferred: cycle` or `# deferred: start-up`:\n" + "\n".join(bad))


def test_the_check_sees_what_it_must():
    """The checker itself: nested functions and methods count, module-level imports and other
    libraries do not, and a label must be a comment (not text in a string)."""
    source = ("import core.errors\n"
              "def f():\n"
              "    from core import sizing  # deferred: start-up\n"
              "    class C:\n"
              "        def g(self):\n"
              "            from db import entities\n"
              "            import json\n"
              "    x = '# deferred: cycle'; from ckpt import tables\n"
              "    from . import sibling  # noqa: F401  # deferred: cycle — relative: the project's too\n"
              "    from tasks import (  # deferred: start-up\n"
              "        audit,\n"
              "    )\n")
    assert unlabelled_lines(source) == [6, 8]


# --- light entry points stay light -------------------------------------------------------------
HEAVY = ("prefect", "sqlalchemy", "alembic", "boto3", "torch", "transformers", "lightning", "fsspec")

# What each light entry point loads of HEAVY today (measured when this test was written): it
# must not load more. The trainer integrations load their library by design (and what it loads:
# transformers imports boto3, Lightning fsspec); none of them may load the orchestrator or the
# catalog's libraries.
LIGHT: dict[str, tuple[str, ...]] = {
    "ckpt --help": (),
    "ckpt.cli": (),
    "ckpt.client": (),
    "ckpt.commit": (),
    "ckpt.announce": (),
    "ckpt.watch": (),
    "ckpt.integrations": (),
    "ckpt.integrations.dcp": (),
    "ckpt.integrations.hf": ("boto3", "torch", "transformers"),
    "ckpt.integrations.lightning": ("fsspec", "lightning", "torch", "transformers"),
    "deployments.agent": (),
    "deployments.processes": (),
    "core.events": (),
}
EXTRAS = {"ckpt.integrations.hf": ("torch", "transformers"), "ckpt.integrations.lightning": ("torch", "lightning")}

IMPORT = "import importlib, sys; importlib.import_module(sys.argv[1])"
HELP = ("import sys; sys.argv = ['ckpt', '--help']; from ckpt.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass")
REPORT = "\nimport json, sys; print(); print(json.dumps(sorted(k for k in {heavy!r} if k in sys.modules)))"


def loaded_heavy(entry: str) -> list[str]:
    """The heavy libraries in ``sys.modules`` of a fresh interpreter after ``entry``."""
    code = (HELP if entry == "ckpt --help" else IMPORT) + REPORT.format(heavy=HEAVY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code, entry], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", [pytest.param(e, marks=pytest.mark.slow) if e in EXTRAS else e for e in LIGHT])
def test_light_entry_points_load_no_more_heavy_libraries_than_they_do(entry):
    for module in EXTRAS.get(entry, ()):
        require(None if importlib.util.find_spec(module) else "not installed", f"{module} ({entry})")
    loaded = loaded_heavy(entry)
    assert set(loaded) <= set(LIGHT[entry]), (
        f"{entry} now loads {sorted(set(loaded) - set(LIGHT[entry]))}: import them inside the function that "
        "needs them, with `# deferred: start-up`")
