"""A locked-down stack: a Prefect server with its API auth on (``PREFECT_SERVER_API_AUTH_STRING``),
agents and the training job holding the secret (``PREFECT_API_AUTH_STRING``), a catalog URL with a
password and an S3 secret key. An event without the secret is refused and starts nothing; the
job's own announcement (with it) promotes; the RPO alert's webhook, which calls the server, gets
through; after a full promotion (Tier 1 and the Tier 2
archive) none of the secrets is anywhere the Prefect server keeps: flow and task runs, logs,
artifacts, events, automations, deployments, blocks, variables, nor its database file.

One Prefect server and one agent for the module (the server must start with the auth string, so
the session's server cannot be used). PostgreSQL is trust-authenticated here: the role's password
is not checked, but it is in the catalog URL every process uses, which is the point.
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from core import events
from deployments import names
from tests.kit.agents import finished, flow_runs, start_agents, train, wait_for

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.postgres]

TAG = uuid.uuid4().hex[:10]
NODE = f"lock-{TAG[:6]}"
AUTH = f"api-auth-{TAG}-marker"
PG_PASSWORD = f"pg-pass-{TAG}-marker"
S3_SECRET = f"s3-secret-{TAG}-marker"
SECRETS = {"API auth string": AUTH, "API auth header": base64.b64encode(AUTH.encode()).decode(),
           "catalog password": PG_PASSWORD, "S3 secret key": S3_SECRET}
HEADERS = events.auth_headers(AUTH)


@pytest.fixture(scope="module")
def catalog_url(pg_server):
    """A PostgreSQL role with a password and a database it owns; the URL carries the password."""
    import psycopg

    from tests.kit.servers import _pg_admin_dsn

    role = db = f"ckpt_lock_{TAG}"
    with psycopg.connect(_pg_admin_dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PG_PASSWORD}'")
        conn.execute(f'CREATE DATABASE "{db}" OWNER {role}')
    host = pg_server.split("@", 1)[1].rsplit("/", 1)[0]
    yield f"postgresql+psycopg://{role}:{PG_PASSWORD}@{host}/{db}"
    with psycopg.connect(_pg_admin_dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))
        conn.execute(f'DROP DATABASE IF EXISTS "{db}"')
        conn.execute(f"DROP ROLE IF EXISTS {role}")


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    """(API URL, Prefect home) of a server with API auth on; this process sends the secret too."""
    from ckpt.local_stack import start_prefect_server
    from ckpt.processes import stop_process

    home = tmp_path_factory.mktemp("prefect-auth")
    proc, url = start_prefect_server(home, port=None, ui=False, timeout=90, auth_string=AUTH)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_API_AUTH_STRING", AUTH)  # the kit's calls (flow_runs, ...) carry it
        try:
            yield url, home
        finally:
            stop_process(proc, grace=20.0)


@pytest.fixture(scope="module")
def agents(locked_server, catalog_url, s3_endpoint, tmp_path_factory):
    import boto3

    api, _ = locked_server
    root = tmp_path_factory.mktemp("lock")
    bucket = f"lock-{TAG}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key=S3_SECRET).create_bucket(Bucket=bucket)
    a = start_agents(api, root, (NODE,), catalog_url=catalog_url, s3_url=s3_endpoint, bucket=bucket,
                     auth_string=AUTH, extra={"AWS_SECRET_ACCESS_KEY": S3_SECRET, "CKPT_RPO_SECONDS": "10"})
    yield a
    a.stop()


def _tiers(agents, run: str, step: int) -> set[int]:
    cat = agents.catalog()
    try:
        return {loc.tier for loc in cat.locations(run, step)}
    finally:
        cat.close()


def _runs_for(run: str, step: int, api: str) -> list[dict]:
    return [r for r in flow_runs(api, deployment=names.promote_deployment(NODE))
            if r["parameters"].get("run") == run and str(r["parameters"].get("step")) == str(step)]


def test_an_event_without_the_secret_is_refused_and_one_with_it_promotes(agents):
    api = agents.api_url
    refused = events.build_event(events.COMPLETED, "run-auth", 100, node=NODE)
    assert httpx.post(f"{api}/events", json=[refused], timeout=10).status_code == 401
    wrong = events.auth_headers("not-the-secret")
    assert httpx.post(f"{api}/events", json=[refused], headers=wrong, timeout=10).status_code == 401
    assert httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 401
    assert httpx.get(f"{api}/health", timeout=10).status_code == 200  # probes stay open (Prefect's rule)

    out = train(agents, f"""
        with CheckpointStager("run-auth", node="{NODE}", shard_bytes=1 << 20) as st:
            st.save(200, tensors(seed=2))
        print(json.dumps({{"delivered": st._announcer.delivered}}))
    """)
    assert out["delivered"] == [["run-auth", 200, 0, True]]  # the client's own POST carried the secret
    wait_for("step 200 verified on Tier 1", lambda: 1 in _tiers(agents, "run-auth", 200), timeout=120,
             agents=agents)
    # the checkpoint's promote run is created once its part is on Tier 1: waited for, not raced
    runs = wait_for("step 200's promote run", lambda: _runs_for("run-auth", 200, api), agents=agents)
    assert len(runs) == 1
    assert _runs_for("run-auth", 100, api) == []  # the refused event started nothing


def test_the_rpo_alert_still_reaches_the_server_it_calls(agents):
    """The RPO automation's webhook posts to the server's own /events: with auth on it must
    carry the secret, or the alert would be refused exactly when it matters."""
    since = datetime.now(UTC) - timedelta(seconds=5)
    events.post_events(agents.api_url, [events.build_event(events.COMPLETED, "run-late", 5, node="no-agent-here")])
    late = wait_for("ckpt.checkpoint.late", lambda: [e for e in _events(agents.api_url, since)
                                                     if e["event"] == events.LATE
                                                     and e["resource"].get("ckpt.run") == "run-late"], timeout=120)
    assert len(late) == 1


def _pages(api: str, path: str, body: dict) -> list:
    out, offset = [], 0
    while True:
        r = httpx.post(f"{api}/{path}", json={**body, "limit": 200, "offset": offset}, timeout=30, headers=HEADERS)
        r.raise_for_status()
        page = r.json()
        out += page
        if len(page) < 200:
            return out
        offset += 200


def _events(api: str, since: datetime) -> list:
    body = {"filter": {"occurred": {"since": since.isoformat(),
                                    "until": (datetime.now(UTC) + timedelta(minutes=5)).isoformat()}},
            "limit": 50}
    r = httpx.post(f"{api}/events/filter", json=body, timeout=30, headers=HEADERS)
    r.raise_for_status()
    page = r.json()
    out = list(page["events"])
    while page.get("next_page"):
        r = httpx.get(page["next_page"], timeout=30, headers=HEADERS)
        r.raise_for_status()
        page = r.json()
        out += page["events"]
    return out


def _what_the_server_keeps(api: str, home: Path, since: datetime) -> dict[str, str]:
    kept = {path: json.dumps(_pages(api, f"{path}/filter", {}))
            for path in ("flow_runs", "task_runs", "logs", "artifacts", "deployments", "flows",
                         "block_documents", "variables", "work_pools")}
    automations = httpx.post(f"{api}/automations/filter", json={}, timeout=30, headers=HEADERS)
    automations.raise_for_status()
    kept["automations"] = automations.text
    kept["events"] = json.dumps(_events(api, since))
    for f in sorted(home.rglob("*")):
        if f.is_file():  # the server's database (and its WAL), its log
            kept[f"file {f.relative_to(home)}"] = f.read_bytes().decode("latin-1")
    return kept


def test_no_secret_reaches_what_the_prefect_server_stores(agents, locked_server):
    api, home = locked_server
    since = datetime.now(UTC) - timedelta(hours=1)
    out = train(agents, f"""
        with CheckpointStager("run-secret", node="{NODE}", shard_bytes=1 << 20) as st:
            st.save(300, tensors(seed=3), milestone=True)
        print(json.dumps({{"delivered": st._announcer.delivered}}))
    """)
    assert out["delivered"] == [["run-secret", 300, 0, True]]
    wait_for("step 300 verified on tiers 0, 1 and 2", lambda: _tiers(agents, "run-secret", 300) == {0, 1, 2},
             timeout=180, agents=agents)
    # what the flows sent is stored asynchronously (runs finishing, events persisted in batches)
    wait_for("the promotion's runs finished",
             lambda: (runs := [r for r in flow_runs(api) if "run-secret" in r["name"]]) and all(map(finished, runs)),
             timeout=120, agents=agents)
    wait_for("the archived event stored", lambda: any(e["event"] == events.ARCHIVED for e in _events(api, since)),
             timeout=120, agents=agents)
    kept = _what_the_server_keeps(api, home, since)
    assert json.loads(kept["logs"]), "no flow-run logs reached the server: the grep would prove nothing"
    assert "run-secret" in kept["flow_runs"]
    assert any(k.startswith("file prefect.db") for k in kept)
    assert "ckpt-rpo-late" in kept["automations"]  # the agent created it through the auth'd API
    leaks = [(what, where) for what, secret in SECRETS.items() for where, text in kept.items() if secret in text]
    assert leaks == []
