"""``ckpt promote --here``, ``ckpt reconcile`` and ``ckpt retention`` without a Prefect API: the
same steps run as plain functions (the flow-run path is tested in tests/integration)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.kit.checkpoints import ckpt_dir, replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"


@pytest.fixture
def cli_env(settings_factory, db_url, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    settings = pipeline_settings(settings_factory, db_url)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    env = {"CKPT_DATA_DIR": str(settings.data_dir), "CKPT_NODE": settings.node, "CKPT_CATALOG_URL": db_url}
    with temporary_settings(updates={PREFECT_API_URL: None}):
        yield settings, env


def invoke(args, env):
    from ckpt.cli import app

    out = CliRunner().invoke(app, args, env=env)
    assert out.exit_code == 0, out.output
    return out.stdout


def test_commands_run_the_plain_steps_without_a_prefect_api(cli_env):
    settings, env = cli_env
    for step in (1, 2, 3, 4, 5):
        write_checkpoint(settings.tier0_url, RUN, step, shard_bytes=64 << 10)

    promoted = json.loads(invoke(["promote", "--run", RUN, "--step", "1", "--here", "--json"], env))
    assert promoted["durable"] and promoted["hops"][1]["hop"] == "tier 0 -> tier 1"

    report = json.loads(invoke(["reconcile", "--json"], {**env, "CKPT_RECONCILE_INTERVAL_SECONDS": "5"}))
    assert sorted(report["promoted"]) == [f"{RUN}/{s} part 0" for s in (2, 3, 4, 5)]
    assert all(replica_states(settings, RUN, s)[(1, 0)] == "verified" for s in range(1, 6))

    keep1 = {**env, "CKPT_RETENTION_TIER0__KEEP_LAST": "1"}
    plan = json.loads(invoke(["retention", "--dry-run", "--json"], keep1))
    assert [(a["step"], a["outcome"]) for a in plan] == [(3, "planned"), (4, "planned")]  # 1, 2: pruned already
    done = json.loads(invoke(["retention", "--json"], keep1))
    assert [(a["step"], a["outcome"]) for a in done] == [(3, "pruned"), (4, "pruned")]
    assert not ckpt_dir(settings.tier0_url, RUN, 4).exists() and ckpt_dir(settings.tier0_url, RUN, 5).is_dir()


def test_promote_of_a_missing_checkpoint_is_a_clear_error(cli_env):
    from ckpt.cli import app

    _settings, env = cli_env
    out = CliRunner().invoke(app, ["promote", "--run", RUN, "--step", "9", "--here"], env=env)
    assert out.exit_code != 0
    assert "no manifest" in str(out.exception)


def test_a_copy_reports_its_progress_to_the_observer_up_to_the_part_s_bytes(cli_env):
    """What feeds ``ckpt promote --here``'s progress bar: every byte of the hop is reported."""
    from core.progress import observe
    from flows.common import plain_steps
    from flows.promote import promote

    settings, _env = cli_env
    write_checkpoint(settings.tier0_url, RUN, 7, shard_bytes=256 << 10)
    seen: dict[str, list[tuple[int, int]]] = {}

    with observe(lambda label, done, total: seen.setdefault(label, []).append((done, total))):
        result = promote(settings, RUN, 7, steps=plain_steps())

    hop = result.hops[-1]
    label = f"{RUN}/7 part 0: tier 0 -> tier 1"
    assert list(seen) == [label]
    dones = [d for d, _ in seen[label]]
    assert dones == sorted(dones) and dones[-1] == hop.bytes == seen[label][-1][1] > 0
    seen.clear()
    promote(settings, RUN, 7, steps=plain_steps())  # nothing left to copy: nothing reported
    assert seen == {}
    # and without an observer nothing is reported at all (no observer installed here)
    from core.progress import reporter
    assert reporter("x", 1) is None



def test_retention_dry_run_explain_says_why_for_every_copy(cli_env):
    settings, env = cli_env
    for step in (1, 2, 3):
        write_checkpoint(settings.tier0_url, RUN, step, shard_bytes=16 << 10)
    invoke(["reconcile", "--json"], {**env, "CKPT_RECONCILE_INTERVAL_SECONDS": "5"})
    keep1 = {**env, "CKPT_RETENTION_TIER0__KEEP_LAST": "1", "CKPT_RETENTION_TIER1__KEEP_LAST": "2"}

    plan = json.loads(invoke(["retention", "--dry-run", "--json"], keep1))
    assert [(a["tier"], a["step"], a["action"], a["reason"]) for a in plan] == [
        (0, 1, "retire", "no tier keeps it"), (1, 1, "retire", "no tier keeps it"),
        (0, 2, "demote", "not kept on tier 0")]
    explained = json.loads(invoke(["retention", "--dry-run", "--explain", "--json"], keep1))
    kept = {(a["tier"], a["step"]): a["detail"] for a in explained if a["outcome"] == "kept"}
    assert kept == {(1, 2): "keep_last", (0, 3): "newest verified, keep_last", (1, 3): "newest verified, keep_last"}
    table = invoke(["retention", "--dry-run", "--explain"], keep1)
    assert "no tier keeps it" in table and "newest verified" in table
    assert all(replica_states(settings, RUN, s)[(0, 0)] == "verified" for s in (1, 2, 3))  # a dry run
