"""Which source a resuming node takes for a part, as a table: no catalog, no servers."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from db.entities import FileInfo, ReplicaInfo
from tasks.resume import plan_sources, wide_files

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def rep(tier: int, state: str = "verified", node: str | None = None, part: int = 0) -> ReplicaInfo:
    return ReplicaInfo(id=tier * 10 + part, checkpoint_id=1, run="r", step=1, tier=tier, part=part, node=node,
                       url=f"t{tier}", state=state, bytes=1, verified_at=NOW, copy_seconds=None, etag=None,
                       version_id=None, claim_token=None, updated_at=NOW)


ALL = {0, 1, 2}
CASES = [
    # replicas, configured tiers, local tiers -> [(tier, in place)]
    ([rep(0, node="n0"), rep(1), rep(2)], ALL, {0, 1}, [(0, True), (1, True), (2, False)]),
    ([rep(0, node="n9"), rep(1), rep(2)], ALL, {0, 1}, [(1, True), (2, False)]),  # another node's NVMe
    ([rep(0, node="n0"), rep(1), rep(2)], ALL, {0}, [(0, True), (1, False), (2, False)]),  # Tier 1 over fsspec
    ([rep(0, "corrupt", "n0"), rep(1, "missing"), rep(2)], ALL, {0, 1}, [(2, False)]),
    ([rep(0, "copying", "n0"), rep(1, "pruned"), rep(2, "pending")], ALL, {0, 1}, []),
    ([rep(0, node="n0"), rep(1), rep(2)], {0, 1}, {0, 1}, [(0, True), (1, True)]),  # Tier 2 not configured here
    ([rep(0, node=None), rep(1, part=1)], ALL, {0, 1}, [(0, True)]),  # another part's copy is not this part's
]


@pytest.mark.parametrize(("replicas", "configured", "local", "expected"), CASES)
def test_cheapest_good_source_first(replicas, configured, local, expected):
    got = plan_sources(replicas, 0, node="n0", configured=configured, local=local)
    assert [(s.tier, s.in_place) for s in got] == expected


def test_a_part_brings_the_checkpoint_wide_files_another_part_holds():
    def f(part: int, path: str) -> FileInfo:
        return FileInfo(checkpoint_id=1, part=part, path=path, size=1, algorithm="crc32c", checksum="0")

    files = [f(0, ".metadata"), f(0, "__0_0.distcp"), f(1, "__1_0.distcp"), f(0, "model.safetensors.index.json"),
             f(1, "model.safetensors.index.json")]
    assert [(w.part, w.path) for w in wide_files(files, [1])] == [(0, ".metadata")]  # part 1 has its own index
    assert wide_files(files, [0]) == []
    assert wide_files(files, [0, 1]) == []


@pytest.mark.parametrize(("args", "says"), [(["../x"], "invalid run name"),
                                            (["run-a", "--part", "3", "--parts", "2"], "part 3 out of range")])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, args, says):
    import os
    import subprocess
    import sys

    env = {**os.environ, "CKPT_DATA_DIR": str(tmp_path / "data")}
    out = subprocess.run([sys.executable, "-m", "ckpt.cli", "resume", *args], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_the_stage_sweep_leaves_what_is_not_a_stage_of_a_run(tmp_path):
    """Reconcile's sweep of dead fetch stages on a folder tier: a folder at the root whose name is
    not a run's, a run's step folder and a hidden file of another shape are none of its business
    (nothing removed, nothing raised); a stage of a checkpoint the catalog does not know goes only
    once it is older than a killed resume's could still be in flight."""
    import os
    import time

    from core.layout import STAGING_MARK
    from core.storage.local import LocalStore
    from db.catalog import Catalog, upgrade
    from tasks.resume import STAGE_AGE_S, sweep_dead_stages

    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    root = tmp_path / "tier0"
    (root / "lost+found").mkdir(parents=True)
    run = root / "llm"
    (run / "step-00000100").mkdir(parents=True)
    (run / ".hidden-file").write_text("x")
    young = run / f"{STAGING_MARK}1-abcdef01-step-00000200.part-00000-of-00001"
    old = run / f"{STAGING_MARK}2-abcdef02-step-00000300.part-00000-of-00001"
    for stage in (young, old):
        (stage / "shard").mkdir(parents=True)
    past = time.time() - STAGE_AGE_S - 60
    os.utime(old, (past, past))
    store = LocalStore(str(root), 0)
    with Catalog(url) as cat:
        removed = sweep_dead_stages(cat, store, ["lost+found", "llm", "no-such-run"], node="node-0", actor="test")
        assert removed == 1
        assert [e.reason for e in cat.audit_log() if e.action == "delete"] == [
            "1 stage folder(s) of part 0: of a checkpoint the catalog does not know, older than 3600 s"]
    assert sorted(p.name for p in run.iterdir()) == sorted([".hidden-file", "step-00000100", young.name])
    assert (root / "lost+found").is_dir()


def test_the_stage_sweep_never_goes_through_a_run_folder_that_is_a_link(tmp_path):
    """A run's folder on the tier that is a symlink (here to another run's folder under the same
    root) holds no stage of that run: the sweep lists nothing behind the link and removes
    nothing there, however old and unclaimed what lies there is."""
    import os
    import time

    from core.layout import STAGING_MARK
    from core.storage.local import LocalStore
    from db.catalog import Catalog, upgrade
    from tasks.resume import STAGE_AGE_S, sweep_dead_stages

    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    root = tmp_path / "tier0"
    other = root / "other-run"
    stage = other / f"{STAGING_MARK}2-abcdef02-step-00000300.part-00000-of-00001"
    (stage / "shard").mkdir(parents=True)
    past = time.time() - STAGE_AGE_S - 60
    os.utime(stage, (past, past))
    (root / "llm").symlink_to(other, target_is_directory=True)
    store = LocalStore(str(root), 0)
    with Catalog(url) as cat:
        assert sweep_dead_stages(cat, store, ["llm"], node="node-0", actor="test") == 0
        assert [e for e in cat.audit_log() if e.action == "delete"] == []
    assert (stage / "shard").is_dir() and (root / "llm").is_symlink()
