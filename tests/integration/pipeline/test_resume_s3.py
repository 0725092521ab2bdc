"""Resume against Tier 2 on moto's S3 server (through a recording proxy): Tier 1 rehydrated once
for the whole cluster, a Tier 1 copy that vanishes mid-read, a fetch killed halfway, a part
linked in beside another part's files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from core.storage.identity import MARKER_KEY
from tasks.resume import resume
from tests.kit.checkpoints import open_catalog, replica_states
from tests.kit.restore import commit_folder, on_node, promote, scenario_settings, tier0_dir, tier1_dir
from tests.kit.s3 import stored_key
from tests.kit.s3_proxy import S3Proxy

RUN = "llm-s3"
FILES = {"model-00001.bin": 200_000, "model-00002.bin": 150_000, "optim/state.bin": 60_000}


@pytest.fixture
def proxy(s3_endpoint):
    p = S3Proxy(s3_endpoint)
    yield p
    p.close()


def save_milestone(settings, step: int = 100) -> dict[str, bytes]:
    files = {rel: os.urandom(n) for rel, n in FILES.items()}
    commit_folder(settings, RUN, step, files, milestone=True)
    promote(settings, RUN, step)
    assert replica_states(settings, RUN, step)[(2, 0)] == "verified"
    return files


def lose_tier1(settings, step: int = 100) -> None:
    """Tier 1's copy is gone and the catalog knows it (as reconcile records a vanished copy);
    its bytes are gone too: the content store keeps none that no checkpoint links."""
    from core.storage.content import ContentStore

    shutil.rmtree(tier1_dir(settings, RUN, step))
    ContentStore(Path(settings.tier1_url), 1 << 20).sweep()
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(RUN, step)
        rep = next(r for r in cat.replicas(ck.id, 1))
        cat.transition(rep.id, "missing", expected="verified", actor="test", reason="test: tier 1 lost")


def tree(folder: Path | str) -> dict[str, bytes]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith("manifest")}


def data_gets(proxy: S3Proxy) -> Counter:
    """GETs of checkpoint data (not manifests) per object."""
    return Counter(r.key.rsplit("/", 1)[-1] if "optim" not in r.key else "optim/state.bin"
                   for r in proxy.seen if r.method == "GET" and "step-" in r.key and "manifest" not in r.key)


def test_two_nodes_resuming_at_once_read_each_object_from_s3_once(settings_factory, db_url, s3_bucket, proxy):
    settings = scenario_settings(settings_factory, db_url, s3_endpoint=proxy.url, s3_bucket=s3_bucket)
    files = save_milestone(settings)
    lose_tier1(settings)
    proxy.seen.clear()
    nodes = [on_node(settings, n) for n in ("node-a", "node-b")]
    barrier, points, errors = threading.Barrier(2), {}, []

    def node(s):
        barrier.wait()
        try:
            points[s.node] = resume(s, RUN)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(s,)) for s in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    assert errors == []
    assert {p.path for p in points.values()} == {str(tier1_dir(settings, RUN, 100))}
    assert tree(tier1_dir(settings, RUN, 100)) == files
    assert data_gets(proxy) == {"model-00001.bin": 1, "model-00002.bin": 1, "optim/state.bin": 1}
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    sources = sorted((p.parts[0].tier, p.parts[0].source, p.parts[0].bytes_moved) for p in points.values())
    assert sources == [(1, "in place", 0), (2, "fetched", sum(FILES.values()))]  # one read S3, one waited


def test_nodes_rehydrating_a_checkpoint_read_its_index_from_s3_once(settings_factory, db_url, s3_bucket, proxy,
                                                                   monkeypatch):
    """Two nodes resume their parts of a two-part milestone whose Tier 1 copy is gone. Part 0
    holds the checkpoint-wide index that part 1 needs to load: the node of part 1 waits for the
    node of part 0 to publish part 0 on Tier 1 and reads the index there, so every object,
    the index too, is read from S3 once per cluster resume. (Node-a is held at its first byte
    until node-b has published part 1: node-b then needs the index while part 0 is in flight.)"""
    from core.storage.s3.store import S3Store

    settings = scenario_settings(settings_factory, db_url, s3_endpoint=proxy.url, s3_bucket=s3_bucket)
    node_a, node_b = on_node(settings, "node-a"), on_node(settings, "node-b")
    save_two_part_milestone((node_a, node_b))
    expected = tree(tier1_dir(settings, RUN, 100))
    shutil.rmtree(tier1_dir(settings, RUN, 100))
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        assert {(r.part, r.state) for r in cat.replicas(ck.id, 2)} == {(0, "verified"), (1, "verified")}
        for rep in cat.replicas(ck.id, 1):
            cat.transition(rep.id, "missing", expected="verified", actor="test", reason="test: tier 1 lost")
    for s in (node_a, node_b):  # cold nodes
        shutil.rmtree(tier0_dir(s, RUN, 100))
    proxy.seen.clear()
    a_copying, real_read, points, errors = threading.Event(), S3Store.open_read, {}, []

    def part1_on_tier1() -> bool:
        with open_catalog(settings) as cat:
            return any(r.part == 1 and r.state == "verified" for r in cat.replicas(ck.id, 1))

    def open_read(self, key):
        if "model-p00" in key and not a_copying.is_set():
            # node-a holds part 0's Tier 1 claim; it goes on once node-b has published part 1,
            # so node-b comes to the index while part 0 is still being copied
            a_copying.set()
            deadline = time.monotonic() + 60
            while not part1_on_tier1() and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_read(self, key)

    monkeypatch.setattr(S3Store, "open_read", open_read)

    def node(s, part):
        try:
            points[part] = resume(s, RUN, part=part, parts=2)
        except Exception as exc:
            errors.append(exc)

    a = threading.Thread(target=node, args=(node_a, 0))
    a.start()
    assert a_copying.wait(60)
    b = threading.Thread(target=node, args=(node_b, 1))
    b.start()
    for t in (a, b):
        t.join(timeout=120)

    assert errors == []
    assert {p.path for p in points.values()} == {str(tier1_dir(settings, RUN, 100))}
    assert tree(tier1_dir(settings, RUN, 100)) == expected
    gets = Counter(r.key.rsplit("/", 1)[-1] for r in proxy.seen
                   if r.method == "GET" and "step-" in r.key and "manifest" not in r.key)
    assert gets == dict.fromkeys(expected, 1), gets
    assert "model.safetensors.index.json" in gets


def test_tier1_copy_removed_between_choice_and_read_falls_to_tier2(settings_factory, db_url, s3_bucket,
                                                                   s3_endpoint, monkeypatch):
    from core.storage.fsspec import FsspecStore

    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
                                 tier1_url=f"memory://t1-s3-{os.getpid()}-{id(db_url)}")
    files = save_milestone(settings)
    shutil.rmtree(tier0_dir(settings, RUN, 100))
    real_open = FsspecStore.open_read
    removed = []

    def vanishing(self, key):
        if not removed and key != MARKER_KEY:  # Tier 1 was chosen; before its first byte is read, the copy goes
            removed.append(key)
            self.fs.rm(self._p(key.rsplit("/", 1)[0].split("/optim")[0]), recursive=True)
        return real_open(self, key)

    monkeypatch.setattr(FsspecStore, "open_read", vanishing)

    point = resume(settings, RUN)

    assert removed and point.path == str(tier0_dir(settings, RUN, 100)) and tree(point.path) == files
    assert [(p.tier, p.source) for p in point.parts] == [(2, "fetched")]
    states = replica_states(settings, RUN, 100)
    assert (states[(0, 0)], states[(1, 0)]) == ("verified", "missing")
    assert not [p for p in Path(point.path).rglob("*") if ".ckpt-staging-" in p.name]


KILLED_MID_FETCH = """
import os, signal
from core.storage.local import LocalStore
real = LocalStore.put_verified
def put(self, key, reader, size, crc):
    info = real(self, key, reader, size, crc)
    if not key.endswith(".json"):
        os.kill(os.getpid(), signal.SIGKILL)  # one file published, the part not committed
    return info
LocalStore.put_verified = put
from core.settings import load_settings
from tasks.resume import resume
resume(load_settings(), %r)
"""


def kill_mid_fetch(settings, s3_endpoint: str, *, lease_s: float) -> None:
    """A resume on node-9 (its Tier 0 set up as its agent would), in its own process, killed
    once the fetch has written one file."""
    on_node(settings, "node-9")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CKPT_DATA_DIR": str(settings.data_dir), "CKPT_NODE": "node-9", "CKPT_CATALOG_URL": settings.catalog_url,
           "CKPT_TIER2_URL": settings.tier2_url, "CKPT_S3_ENDPOINT_URL": s3_endpoint,
           "CKPT_CLAIM_LEASE_SECONDS": str(lease_s)}
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_FETCH % RUN], env=env, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[3]), capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_a_resume_killed_mid_fetch_leaves_nothing_committed_and_the_restarted_one_completes(
        settings_factory, db_url, s3_bucket, s3_endpoint):
    """The fetch (here: the Tier 1 rehydration) is killed once one file was written and read
    back: the destination holds none of the part's files under their names (they wait in a
    hidden stage beside it), and the restarted resume, once it holds the dead fetch's claim,
    removes that stage and publishes the part whole."""
    from core.layout import is_staging

    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
                                 claim_lease_seconds=2.0)
    files = save_milestone(settings)
    lose_tier1(settings)
    node9 = on_node(settings, "node-9")
    kill_mid_fetch(settings, s3_endpoint, lease_s=2)

    folder = tier1_dir(settings, RUN, 100)
    assert [rel for rel in [*FILES, "manifest.json"] if (folder / rel).exists()] == []  # absent, not partial
    stages = [p for p in folder.parent.iterdir() if is_staging(p.name)]
    assert len(stages) == 1 and tree(stages[0])  # killed mid-fetch: files were in, beside the destination,
    assert not (stages[0] / "manifest.json").exists()  # and the part was not complete
    assert replica_states(settings, RUN, 100)[(1, 0)] == "copying"  # the dead worker's claim

    point = resume(node9, RUN)  # restarted at once: waits out the dead claim's lease, takes it over

    assert point.path == str(folder) and tree(folder) == files and (folder / "manifest.json").is_file()
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert not [p for p in folder.parent.rglob("*") if is_staging(p.name)]  # the dead fetch's stage is gone


def test_reconcile_removes_the_stage_a_killed_fetch_left_once_no_claim_holds_it(
        settings_factory, db_url, s3_bucket, s3_endpoint):
    """A resume killed mid-fetch whose part nobody fetches again: reconcile leaves the stage
    while the dead fetch's claim is live (it cannot tell a dead writer from a slow one), and
    removes it, audited, once the claim has lapsed (and the stalled copy is finished the way
    reconcile finishes any: copied again, whole, from the copy that holds it)."""
    from core.layout import is_staging
    from flows.common import plain_steps
    from flows.reconcile import reconcile_once
    from tests.kit.checkpoints import expire_claims

    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
                                 claim_lease_seconds=600.0)
    files = save_milestone(settings)
    lose_tier1(settings)
    kill_mid_fetch(settings, s3_endpoint, lease_s=600)
    folder = tier1_dir(settings, RUN, 100)

    def stages() -> list[Path]:
        return [p for p in folder.parent.iterdir() if is_staging(p.name)]

    assert len(stages()) == 1
    reconcile_once(settings, steps=plain_steps(), actor="test")
    assert len(stages()) == 1  # the claim is live: its writer may be at work
    assert replica_states(settings, RUN, 100)[(1, 0)] == "copying"

    assert expire_claims(settings) >= 1  # as if a lease had passed
    report = reconcile_once(settings, steps=plain_steps(), actor="test")

    assert stages() == []
    assert any("stage folder(s)" in line for line in report.recovered), report.recovered
    assert tree(folder) == files and replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    with open_catalog(settings) as cat:
        assert any(e.action == "delete" and "stage folder" in (e.reason or "")
                   for e in cat.audit_log(run=RUN)), "the removal is recorded before it happens"


def save_two_part_milestone(nodes) -> None:
    """A two-part milestone saved on ``nodes`` (part 0's node, part 1's) and promoted to every tier."""
    from db.catalog import Catalog
    from tests.kit.checkpoints import write_checkpoint

    for part, s in enumerate(nodes):
        write_checkpoint(s.tier0_url, RUN, 100, part=part, parts=2, node=s.node, kind="milestone",
                         shard_bytes=32 << 10)
        with Catalog(s.catalog_url) as cat:
            cat.ensure_run(RUN, actor="test")
        promote(s, RUN, 100, part, 2)


def tier1_lost_part1(settings) -> tuple[object, Path, list[str]]:
    """That milestone (part 1 saved on node-1), then Tier 1 loses part 1 alone, and the catalog
    knows: part 0's files stay in the folder. Returns node-1's settings, the Tier 1 folder and
    part 1's files (manifest last)."""
    node1 = on_node(settings, "node-1")
    save_two_part_milestone((settings, node1))
    folder = tier1_dir(settings, RUN, 100)
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        mine = [*sorted(f.path for f in cat.files(ck.id, 1)), "manifest.part-00001-of-00002.json"]
        for rel in mine:
            (folder / rel).unlink()
        rep = next(r for r in cat.replicas(ck.id, 1) if r.part == 1)
        cat.transition(rep.id, "missing", expected="verified", actor="test", reason="test: tier 1 lost part 1")
    return node1, folder, mine


def test_a_part_rehydrated_beside_another_parts_files_is_linked_in_manifest_last(
        settings_factory, db_url, s3_bucket, s3_endpoint, monkeypatch):
    """Tier 1 lost part 1 of a two-part milestone but still holds part 0 in the same folder: the
    part, staged whole, cannot be renamed onto that folder, so its files are linked in beside
    part 0's (never replacing one), its manifest last; part 0's files are left as they were."""
    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)
    node1, folder, mine = tier1_lost_part1(settings)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()}
    real_link, linked = os.link, []

    def link(src, dst, **kw):  # the real link, its order noted
        real_link(src, dst, **kw)
        if Path(dst).parent == folder:
            linked.append(Path(dst).name)

    monkeypatch.setattr(os, "link", link)

    point = resume(on_node(settings, "node-7"), RUN, part=1, parts=2)

    assert point.path == str(folder) and [(p.tier, p.source) for p in point.parts] == [(2, "fetched")]
    for rel in mine:
        assert (folder / rel).read_bytes() == (tier0_dir(node1, RUN, 100) / rel).read_bytes()
    assert {n: (p.stat().st_ino, p.read_bytes()) for n in before if (p := folder / n)} == before
    assert sorted(linked) == sorted(mine) and linked[-1] == mine[-1]  # the part's commit marker last
    assert replica_states(settings, RUN, 100)[(1, 1)] == "verified"
    assert not [p for p in folder.parent.rglob("*") if ".ckpt-staging-" in p.name]


def test_a_link_in_that_fails_midway_takes_back_what_it_linked(settings_factory, db_url, s3_bucket, s3_endpoint,
                                                                 monkeypatch):
    """The link-in of a rehydrated part fails at its second file (a full or read-only folder,
    say): the file already linked in is taken back, part 0's files stay as they were, nothing of
    part 1 is left under its names, the claim is released, and this resume goes on from Tier 2
    into its own folder (Tier 1 not rehydrated); the next resume publishes it whole."""
    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)
    node1, folder, mine = tier1_lost_part1(settings)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()}
    real_link, calls = os.link, []

    def link(src, dst, **kw):
        if Path(dst).parent == folder:
            calls.append(Path(dst).name)
            if len(calls) == 2:
                raise OSError(28, "No space left on device", str(dst))
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    node7 = on_node(settings, "node-7")

    first = resume(node7, RUN, part=1, parts=2)

    assert first.path != str(folder) and [(p.tier, p.source) for p in first.parts] == [(2, "fetched")]
    for rel in mine:
        assert (Path(first.path) / rel).read_bytes() == (tier0_dir(node1, RUN, 100) / rel).read_bytes()
    assert len(calls) == 2 and calls[0] in mine  # one file was linked in before the failure
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()} == before
    assert not [p for p in folder.parent.rglob("*") if ".ckpt-staging-" in p.name]
    assert replica_states(settings, RUN, 100)[(1, 1)] != "verified"

    monkeypatch.setattr(os, "link", real_link)
    point = resume(node7, RUN, part=1, parts=2)
    assert point.path == str(folder)
    for rel in mine:
        assert (folder / rel).read_bytes() == (tier0_dir(node1, RUN, 100) / rel).read_bytes()
    assert replica_states(settings, RUN, 100)[(1, 1)] == "verified"


@pytest.mark.parametrize("into", ["tier1", "folder"])
def test_the_manifest_is_read_while_the_files_stream_not_before(settings_factory, db_url, s3_bucket, s3_endpoint,
                                                                 monkeypatch, tmp_path, into):
    """On S3 every request waits ~0.1 s for its first byte: a fetch asks for the part's files (the
    catalog lists them) and its manifest at once, not one after the other. Here the manifest's
    GET is held until a file's GET has begun: a fetch that waited for the manifest first would
    never begin one. Into Tier 1 (the rehydration) and into a folder of the user's."""
    import threading

    from core.storage.s3.store import S3Store

    settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)
    files = save_milestone(settings)
    lose_tier1(settings)
    if into == "folder":  # a node that reads Tier 2 alone
        settings = settings.model_copy(update={"tier1_url": None})
    data_begun, order = threading.Event(), []
    real_small, real_read = S3Store.read_small, S3Store.open_read

    def read_small(self, key, *a, **kw):
        if key.endswith(".json") and "step-" in key:
            order.append(("manifest asked", data_begun.is_set()))
            assert data_begun.wait(60), "the manifest was asked for alone: no file's GET began meanwhile"
        return real_small(self, key, *a, **kw)

    def open_read(self, key):
        if not key.endswith(".json"):
            data_begun.set()
        return real_read(self, key)

    monkeypatch.setattr(S3Store, "read_small", read_small)
    monkeypatch.setattr(S3Store, "open_read", open_read)

    point = resume(on_node(settings, "node-5"), RUN, to=tmp_path / "out" if into == "folder" else None)

    assert order and tree(point.path) == files
    assert [(p.tier, p.source) for p in point.parts] == [(2, "fetched")]


def ranged_settings(settings_factory, db_url, s3_bucket, proxy):
    return scenario_settings(settings_factory, db_url, s3_endpoint=proxy.url, s3_bucket=s3_bucket,
                             s3_range_bytes=64 * 1024, s3_ranged_threshold=128 * 1024)


def test_large_objects_come_as_parallel_ranged_gets_checked_as_a_whole(settings_factory, db_url, s3_bucket, proxy):
    settings = ranged_settings(settings_factory, db_url, s3_bucket, proxy)
    files = save_milestone(settings)
    lose_tier1(settings)
    proxy.seen.clear()

    point = resume(on_node(settings, "node-x"), RUN)

    assert point.path == str(tier1_dir(settings, RUN, 100)) and tree(point.path) == files
    _, stored = stored_key(settings, RUN, 100, "model-00001.bin")  # a file this large is shared: its content
    gets = [r for r in proxy.seen if r.method == "GET" and r.key.endswith(stored)]
    # 200,000 bytes in ranges of about 64 KiB: three equal ranges, no small tail
    assert sorted(r.headers.get("range") for r in gets) == [
        "bytes=0-66666", "bytes=133334-199999", "bytes=66667-133333"]
    small = [r for r in proxy.seen if r.method == "GET" and r.key.endswith("optim/state.bin")]
    assert [r.headers.get("range") for r in small] == [None]  # below the threshold: one GET


def test_a_bad_object_fetched_in_ranges_publishes_nothing(settings_factory, db_url, s3_bucket, proxy):
    from core.errors import NotFound
    from tests.kit.s3 import corrupt_s3_object

    settings = ranged_settings(settings_factory, db_url, s3_bucket, proxy)
    save_milestone(settings)
    lose_tier1(settings)
    corrupt_s3_object(settings, RUN, 100, "model-00001.bin")

    with pytest.raises(NotFound, match="no checkpoint has a good copy"):
        resume(on_node(settings, "node-x"), RUN)

    folder = tier1_dir(settings, RUN, 100)
    assert replica_states(settings, RUN, 100)[(2, 0)] == "corrupt"
    assert not (folder / "manifest.json").exists() and not (folder / "model-00001.bin").exists()
    assert not [p for p in folder.rglob("*") if ".ckpt-staging-" in p.name]


@pytest.mark.parametrize("into", ["tier0", "folder"])
def test_a_full_tier1_is_not_rehydrated_and_the_resume_fetches_from_tier2(settings_factory, db_url, s3_bucket,
                                                                           s3_endpoint, tmp_path, into, caplog):
    """The newest checkpoint's only copy is on Tier 2 and Tier 1 (a real small tmpfs) is full:
    the rehydration fails for want of room, which is "not rehydrated", not the resume's end.
    The node fetches into its own Tier 0 (or ``to``), the operator gets a warning and
    ``ckpt.resume.rehydrate_failed``, and nothing partial is left on Tier 1."""
    from core import events
    from core.layout import is_staging
    from tests.kit.pipeline import Recorder
    from tests.kit.tmpfs import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "lustre", "1m") as tier1:
        settings = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
                                     tier1_url=str(tier1))
        files = save_milestone(settings)
        lose_tier1(settings)
        shutil.rmtree(tier0_dir(settings, RUN, 100))  # a cold node, and the catalog knows it
        with open_catalog(settings) as cat:
            rep = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id, 0))
            cat.transition(rep.id, "missing", expected="verified", actor="test", reason="test: node replaced")
        filler = tier1 / "filler"
        with filler.open("wb") as f:  # another job took Tier 1's room
            f.write(os.urandom((1 << 20) - 64 * 1024))
        dest = tmp_path / "mine" if into == "folder" else None
        rec = Recorder()

        with events.announcing(rec):
            point = resume(settings, RUN, to=dest)

        where = dest if dest is not None else tier0_dir(settings, RUN, 100)
        assert point.step == 100 and point.path == str(where) and tree(where) == files
        assert [(p.tier, p.source) for p in point.parts] == [(2, "fetched")]
        assert rec.seen == [(events.REHYDRATE_FAILED, RUN, 100, 0, "tier1")] + \
            ([(events.VERIFIED, RUN, 100, 0, "tier0")] if into == "tier0" else [])
        assert any("not rehydrated" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
        states = replica_states(settings, RUN, 100)
        assert states[(1, 0)] == "missing" and states[(2, 0)] == "verified"
        assert (states.get((0, 0)) == "verified") == (into == "tier0")
        assert not (tier1 / RUN / "step-00000100").exists()
        assert not [p for p in (tier1 / RUN).iterdir() if is_staging(p.name)]
