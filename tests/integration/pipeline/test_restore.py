"""Restore: newest verified checkpoint, nearest tier first, every file checked, bad copies
marked and skipped, older checkpoint as the last resort, the destination filled atomically.
Real files, the real pipeline and a real catalog on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from core.errors import ConflictError, NotFound
from tasks.restore import restore_checkpoint
from tests.kit.checkpoints import flip_bit, replica_states
from tests.kit.restore import commit_folder, on_node, promote, scenario_settings, tier0_dir, tier1_dir

RUN = "llm-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return scenario_settings(settings_factory, db_url)


def save(settings, step: int, **kw) -> dict[str, bytes]:
    files = {"model-00001-of-00002.bin": os.urandom(1_500_000), "model-00002-of-00002.bin": os.urandom(700_000),
             "optim/state.bin": os.urandom(100_000)}
    commit_folder(settings, RUN, step, files, **kw)
    promote(settings, RUN, step, kw.get("part", 0), kw.get("parts", 1))
    return files


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith("manifest")}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".restore-" in p.name]


def test_restores_the_newest_checkpoint_from_this_nodes_nvme(settings, tmp_path):
    save(settings, 100)
    newest = save(settings, 200)
    dest = tmp_path / "restored"

    report = restore_checkpoint(settings, RUN, dest)

    assert (report.step, report.tiers, report.notes) == (200, [0], [])
    assert tree(dest) == newest
    assert json.loads((dest / "manifest.json").read_bytes())["step"] == 200
    assert report.bytes == sum(len(b) for b in newest.values()) and report.files == 3
    assert report.seconds > 0 and report.mb_per_s > 0
    assert leftovers(tmp_path) == []


def test_named_step_is_restored(settings, tmp_path):
    first = save(settings, 100)
    save(settings, 200)
    report = restore_checkpoint(settings, RUN, tmp_path / "r", step=100)
    assert report.step == 100 and tree(tmp_path / "r") == first


def test_on_another_node_the_nearest_copy_is_tier1(settings, tmp_path):
    newest = save(settings, 100)
    report = restore_checkpoint(on_node(settings, "node-7"), RUN, tmp_path / "r")
    assert report.tiers == [1] and tree(tmp_path / "r") == newest
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}  # nothing judged


def test_lost_nvme_is_marked_missing_and_tier1_serves(settings, tmp_path):
    newest = save(settings, 100)
    shutil.rmtree(tier0_dir(settings, RUN, 100))

    report = restore_checkpoint(settings, RUN, tmp_path / "r")

    assert report.tiers == [1] and tree(tmp_path / "r") == newest
    assert replica_states(settings, RUN, 100) == {(0, 0): "missing", (1, 0): "verified"}
    assert any("tier 0 copy is missing" in n for n in report.notes)


def test_a_bit_flip_on_tier0_is_caught_and_marked_corrupt(settings, tmp_path):
    newest = save(settings, 100)
    flip_bit(tier0_dir(settings, RUN, 100) / "optim" / "state.bin", -1)

    report = restore_checkpoint(settings, RUN, tmp_path / "r")

    assert report.tiers == [1] and tree(tmp_path / "r") == newest
    assert replica_states(settings, RUN, 100)[(0, 0)] == "corrupt"
    assert [(b.tier, b.state) for b in report.bad] == [(0, "corrupt")]
    assert "optim/state.bin" in report.bad[0].reason


def test_no_good_copy_of_the_newest_falls_back_to_the_previous_and_says_so(settings, tmp_path):
    older = save(settings, 100)
    save(settings, 200)
    shutil.rmtree(tier0_dir(settings, RUN, 200))
    flip_bit(tier1_dir(settings, RUN, 200) / "model-00001-of-00002.bin", 10)

    report = restore_checkpoint(settings, RUN, tmp_path / "r")

    assert report.step == 100 and report.fell_back_from == 200
    assert tree(tmp_path / "r") == older
    assert replica_states(settings, RUN, 200) == {(0, 0): "missing", (1, 0): "corrupt"}
    assert "fell back from step 200 to step 100" in report.notes
    # the next restore knows at once: no copy of 200 is trusted any more
    again = restore_checkpoint(settings, RUN, tmp_path / "again")
    assert again.step == 100 and any("no verified copy" in n for n in again.notes)


def test_a_named_step_without_a_good_copy_fails_and_leaves_no_folder(settings, tmp_path):
    save(settings, 100)
    save(settings, 200)
    shutil.rmtree(tier0_dir(settings, RUN, 200))
    flip_bit(tier1_dir(settings, RUN, 200) / "optim" / "state.bin", -1)
    dest = tmp_path / "r"

    with pytest.raises(NotFound, match="step 200"):
        restore_checkpoint(settings, RUN, dest, step=200)

    assert not dest.exists() and leftovers(tmp_path) == []


def test_a_non_empty_destination_is_refused_untouched(settings, tmp_path):
    save(settings, 100)
    dest = tmp_path / "r"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")

    with pytest.raises(ConflictError, match="not empty"):
        restore_checkpoint(settings, RUN, dest)

    assert [p.name for p in dest.iterdir()] == ["mine.txt"] and leftovers(tmp_path) == []


def test_an_empty_destination_folder_is_filled(settings, tmp_path):
    newest = save(settings, 100)
    (tmp_path / "r").mkdir()
    restore_checkpoint(settings, RUN, tmp_path / "r")
    assert tree(tmp_path / "r") == newest


def test_multi_part_checkpoint_comes_from_the_nearest_tier_of_each_part(settings, tmp_path):
    node1 = on_node(settings, "node-1")
    part0 = save(settings, 100, part=0, parts=2)
    part1 = {"rank1/shard.bin": os.urandom(400_000)}
    commit_folder(node1, RUN, 100, part1, part=1, parts=2)
    promote(node1, RUN, 100, 1, 2)

    report = restore_checkpoint(settings, RUN, tmp_path / "r")  # on node-0: part 1 is not local

    assert report.tiers == [0, 1]
    assert tree(tmp_path / "r") == {**part0, **part1}
    names = sorted(p.name for p in (tmp_path / "r").glob("manifest*"))
    assert names == ["manifest.part-00000-of-00002.json", "manifest.part-00001-of-00002.json"]


def test_unknown_run_is_a_clear_error(settings, tmp_path):
    from core.errors import UnknownRun

    with pytest.raises(UnknownRun):
        restore_checkpoint(settings, "nobody", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_cli_prints_tier_bytes_seconds_and_throughput(settings, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ckpt.cli import app

    newest = save(settings, 100)
    shutil.rmtree(tier0_dir(settings, RUN, 100))
    monkeypatch.setenv("CKPT_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("CKPT_CATALOG_URL", settings.catalog_url)
    monkeypatch.setenv("CKPT_NODE", settings.node)

    result = CliRunner().invoke(app, ["restore", RUN, "--to", str(tmp_path / "r")])

    assert result.exit_code == 0, result.output
    assert tree(tmp_path / "r") == newest
    out = result.output
    assert "tier used : 1" in out and f"{sum(map(len, newest.values())):,}" in out
    assert "seconds" in out and "MB/s" in out and "tier 0 copy is missing" in out

    as_json = CliRunner().invoke(app, ["restore", RUN, "--to", str(tmp_path / "j"), "--json", "--tier", "1"])
    doc = json.loads(as_json.stdout)
    assert (doc["step"], doc["tier"], doc["bytes"]) == (100, 1, sum(map(len, newest.values())))


def test_a_tampered_manifest_on_tier1_is_corrupt_and_tier0_serves(settings, tmp_path):
    newest = save(settings, 100)
    mpath = tier1_dir(settings, RUN, 100) / "manifest.json"
    doc = json.loads(mpath.read_bytes())
    doc["files"] = [f for f in doc["files"] if f["path"] != "optim/state.bin"]  # hide a file
    mpath.write_text(json.dumps(doc))

    report = restore_checkpoint(settings, RUN, tmp_path / "r", preference=(1, 0))

    assert report.tiers == [0] and tree(tmp_path / "r") == newest
    assert replica_states(settings, RUN, 100)[(1, 0)] == "corrupt"
    assert "differs from the catalog" in report.bad[0].reason


def test_progress_reaches_the_total_once_per_copy_tried(settings, tmp_path):
    newest = save(settings, 100)
    total = sum(map(len, newest.values()))
    flip_bit(tier0_dir(settings, RUN, 100) / "model-00002-of-00002.bin", -1)
    seen: list[tuple[int, int, str]] = []

    restore_checkpoint(settings, RUN, tmp_path / "r", progress=lambda d, t, label: seen.append((d, t, label)))

    assert {t for _, t, _ in seen} == {total}
    labels = [label for _, _, label in seen]
    assert labels[0] == "step 100 part 0 from tier 0" and labels[-1] == "step 100 part 0 from tier 1"
    assert max(d for d, _, label in seen if label.endswith("tier 1")) == total


def test_where_the_kernel_cannot_copy_files_are_streamed_and_checked(settings, tmp_path, monkeypatch):
    import errno

    import core.storage.stage as stage

    def no_copy_file_range(*_a):
        raise OSError(errno.EXDEV, "cross-device")  # e.g. an older kernel across file systems

    newest = save(settings, 100)
    flip_bit(tier0_dir(settings, RUN, 100) / "optim" / "state.bin", -1)
    monkeypatch.setattr(stage.os, "copy_file_range", no_copy_file_range)

    report = restore_checkpoint(settings, RUN, tmp_path / "r")

    assert report.tiers == [1] and tree(tmp_path / "r") == newest
    assert [(b.tier, b.state) for b in report.bad] == [(0, "corrupt")]
