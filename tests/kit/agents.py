"""Harness of the end-to-end tests: agents served against the session's real Prefect server,
a training job in a separate process, and waits on what the catalog and Prefect record.

Each test module starts its own agents (``ckpt agent`` in child processes, one per node,
with node labels unique to the module) and stops them at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from ckpt.local_stack import stack_env, start_agent, wait_deployments
from ckpt.processes import stop_process
from deployments import names
from tasks.prefect_events import auth_headers


@dataclass
class Agents:
    api_url: str
    root: Path
    nodes: tuple[str, ...]
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def settings(self, node: str):
        from core.settings import Settings

        env = {k[5:].lower(): v for k, v in self.env.items() if k.startswith("CKPT_")}
        return Settings(**{**env, "node": node})

    def catalog(self):
        from db.catalog import Catalog

        return Catalog(self.env["CKPT_CATALOG_URL"])

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)

    def logs(self) -> str:
        return "\n".join((self.root / "logs" / f"agent-{n}.log").read_text(errors="replace")[-3000:]
                         for n in self.nodes)


def start_agents(api_url: str, root: Path, nodes: tuple[str, ...], *, catalog_url: str, s3_url: str | None,
                 bucket: str | None, extra: dict[str, str] | None = None, auth_string: str | None = None) -> Agents:
    """One agent per node; the first also serves the cluster-wide deployments. ``auth_string``:
    the Prefect API's secret, when the server runs with auth on."""
    from db.catalog import upgrade

    upgrade(catalog_url)
    env = stack_env(root / "data", api_url=api_url, s3_url=s3_url, bucket=bucket or "ckpt", catalog_url=catalog_url,
                    auth_string=auth_string)
    env.update(extra or {})
    agents = Agents(api_url, root, nodes, env)
    for i, node in enumerate(nodes):
        agents.procs.append(start_agent(env, root / "logs" / f"agent-{node}.log", node=node, node_only=i > 0))
    try:
        wanted = [names.promote_deployment(n) for n in nodes] + [names.ARCHIVE_DEPLOYMENT]
        wait_deployments(api_url, wanted, timeout=120, procs=agents.procs, auth_string=auth_string)
    except BaseException:
        agents.stop()
        raise
    return agents


def train(agents: Agents, body: str, *, timeout: float = 120) -> dict:
    """Run ``body`` as a training job in a separate process with the agents' environment;
    it gets ``CheckpointStager``, ``np`` and ``tensors(n, seed)`` and prints a JSON result."""
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        from ckpt.client import CheckpointStager
        from core.settings import load_settings
        def tensors(n=4, seed=0, size=256 * 1024):
            rng = np.random.default_rng(seed)
            return {f"w{i}": rng.standard_normal(size, dtype=np.float32) for i in range(n)}
    """) + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **agents.env}, cwd=agents.root)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def wait_for(what: str, pred, *, timeout: float = 90.0, interval: float = 0.5, agents: Agents | None = None):
    """``pred()``'s first truthy value, polled every ``interval`` s. An exception of ``pred``
    counts as not yet (e.g. the checkpoint is not registered yet); at ``timeout`` the failure
    names the last one (chained), or the last falsy value, and the agents' logs."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value, last = pred(), None
        except Exception as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            seen = (f"the last check raised {type(last).__name__}: {last}" if last is not None
                    else f"the last check returned {value!r}")
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; {seen}"
                                 + (f"\n{agents.logs()}" if agents else "")) from last
        time.sleep(interval)


def flow_runs(api_url: str, name: str | None = None, deployment: str | None = None) -> list[dict]:
    """Flow runs (optionally: exactly this name, or of this ``flow/deployment``)."""
    body: dict = {"sort": "EXPECTED_START_TIME_ASC"}
    if name:
        body["flow_runs"] = {"name": {"any_": [name]}}
    if deployment:
        d = httpx.get(f"{api_url}/deployments/name/{deployment}", timeout=10, headers=auth_headers()).json()
        body["deployments"] = {"id": {"any_": [d["id"]]}}
    r = httpx.post(f"{api_url}/flow_runs/filter", json=body, timeout=10, headers=auth_headers())
    r.raise_for_status()
    return r.json()


def recorded_events(api_url: str, name: str, run: str) -> list[dict]:
    """The events ``name`` about ``run`` that the server has stored so far (of the last day)."""
    body = {"filter": {"event": {"name": [name]}, "resource": {"labels": {"ckpt.run": [run]}}}, "limit": 50}
    r = httpx.post(f"{api_url}/events/filter", json=body, timeout=10, headers=auth_headers())
    r.raise_for_status()
    return r.json()["events"]


def finished(run: dict) -> bool:
    return run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def run_deployment_now(api_url: str, deployment: str, parameters: dict | None = None) -> str:
    d = httpx.get(f"{api_url}/deployments/name/{deployment}", timeout=10, headers=auth_headers()).json()
    r = httpx.post(f"{api_url}/deployments/{d['id']}/create_flow_run", json={"parameters": parameters or {}},
                   timeout=10, headers=auth_headers())
    r.raise_for_status()
    return r.json()["id"]


def read_flow_run(api_url: str, run_id: str) -> dict:
    return httpx.get(f"{api_url}/flow_runs/{run_id}", timeout=10, headers=auth_headers()).json()


def ts(value: str | datetime) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(value).timestamp()


def tier_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []
