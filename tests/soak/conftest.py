"""The soak's figures at the end of the session (steps, faults per kind, saves, losses), so the
closing note can quote them; ``CKPT_SOAK_REPORT`` also writes them as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    mod = sys.modules.get("test_soak") or sys.modules.get("tests.soak.test_soak")
    if mod is None or not mod.STATS:
        return
    stats = dict(sorted(mod.STATS.items()))
    tr = terminalreporter
    tr.section("fault soak figures")
    steps = sum(v for k, v in stats.items() if k.startswith("op:") or k == "saves")
    tr.write_line(f"steps run (operations + saves): {steps}")
    for k, v in stats.items():
        tr.write_line(f"  {k}: {v}")
    tr.write_line(f"checkpoints saved: {stats.get('saves', 0)}; checkpoints lost: {stats.get('checkpoints_lost', 0)}")
    path = os.environ.get("CKPT_SOAK_REPORT")
    if path:
        Path(path).write_text(json.dumps({"steps": steps, **stats}, indent=1))
