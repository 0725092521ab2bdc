"""The local stack on loopback: a Prefect server on SQLite, moto's S3 server with a bucket,
and agents (``ckpt agent``) — what ``ckpt up``, ``make demo`` and the end-to-end tests run.
With ``production`` (a ``ckpt.production_stack.ProductionStack``) the Prefect server is the
production shape instead: API server and services processes on PostgreSQL + Redis, and the
catalog on PostgreSQL.

API auth: with an auth string the server runs with ``PREFECT_SERVER_API_AUTH_STRING`` (every
API route but ``GET /health`` and ``GET /ready`` then answers 401 without HTTP Basic
credentials) and the agents, the job's exports and every call made from here carry it as
``PREFECT_API_AUTH_STRING`` (``auth_env``). ``ckpt up`` turns it on with the secret kept in its
folder (``stack_auth_string``: made on first use, kept across restarts so the jobs' exports stay
valid); a production-shaped stack calls the same functions.

Each piece is a child process started with its own log file and stopped cleanly (SIGINT,
then SIGTERM, then SIGKILL after a grace period), so nothing is left behind. Ports are the
asked ones when free, else any free loopback port: Prefect's ``port`` and S3's the one after it
(``s3_port``); with ``ckpt up --port P`` both are required, P and P + 1 (taken: a clear error,
never a silent other port), so a restarted stack keeps the API and S3 URLs its jobs' exports name.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.processes import LOOPBACK, Started, free_port, spawn, stop_process, wait_http
from core.errors import ConfigError
from core.settings import load_settings
from db.catalog import upgrade
from deployments.names import ARCHIVE_DEPLOYMENT, promote_deployment
from tasks.prefect_events import auth_headers

if TYPE_CHECKING:
    from ckpt.production_stack import ProductionStack

def new_auth_string() -> str:
    """A fresh API secret (256 bits, URL-safe: it travels in shell exports and HTTP headers)."""
    return secrets.token_urlsafe(32)


AUTH_FILE = "api-auth-string"  # in the stack's --dir: the secret a restarted stack keeps


def stack_auth_string(root: Path) -> str:
    """The stack's API secret: kept in ``ROOT/api-auth-string`` (mode 0600, made on first use),
    so a stack restarted on the same ``--dir`` serves the secret the jobs' exports carry."""
    path = root / AUTH_FILE
    for _ in range(2):
        try:
            kept = path.read_text().strip()
            if kept:
                return kept
        except FileNotFoundError:
            pass
        root.mkdir(parents=True, exist_ok=True)
        secret = new_auth_string()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # another ``ckpt up`` on this folder made it meanwhile: read theirs
        with os.fdopen(fd, "w") as fh:
            fh.write(secret + "\n")
        return secret
    raise ConfigError(f"{path} is empty: remove it, and ckpt up makes a new secret")


def auth_env(auth_string: str | None, *, server: bool = False) -> dict[str, str]:
    """The Prefect setting that carries ``auth_string``: the server's
    (``PREFECT_SERVER_API_AUTH_STRING``: enforce it) or a client's (``PREFECT_API_AUTH_STRING``:
    send it; agents, flow runs, the training job, the CLI). Empty without one: auth off."""
    if not auth_string:
        return {}
    return {"PREFECT_SERVER_API_AUTH_STRING" if server else "PREFECT_API_AUTH_STRING": auth_string}


def server_env(base: Mapping[str, str], *, home: Path, api_url: str, ui: bool) -> dict[str, str]:
    """The environment of a local Prefect server whose API is ``api_url``.

    The UI asks ``/ui-settings`` where the API is. Prefect answers with its UI API URL setting,
    which otherwise falls back to ``PREFECT_API_URL`` (dropped here: an inherited one names some
    other server) and then to the *default* port 4200, not the ``--port`` the server was
    started with: on any other port every page of the UI would call a wrong server. So the
    server is told its own URL, for the UI's API calls and for the links it renders."""
    env = {k: v for k, v in base.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_UI_URL")}
    env.update(PREFECT_HOME=str(home), PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="true" if ui else "false",
               PREFECT_SERVER_UI_API_URL=api_url, PREFECT_UI_URL=api_url.removesuffix("/api"),
               PREFECT_LOGGING_LEVEL="WARNING")
    return env


def start_prefect_server(home: Path, *, port: int | None = 4200, ui: bool = True, timeout: float = 120.0,
                         auth_string: str | None = None, port_required: bool = False) -> tuple[subprocess.Popen, str]:
    """Prefect server on SQLite under ``home`` (API auth on with ``auth_string``); returns
    (process, API URL). ``port_required``: on ``port`` or not at all (``free_port``)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port(port, required=port_required)
    url = f"http://{LOOPBACK}:{port}/api"
    env = server_env(os.environ, home=home, api_url=url, ui=ui)
    env.pop("PREFECT_SERVER_API_AUTH_STRING", None)
    env.update(auth_env(auth_string, server=True))
    proc = spawn([sys.executable, "-m", "prefect", "server", "start", "--host", LOOPBACK, "--port", str(port)],
                  home / "server.log", env)
    try:
        wait_http(f"{url}/health", timeout=timeout, proc=proc, what="Prefect server")
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


S3_PORT_IS = "the S3 server's (--port + 1)"  # how a taken S3 port is named: ckpt up puts it after Prefect's


def start_moto(log: Path, *, port: int | None = None, bucket: str = "ckpt", timeout: float = 60.0,
               port_required: bool = False, server: Sequence[str] = ("-m", "moto.server")
               ) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on loopback with ``bucket`` created; returns (process, endpoint URL).
    ``port_required``: on ``port`` or not at all (``free_port``); ``server``: what the
    interpreter runs, given moto.server's arguments (a script that patches moto first)."""
    import boto3

    port = free_port(port, required=port_required, what=S3_PORT_IS)
    proc = spawn([sys.executable, *server, "-H", LOOPBACK, "-p", str(port)], log)
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http(url, timeout=timeout, proc=proc, what="moto S3 server")
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def start_agent(env: dict[str, str], log: Path, *, node: str, node_only: bool = False,
                limit: int | None = None, archive_trigger: bool = True) -> subprocess.Popen:
    """``ckpt agent`` for ``node`` in a child process whose environment is ``env`` (CKPT_*)."""
    cmd = [sys.executable, "-m", "ckpt.cli", "agent", "--node", node]
    if node_only:
        cmd.append("--node-only")
    if limit:
        cmd += ["--limit", str(limit)]
    if not archive_trigger:
        cmd.append("--no-archive-trigger")
    return spawn(cmd, log, {**os.environ, **env})


def wait_deployments(api_url: str, names: list[str], *, timeout: float = 90.0,
                     procs: Sequence[subprocess.Popen] = (), auth_string: str | None = None) -> None:
    """Until every ``flow/deployment`` in ``names`` exists, is not paused and is polled by a
    runner (``served``): then its triggers and schedules are live."""
    import httpx

    headers = auth_headers(auth_string)

    deadline = time.monotonic() + timeout
    todo = list(names)
    while todo:
        name = todo[0]
        try:
            r = httpx.get(f"{api_url}/deployments/name/{name}", timeout=5, headers=headers)
            d = r.json() if r.status_code == 200 else {}
        except httpx.HTTPError:
            d = {}
        if d and served(d):
            todo.pop(0)
            continue
        for p in procs:
            if p.poll() is not None:
                raise ConfigError(f"an agent exited with {p.returncode} before serving {name}")
        if time.monotonic() > deadline:
            raise ConfigError(f"deployment {name} not served after {timeout:.0f}s")
        time.sleep(0.5)


def served(deployment: dict) -> bool:
    """A deployment (as the API returns it) that is not paused and that a runner polled since it
    was last registered: ``READY``, or polled after its last update. The server records a poll
    in the background, late when it is busy (its ``mark_deployments_ready`` task; it leaves
    ``updated`` alone), and marks the deployment ``NOT_READY`` a minute after the last poll it
    recorded, so a served deployment can read ``NOT_READY`` for a while; a poll recorded before
    its last registration (a node's agent of an earlier session) does not count."""
    if deployment.get("paused"):
        return False
    if deployment.get("status") == "READY":
        return True
    polled, updated = deployment.get("last_polled"), deployment.get("updated")
    return isinstance(polled, str) and isinstance(updated, str) and \
        datetime.fromisoformat(polled) >= datetime.fromisoformat(updated)


def stack_env(data_dir: Path, *, api_url: str, s3_url: str | None, bucket: str = "ckpt",
              catalog_url: str | None = None, auth_string: str | None = None) -> dict[str, str]:
    """The CKPT_* and PREFECT_* environment of the agents and the training job on the local stack."""
    env = {"CKPT_DATA_DIR": str(data_dir), "CKPT_PREFECT_API_URL": api_url, "PREFECT_API_URL": api_url,
           # a served agent looks for triggered runs every N s (Prefect's default 10 s dominates
           # the emit -> flow start latency); 2 s costs one small query per agent per poll
           "PREFECT_RUNNER_POLL_FREQUENCY": "2",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    if s3_url:
        env.update(CKPT_TIER2_URL=f"s3://{bucket}/ckpt", CKPT_S3_ENDPOINT_URL=s3_url)
    if catalog_url:
        env["CKPT_CATALOG_URL"] = catalog_url
    env.update(auth_env(auth_string))
    return env


def job_exports(env: dict[str, str], *, node: str, catalog_url: str) -> dict[str, str]:
    """What a training job in another shell needs to use this stack: the CKPT_* and PREFECT_*
    settings, the node label an agent serves (without it a stager writes under the host name,
    which no agent serves), the catalog, and the S3 credentials of the local S3 server."""
    out = {k: v for k, v in env.items() if k.startswith(("CKPT_", "PREFECT_", "AWS_"))}
    out.pop("PREFECT_RUNNER_POLL_FREQUENCY", None)  # the agents' own setting
    out.update(CKPT_NODE=node, CKPT_CATALOG_URL=catalog_url)
    return dict(sorted(out.items()))


def exports_text(per_node: dict[str, dict[str, str]]) -> list[str]:
    """The lines ``ckpt up`` prints for the jobs: what every node's shell shares, once, then what
    each node's shell adds (its ``CKPT_NODE``), so that the job of every node, not only the
    first, is told the label its agent serves."""
    envs = list(per_node.values())
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)}
    lines = ["for the training job and the CLI, in another shell"
             + (" on every node:" if len(per_node) > 1 else ":")]
    lines += [f"  export {k}={shlex.quote(v)}" for k, v in shared.items()]
    for node, env in per_node.items():
        own = [f"export {k}={shlex.quote(v)}" for k, v in env.items() if k not in shared]
        if own and len(per_node) > 1:
            lines.append(f"  on {node}: " + "; ".join(own))
        else:
            lines += [f"  {line}" for line in own]
    return lines


AGENT_FIRST_WAIT_S = 1.0  # a dead agent is started again after 1 s, then 2, 4, ... (doubling)
AGENT_LONGEST_WAIT_S = 60.0
AGENT_STEADY_S = 60.0  # an agent that ran this long before it exited starts its backoff afresh


@dataclass
class AgentRestarts:
    """One agent's restarts: how many in a row, when it last started, when it is due again."""

    count: int = 0
    started_at: float = 0.0
    due: float | None = None


@dataclass
class LocalStack(Started):
    """Prefect server + moto + one agent per node, under ``root``. Use as a context manager.
    ``auth_string``: the Prefect API's secret (None: auth off)."""

    root: Path
    nodes: tuple[str, ...] = ("node-0",)
    port: int = 4200
    port_required: bool = False  # on `port` or not at all (ckpt up --port P)
    ui: bool = True
    tier2: bool = True
    archive_trigger: bool = True
    limit: int | None = None
    auth_string: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    production: ProductionStack | None = None  # Prefect on PostgreSQL + Redis instead of SQLite
    api_url: str = ""
    s3_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    agents: list[subprocess.Popen] = field(default_factory=list)
    restarts: list[AgentRestarts] = field(default_factory=list)

    def exports(self) -> dict[str, dict[str, str]]:
        """``job_exports`` of every node, by node (the first one's agent also serves the cluster)."""
        catalog_url = str(load_settings().catalog_url)
        return {node: job_exports(self.env, node=node, catalog_url=catalog_url) for node in self.nodes}

    def alive(self) -> bool:
        """Every process of the stack (servers, agents) still runs."""
        return self.servers_alive() and all(p.poll() is None for p in self.agents)

    def servers_alive(self) -> bool:
        """The Prefect server (or its production processes) and S3 still run: the state the
        jobs' exports point at. An agent that exited is ``supervise``'s to start again."""
        server = self.production.procs if self.production is not None else []
        return all(p.poll() is None for p in server + self.procs)

    def agent_log(self, i: int) -> Path:
        return self.root / "logs" / f"agent-{self.nodes[i]}.log"

    def _start_agent(self, i: int) -> subprocess.Popen:
        """The agent of node ``i`` (node 0's also serves the cluster-wide deployments)."""
        return start_agent(self.env, self.agent_log(i), node=self.nodes[i], node_only=i > 0, limit=self.limit,
                           archive_trigger=self.archive_trigger)

    def start_agents(self, now: float | None = None) -> None:
        self.agents = [self._start_agent(i) for i in range(len(self.nodes))]
        at = time.monotonic() if now is None else now
        self.restarts = [AgentRestarts(started_at=at) for _ in self.nodes]

    def supervise(self, now: float | None = None) -> list[str]:
        """Start again every agent that exited, after a backoff (1 s, 2 s, 4 s, ... at most 60 s;
        afresh for an agent that had run a minute), leaving the servers and S3 running. Returns
        what to tell the user: one line per restart, when the agent is found dead."""
        now = time.monotonic() if now is None else now
        said = []
        for i, proc in enumerate(self.agents):
            r = self.restarts[i]
            if proc.poll() is None:
                continue
            if r.due is None:
                if now - r.started_at >= AGENT_STEADY_S:
                    r.count = 0
                wait = min(AGENT_LONGEST_WAIT_S, AGENT_FIRST_WAIT_S * 2 ** r.count)
                r.count, r.due = r.count + 1, now + wait
                said.append(f"agent {self.nodes[i]} exited with {proc.returncode}; restart {r.count} in {wait:.0f} s "
                            f"(the Prefect server and S3 keep running; log: {self.agent_log(i)})")
            elif now >= r.due:
                self.agents[i] = self._start_agent(i)
                r.due, r.started_at = None, now
        return said

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")

    @property
    def s3_port(self) -> int | None:
        """S3's port: the one after Prefect's (asked; ``free_port`` decides), so that a stack
        restarted with ``--port P`` is back on the same S3 endpoint, as on the same API."""
        return self.port + 1 if self.port else None

    def start_s3(self) -> None:
        """moto's S3 server on ``s3_port`` (required with ``port_required``)."""
        moto, self.s3_url = start_moto(self.root / "logs" / "moto.log", port=self.s3_port,
                                       port_required=self.port_required)
        self.procs.append(moto)

    def start(self) -> LocalStack:
        self.root = self.root.absolute()
        if self.tier2 and self.port_required:  # taken: an error before any server is started
            free_port(self.s3_port, required=True, what=S3_PORT_IS)
        if self.production is not None:
            self.production.server_env_extra.update(auth_env(self.auth_string, server=True))
            self.api_url = self.production.start().api_url
        else:
            server, self.api_url = start_prefect_server(self.root / "prefect", port=self.port, ui=self.ui,
                                                        auth_string=self.auth_string, port_required=self.port_required)
            self.procs.append(server)
        if self.tier2:
            self.start_s3()
        catalog_url = self.production.catalog_url if self.production is not None else None
        self.env = {**stack_env(self.root / "data", api_url=self.api_url, s3_url=self.s3_url,
                                catalog_url=catalog_url, auth_string=self.auth_string), **self.extra_env}
        os.environ.update(self.env)  # this process (the demo's training job) sees the same stack
        upgrade(load_settings().catalog_url)
        self.start_agents()
        wanted = [promote_deployment(n) for n in self.nodes] + [ARCHIVE_DEPLOYMENT]
        wait_deployments(self.api_url, wanted, procs=self.agents, auth_string=self.auth_string)
        return self

    def stop(self) -> None:
        for p in self.agents + list(reversed(self.procs)):
            stop_process(p)
        self.agents.clear()
        self.procs.clear()
        if self.production is not None:
            self.production.stop()
