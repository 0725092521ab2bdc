"""The import layers hold: ckpt -> deployments -> flows -> tasks -> db -> core, nothing upward.

The same check as ``make lint`` (import-linter, contracts in pyproject.toml), run here too so
that ``make test`` fails on an upward import even when lint is skipped. It reads lazy imports
inside functions as well, and takes well under a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_no_module_imports_from_a_higher_layer():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
