"""docker-compose.yml passes only settings the code reads, and the stack has its parts."""

from __future__ import annotations

from pathlib import Path

import yaml

from core.settings import Settings
from tests.kit.require import require_module

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _env_of_every_service() -> dict[str, dict[str, str]]:
    out = {}
    for name, svc in _compose()["services"].items():
        env = svc.get("environment") or {}
        if isinstance(env, list):  # KEY=VALUE form
            env = dict(item.split("=", 1) for item in env)
        out[name] = {str(k): str(v) for k, v in env.items()}
    return out


def _ckpt_setting_exists(var: str) -> bool:
    """CKPT_X maps to field x; CKPT_X__Y to field y of the nested model x."""
    name = var.removeprefix("CKPT_").lower()
    top, _, nested = name.partition("__")
    field = Settings.model_fields.get(top)
    if field is None:
        return False
    if not nested:
        return True
    sub = getattr(field.annotation, "model_fields", {})
    return nested in sub


def test_every_ckpt_variable_is_a_setting():
    seen = 0
    for service, env in _env_of_every_service().items():
        for var in env:
            if var.startswith("CKPT_"):
                seen += 1
                assert _ckpt_setting_exists(var), f"{service}: {var} is not read by core.settings.Settings"
    assert seen >= 10  # the agent and the migration job are configured through CKPT_*


def _redis_plugin_settings() -> dict[str, type]:
    """prefect-redis' own settings classes, by environment prefix."""
    from prefect_redis.cleanup_queue import RedisWorkerCleanupQueueSettings
    from prefect_redis.client import RedisMessagingSettings

    return {"PREFECT_REDIS_MESSAGING_": RedisMessagingSettings,
            "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_": RedisWorkerCleanupQueueSettings}


def _prefect_setting_exists(var: str) -> bool:
    from prefect.settings import Settings as PrefectSettings

    legacy = require_module("prefect.settings.legacy", "Prefect 3's settings registry (prefect.settings.legacy)")
    if var in legacy._get_valid_setting_names(PrefectSettings):
        return True
    for prefix, cls in _redis_plugin_settings().items():
        if var.startswith(prefix):
            return var.removeprefix(prefix).lower() in cls.model_fields
    return False


def test_every_prefect_variable_is_a_prefect_setting():
    seen = 0
    for service, env in _env_of_every_service().items():
        for var in env:
            if var.startswith("PREFECT_"):
                seen += 1
                assert _prefect_setting_exists(var), f"{service}: {var} is not a Prefect (or prefect-redis) setting"
    assert seen >= 20  # the server processes are configured through PREFECT_*


def test_server_processes_run_with_the_settings_the_local_stack_uses():
    """compose and ``ckpt up --production`` start Prefect the same way: the same settings
    (values differ only in host names and credentials), every module named is importable."""
    import importlib

    from ckpt.production_stack import RedisDb, server_env

    env = _env_of_every_service()
    code = server_env("postgresql+asyncpg://postgres@127.0.0.1:5432/prefect", RedisDb("127.0.0.1", 6379, 0))
    for service in ("prefect-server", "prefect-services", "prefect-migrate"):
        assert set(code) <= set(env[service]), f"{service} lacks {set(code) - set(env[service])}"
        for var, value in code.items():
            if value.startswith("prefect_redis."):
                assert env[service][var] == value
                importlib.import_module(value)
        assert env[service]["PREFECT_REDIS_MESSAGING_HOST"] == "redis"
        assert env[service]["PREFECT_SERVER_DATABASE_MIGRATE_ON_START"] == "false"
    services = _compose()["services"]
    assert services["prefect-server"]["command"].startswith("prefect server start --no-services")
    assert services["prefect-services"]["command"] == "prefect server services start"
    assert services["prefect-migrate"]["command"] == "prefect server database upgrade -y"
    assert "redis" in services["prefect-server"]["depends_on"] and "redis" in services


def test_redis_settings_arrive_in_prefect_redis(monkeypatch):
    from ckpt.production_stack import RedisDb, server_env

    for k, v in server_env("postgresql+asyncpg://x@h/p", RedisDb("redis-host", 6390, 7)).items():
        monkeypatch.setenv(k, v)
    for cls in _redis_plugin_settings().values():
        s = cls()
        assert (s.host, s.port, s.db) == ("redis-host", 6390, 7)


def test_agent_environment_loads_into_settings(monkeypatch, tmp_path):
    """The values arrive where the code reads them (not just names that exist)."""
    monkeypatch.chdir(tmp_path)
    env = _env_of_every_service()["agent"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.node == "node-0"
    assert s.tier0_url == "/nvme/ckpt" and s.tier1_url == "/lustre/ckpt"
    assert s.tier2_url == "s3://checkpoints/ckpt"
    assert s.s3_endpoint_url == "http://minio:9000"
    assert s.catalog_url.startswith("postgresql+psycopg://")
    assert s.retention_tier0.keep_last == 3 and s.milestones.every_steps == 1000


def test_stack_has_its_parts_wired_together():
    services = _compose()["services"]
    server = services["prefect-server"]
    assert "postgresql+asyncpg://" in server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    bucket_cmd = " ".join(services["minio-bucket"]["command"])
    bucket = _env_of_every_service()["agent"]["CKPT_TIER2_URL"].removeprefix("s3://").split("/")[0]
    assert f"--ignore-existing local/{bucket}" in bucket_cmd
    assert "mc mb --with-lock" in bucket_cmd  # so that CKPT_TIER2_LOCK_DAYS can be turned on
    agent = services["agent"]
    assert agent["command"].startswith("ckpt agent")
    assert {"prefect-server", "minio-bucket", "catalog-migrate"} <= set(agent["depends_on"])
    assert services["catalog-migrate"]["command"] == "ckpt db upgrade"
    catalog_host = _env_of_every_service()["agent"]["CKPT_CATALOG_URL"].split("@")[1].split(":")[0]
    assert catalog_host in services


def test_checker_notices_an_unknown_variable():
    assert not _prefect_setting_exists("PREFECT_REDIS_MESSAGING_HOSTNAME")
    assert not _prefect_setting_exists("PREFECT_MESSAGING_BROKERS")
    assert _prefect_setting_exists("PREFECT_REDIS_MESSAGING_DB")
    assert not _ckpt_setting_exists("CKPT_TIER3_URL")
    assert not _ckpt_setting_exists("CKPT_RETENTION_TIER0__KEEP_FIRST")
    assert _ckpt_setting_exists("CKPT_RETENTION_TIER0__KEEP_LAST")
