"""Cluster drills: N processes resume their parts of one checkpoint at once from a cold start
(no Tier 0 of their own), load them with safetensors and check them against the manifest; the
catalog records the cluster RTO, each node's time, bytes per tier and the bound. Real files,
moto's S3 server, catalogs on SQLite and PostgreSQL."""

from __future__ import annotations

import json

import pytest

from core.errors import BadInput
from db.catalog import Catalog
from tasks.drill import cluster_drill
from tests.kit.checkpoints import flip_bit, replica_states, shard_paths, write_checkpoint
from tests.kit.restore import on_node, promote, scenario_settings

RUN = "llm-c"
PARTS = 2
SHARD = 64 << 10


@pytest.fixture
def settings(settings_factory, db_url, s3_endpoint, s3_bucket):
    return scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)


def save(settings, step: int) -> int:
    """A 2-part HF safetensors milestone, each part written and promoted by its own node; its bytes."""
    total = 0
    for part in range(PARTS):
        node = on_node(settings, f"node-{part}")
        m = write_checkpoint(node.tier0_url, RUN, step, part=part, parts=PARTS, node=node.node,
                             shard_bytes=SHARD, kind="milestone")
        total += sum(f.size for f in m.files)
        with Catalog(settings.catalog_url) as cat:
            cat.ensure_run(RUN, actor="test")
        promote(node, RUN, step, part, PARTS)
    return total


def test_every_node_resumes_its_part_at_once_from_tier1_and_tier2(settings, tmp_path):
    size = save(settings, 100)

    drills, skipped = cluster_drill(settings, run=RUN, nodes=PARTS, scratch=tmp_path / "s")

    assert skipped == []
    assert [(d.result.tier, d.result.ok, d.result.nodes) for d in drills] == [(1, True, 2), (2, True, 2)]
    t1, t2 = drills
    # Tier 1 is mounted here: read in place, nothing copied; the loader read every byte from it
    assert all(o.source == "tier 1 in place" for o in t1.outcomes)
    assert t1.result.tier_bytes.get("1", 0) >= size and "local" not in t1.result.tier_bytes
    # Tier 2: fetched into each node's scratch folder, then loaded from there
    assert all(o.source == "tier 2 fetched" for o in t2.outcomes)
    assert t2.result.tier_bytes["2"] >= size and t2.result.tier_bytes["local"] >= size
    for d in drills:
        assert all(o.ok and o.tensors == 2 and o.loader.startswith("safetensors") for o in d.outcomes)
        assert len(d.result.node_seconds) == 2 and d.result.seconds == max(d.result.node_seconds) > 0
        assert d.result.bound_seconds > 0
    assert not list((tmp_path / "s").iterdir())  # scratch removed
    with Catalog(settings.catalog_url) as cat:
        recorded = cat.drills(RUN)
        files = cat.files(cat.get_checkpoint(RUN, 100).id)
    # the bound: each node read its own files again, raw, plus the index it needs that part 0 holds
    index = next(f.size for f in files if f.path == "model.safetensors.index.json")
    own = [sum(f.size for f in files if f.part == part) for part in range(PARTS)]
    assert [d.drained for d in drills] == [[own[0], own[1] + index]] * 2
    assert sorted((r.tier, r.nodes, r.ok) for r in recorded) == [(1, 2, True), (2, 2, True)]
    assert {r.tier: r.bound_seconds for r in recorded} == {d.result.tier: d.result.bound_seconds for d in drills}


def test_a_part_the_loader_would_refuse_fails_the_drill_on_that_tier(settings, tmp_path):
    save(settings, 100)
    # part 1's first shard (part 0 needs nothing of part 1's); same size: only reading the bytes finds it
    flip_bit(shard_paths(settings.tier1_url, RUN, 100)[2])

    drills, _ = cluster_drill(settings, run=RUN, tiers=(1,), scratch=tmp_path / "s")

    (d,) = drills
    assert not d.result.ok and d.result.nodes == 2
    assert "part 1: CorruptCheckpoint: model-p01-00000.safetensors" in d.result.detail
    assert [o.ok for o in d.outcomes] == [True, False]
    states = replica_states(settings, RUN, 100)
    assert (states[(1, 0)], states[(1, 1)]) == ("verified", "corrupt")  # the load found it, marked it


def test_a_copy_gone_from_its_tier_is_a_recorded_failure_without_a_bound(settings, tmp_path):
    save(settings, 100)
    shard_paths(settings.tier1_url, RUN, 100)[3].unlink()  # part 1's second shard, behind the catalog's back

    drills, _ = cluster_drill(settings, run=RUN, tiers=(1,), scratch=tmp_path / "s")

    (d,) = drills
    assert (d.result.ok, d.result.bound_seconds) == (False, None)  # part 1 could not drain its files
    assert [o.ok for o in d.outcomes] == [True, False]
    with Catalog(settings.catalog_url) as cat:
        assert [(r.tier, r.ok, r.bound_seconds) for r in cat.drills(RUN)] == [(1, False, None)]
    assert replica_states(settings, RUN, 100)[(1, 1)] in ("missing", "corrupt")  # no longer trusted


def test_nodes_must_match_the_parts_and_a_tier_without_the_checkpoint_is_skipped(settings, tmp_path):
    save(settings, 100)
    with pytest.raises(BadInput, match="--nodes must be 2"):
        cluster_drill(settings, run=RUN, nodes=3, scratch=tmp_path / "s")
    no_t2 = settings.model_copy(update={"tier2_url": None})
    drills, skipped = cluster_drill(no_t2, run=RUN, tiers=(2,), scratch=tmp_path / "s")
    assert drills == [] and skipped == [f"tier 2: no checkpoint of {RUN} held whole there"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the CLI's shape; the catalog side runs on both above
def test_cli_drill_nodes_json_then_drills(settings, monkeypatch):
    from typer.testing import CliRunner

    from ckpt.cli import app

    save(settings, 100)
    for k, v in (("DATA_DIR", str(settings.data_dir)), ("CATALOG_URL", settings.catalog_url),
                 ("NODE", settings.node), ("TIER1_URL", settings.tier1_url), ("TIER2_URL", settings.tier2_url),
                 ("S3_ENDPOINT_URL", settings.s3_endpoint_url)):
        monkeypatch.setenv(f"CKPT_{k}", v)

    ran = CliRunner().invoke(app, ["drill", "--run", RUN, "--nodes", "2", "--tier", "2", "--json"])
    assert ran.exit_code == 0, ran.output
    (row,) = json.loads(ran.stdout)
    assert (row["tier"], row["nodes"], row["ok"]) == (2, 2, True)
    assert row["rto_seconds"] > 0 and row["bound_seconds"] > 0 and len(row["node_seconds"]) == 2
    bad = CliRunner().invoke(app, ["drill", "--run", RUN, "--nodes", "5"])  # refused before any node starts
    assert isinstance(bad.exception, BadInput) and "--nodes must be 2" in str(bad.exception)
    table = CliRunner().invoke(app, ["drills"])
    assert "nodes" in table.output and "bound" in table.output


def test_the_bound_reads_tier2_with_the_requests_of_the_resume_it_bounds(settings, tmp_path, monkeypatch):
    """A drill's bound drains each object as the resume fetches it: a shard of the ranged size
    as the same ranged GETs, a small file as one GET; the bytes are counted, not kept."""
    from collections import Counter

    from core.storage.s3.store import S3Store
    from tasks.drill_node import drain, drill_settings, part_keys
    from tasks.resume import resume

    save(settings, 100)
    ranged = settings.model_copy(update={"s3_range_bytes": 16 << 10, "s3_ranged_threshold": 16 << 10})
    cold = drill_settings(ranged, 2, 1)
    reads: Counter[tuple[str, str]] = Counter()
    read_range, open_read = S3Store._read_range, S3Store.open_read

    def spy_range(self, key, *args, **kwargs):
        reads[(key.rsplit("/", 1)[-1], "range")] += 1
        return read_range(self, key, *args, **kwargs)

    def spy_open(self, key):
        reads[(key.rsplit("/", 1)[-1], "whole")] += 1
        return open_read(self, key)

    monkeypatch.setattr(S3Store, "_read_range", spy_range)
    monkeypatch.setattr(S3Store, "open_read", spy_open)
    objects = part_keys(cold, RUN, 100, 1)
    assert drain(cold, 2, objects) == sum(objects.values())
    names = {k.rsplit("/", 1)[-1] for k in objects}
    drained = Counter({k: n for k, n in reads.items() if k[0] in names})  # opening the tier reads its marker
    reads = Counter()
    point = resume(cold, RUN, part=1, parts=PARTS, to=tmp_path / "node-1", actor="test")
    assert point is not None and point.step == 100
    fetched = Counter({k: n for k, n in reads.items() if k[0] in names})  # the resume also reads its manifest
    assert drained == fetched
    assert {k for k in drained if k[1] == "range"} == {(n, "range") for n in names if n.endswith(".safetensors")}
    assert drained[("model.safetensors.index.json", "whole")] == 1  # small: one GET
