"""Prefect and multiprocessing through their public interface only (docs/design/burst.md,
STYLE.md 12): an upgrade of either must not be able to break the agent silently.

An AST scan of the project's source (not the tests: a test may patch what it checks) fails on
- an import of a private module or name of Prefect or multiprocessing (``prefect._internal``,
  ``from prefect.runner import _starter_direct``, ``from multiprocessing import forkserver`` is
  public but ``forkserver._forkserver`` is not);
- an attribute with a leading underscore (not a dunder) read, written or named to ``getattr`` /
  ``setattr`` on a name bound to a Prefect or multiprocessing module, or to an object got from
  one (``runner = Runner(...)`` -> ``runner._deployment_registry``);
- an assignment to an attribute of an imported third-party or standard library module
  (``engine.observe_flow_run_suspension = ...``, ``module.ssl = ...``): a module attribute
  replaced at run time (a benchmark may swap one of the project's own modules' for its baseline).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "db", "tasks", "flows", "ckpt", "deployments", "benchmarks", "scripts")
WATCHED = ("prefect", "multiprocessing")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _watched(module: str) -> bool:
    return module.split(".")[0] in WATCHED


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain or call starts from (``a`` of ``a.b().c``)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, (ast.Subscript, ast.Await)):
            node = node.value
        else:
            return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _imports_a_module(node: ast.AST | None) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and _root(node.func) == "importlib")


def violations(source: str, filename: str = "<source>") -> list[str]:
    """``line: what`` of each use of a private part of Prefect or multiprocessing, and each
    module attribute assigned, in ``source``."""
    tree = ast.parse(source, filename=filename)
    found: list[str] = []
    modules: set[str] = set()  # names bound to an imported module not the project's own
    watched: set[str] = set()  # names bound to a Prefect or multiprocessing module or object
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if alias.name.split(".")[0] not in PACKAGES:
                    modules.add(bound)
                if _watched(alias.name):
                    watched.add(bound)
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import of private {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module.split(".")[0] not in PACKAGES and _is_module(f"{node.module}.{alias.name}"):
                    modules.add(bound)
                if _watched(node.module):
                    watched.add(bound)
                    if any(_private(part) for part in [*node.module.split("."), alias.name]):
                        found.append(f"{node.lineno}: import of private {node.module}.{alias.name}")
    # objects got from watched names, to a fixed point (an assignment may come before its source's)
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            pairs: list[tuple[ast.AST, ast.AST | None]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
                pairs = [(node.target, node.value)]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                pairs = [(item.optional_vars, item.context_expr) for item in node.items if item.optional_vars]
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                pairs = [(node.target, node.iter)]
            for target, value in pairs:
                if _imports_a_module(value):  # importlib.import_module(...): a module, whichever
                    new = set(_targets(target)) - modules
                    if new:
                        modules |= new
                        changed = True
                if value is not None and _root(value) in watched:
                    new = set(_targets(target)) - watched
                    if new:
                        watched |= new
                        changed = True
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _root(node.value) in watched:
            found.append(f"{node.lineno}: private attribute {node.attr} of {_root(node.value)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and _root(node.args[0]) in watched):
            found.append(f"{node.lineno}: private attribute {node.args[1].value} by {node.func.id}")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.extend(f"{node.lineno}: module attribute {t.value.id}.{t.attr} replaced" for t in targets
                         if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in modules):
            found.append(f"{node.lineno}: module attribute of {node.args[0].id} replaced by setattr")
    return found


def test_the_project_uses_prefect_and_multiprocessing_through_their_public_interface_only():
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}:{v}" for v in violations(path.read_text(encoding="utf-8"), str(path))]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from prefect.runner import _starter_direct",
    "import prefect._internal.version_checking",
    "from prefect._internal.concurrency import api",
    "from multiprocessing import forkserver\nserver = forkserver._forkserver",
    "from prefect.runner import Runner\nrunner = Runner()\nrunner._deployment_registry.register_flow(1, 2)",
    "from prefect.client.orchestration import get_client\nwith get_client() as c:\n    c._client.get('/x')",
    "import multiprocessing\nctx = multiprocessing.get_context('fork')\nx = getattr(ctx, '_name')",
    "import prefect.flow_engine as engine\nengine.observe_flow_run_suspension = None",
    "import importlib\nmodule = importlib.import_module('prefect.client')\nmodule.ssl = None",
    "from prefect.runner import _starter_direct as s\ns.run_flow_in_subprocess = print",
    "import ssl\nsetattr(ssl, 'create_default_context', print)",
    "from multiprocessing import resource_tracker\nresource_tracker.x = 1",
    "import importlib\nm = importlib.import_module('prefect.flow_engine')\nm.run_flow = print",
])
def test_the_scan_finds_each_kind_of_private_use(source):
    assert violations(source), source


@pytest.mark.parametrize("source", [
    "import multiprocessing\nctx = multiprocessing.get_context('forkserver')\nctx.set_forkserver_preload(['x'])",
    "from prefect import flow\n@flow\ndef f():\n    pass\nf.__name__",
    "import logging\nlog = logging.getLogger('x')\nlog.propagate = False",
    "class A:\n    def __init__(self):\n        self._x = 1",
    "import os\nos.environ['X'] = '1'",
    "from tasks import retry\nretry.DEFAULT_RETRIES = 1",
])
def test_the_scan_leaves_public_use_alone(source):
    assert violations(source) == [], source
