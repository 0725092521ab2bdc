"""`ckpt agent` refuses bad settings in one line. (What it serves, and its clean stop, are
checked in test_events.py on that module's agent, so no second agent starts for them.)"""

from __future__ import annotations

import os
import subprocess
import sys


def test_agent_with_bad_settings_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(CKPT_TIER2_URL="http://not-s3/bucket", CKPT_DATA_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "ckpt.cli", "agent", "--node", "n"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert "tier2_url must look like s3://bucket/prefix" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
