"""The training attempt of this process: one launch of a run's job, shared by all its ranks.

Every rank of one launch must name the same attempt without talking to the others, and a
relaunch must name a new one. In order:

1. ``attempt=`` given to the stager, an integration or ``resume_point`` (the caller knows best);
2. ``CKPT_ATTEMPT`` in the environment (a launcher script sets it once for every rank);
3. torchelastic (``torchrun``): ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``,
   which every worker of one rendezvous round shares and a restart increments (the run id
   ``none``, torchrun's default without ``--rdzv-id``, names no launch and is skipped);
4. Slurm: ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT`` (a requeue increments it);
5. none of these: the unnamed attempt ``''``. Every launch of the job is then the same attempt,
   as before attempts existed: a relaunch that saves a step again with other bytes is refused.
   Give one of the above to relaunch safely.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping

from core.layout import MAX_ATTEMPT, check_attempt

ENV = "CKPT_ATTEMPT"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def token(raw: str) -> str:
    """``raw`` as an attempt name: unsafe characters become ``-``; one too long keeps its head and
    a digest of the whole, so two long ids never meet."""
    name = _UNSAFE.sub("-", raw).strip("-.") or "x"
    if len(name) > MAX_ATTEMPT:
        name = f"{name[:MAX_ATTEMPT - 13]}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"
    return check_attempt(name)


def launch_attempt(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The attempt of this launch (see the module's order)."""
    env = os.environ if environ is None else environ
    if explicit is not None:
        return check_attempt(explicit)
    if env.get(ENV):
        return check_attempt(env[ENV])
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return token(f"te-{run_id}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if env.get("SLURM_JOB_ID"):
        return token(f"slurm-{env['SLURM_JOB_ID']}-r{env.get('SLURM_RESTART_COUNT', '0')}")
    return ""
