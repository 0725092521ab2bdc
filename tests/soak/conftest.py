"""The soak's figures at the end of the session, per catalog backend (steps, operations and
faults per kind, saves, restores, losses), so the closing note can quote them;
``CKPT_SOAK_REPORT`` also writes them as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the headline figures, in this order, then every other counter
HEADLINE = ("seed", "wall_s", "examples", "steps", "saves", "checkpoints_verified", "checkpoints_verified_tier1",
            "checkpoints_verified_tier2", "restores_bytes_match", "checkpoints_lost", "unplanned_errors", "violations")


def figures(stats: dict) -> dict:
    out = dict(stats)
    out["steps"] = sum(v for k, v in stats.items() if k.startswith("op:") or k == "saves")
    out.setdefault("checkpoints_lost", 0)
    out.setdefault("violations", 0)
    head = {k: out[k] for k in HEADLINE if k in out}
    return head | dict(sorted((k, v) for k, v in out.items() if k not in head))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    mod = sys.modules.get("test_soak") or sys.modules.get("tests.soak.test_soak")
    if mod is None or not mod.REPORTS:
        return
    reports = {backend: figures(stats) for backend, stats in mod.REPORTS.items()}
    tr = terminalreporter
    tr.section("fault soak figures")
    for backend, fig in reports.items():
        tr.write_line(f"[{backend}] steps {fig['steps']}, saved {fig.get('saves', 0)}, verified "
                      f"{fig.get('checkpoints_verified', 0)} (on Tier 1 {fig.get('checkpoints_verified_tier1', 0)}, "
                      f"Tier 2 {fig.get('checkpoints_verified_tier2', 0)}), restores with matching bytes "
                      f"{fig.get('restores_bytes_match', 0)}, checkpoints lost {fig['checkpoints_lost']}, "
                      f"violations {fig['violations']}, {fig.get('wall_s', '?')} s")
        for k, v in fig.items():
            tr.write_line(f"  {k}: {v}")
    path = os.environ.get("CKPT_SOAK_REPORT")
    if path:
        Path(path).write_text(json.dumps(reports, indent=1))
