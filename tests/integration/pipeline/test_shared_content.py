"""Each byte stored once on Tier 1 (``core.storage.content``), through the real promotion and
retention (plain functions, real tiers, a real catalog on SQLite and PostgreSQL).

What a user checks: a fine-tune whose base does not change holds the base once on Tier 1 however
many checkpoints it saves, and each checkpoint folder still loads in place; retiring checkpoints
keeps the bytes the kept ones link and frees the rest; a stored copy whose bytes differ from
the source (rot, or a CRC32C collision) is never linked into a new checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.dedup import tier1_bytes  # what the benchmark counts: each inode once
from core.layout import checkpoint_prefix
from core.settings import RetentionPolicy
from core.storage.content import CONTENT_DIR
from core.storage.local import LocalStore
from core.transfer import read_committed, verify_part
from db.catalog import Catalog
from tests.kit.checkpoints import flip_bit
from tests.kit.restore import commit_folder, promote, scenario_settings, tier1_dir

RUN = "run-ft"
BASE = os.urandom(1 << 20)  # the frozen base: the same bytes in every checkpoint


def save(settings, step: int, base: bytes = BASE) -> bytes:
    adapter = os.urandom(64 << 10)
    commit_folder(settings, RUN, step, {"base.bin": base, "adapter.bin": adapter})
    assert promote(settings, RUN, step).durable
    return adapter


def verify_tier1(settings, step: int) -> None:
    store = LocalStore(settings.tier1_url, 1)
    prefix = checkpoint_prefix(RUN, step)
    verify_part(store, prefix, read_committed(store, RUN, step))


def test_a_frozen_base_is_held_once_on_tier1_and_every_checkpoint_loads_in_place(settings_factory, db_url):
    settings = scenario_settings(settings_factory, db_url)
    adapters = {step: save(settings, step) for step in (100, 200, 300, 400)}

    root = Path(settings.tier1_url)
    manifests = sum((tier1_dir(settings, RUN, s) / "manifest.json").stat().st_size for s in adapters)
    assert tier1_bytes(root) <= len(BASE) + sum(map(len, adapters.values())) + manifests + 4096  # + identity marker
    bases = {(tier1_dir(settings, RUN, s) / "base.bin").stat().st_ino for s in adapters}
    assert len(bases) == 1
    for step, adapter in adapters.items():  # the folder is a plain folder: read in place, whole
        folder = tier1_dir(settings, RUN, step)
        assert (folder / "base.bin").read_bytes() == BASE
        assert (folder / "adapter.bin").read_bytes() == adapter
        verify_tier1(settings, step)
    with Catalog(settings.catalog_url) as cat:  # the catalog counts what the tiers hold
        assert cat.stored_bytes(1) == len(BASE) + sum(map(len, adapters.values()))
        assert cat.stored_bytes(0) == len(adapters) * len(BASE) + sum(map(len, adapters.values()))
        tier1 = {h.tier: h for h in cat.tier_holdings()}[1]  # what ckpt tiers shows: logical and stored
        assert (tier1.checkpoints, tier1.stored_bytes) == (len(adapters), cat.stored_bytes(1))
        assert tier1.logical_bytes >= len(adapters) * len(BASE) > tier1.stored_bytes


def test_retiring_checkpoints_keeps_what_the_kept_ones_link_and_frees_the_rest(settings_factory, db_url):
    settings = scenario_settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1),
                                 retention_tier1=RetentionPolicy(keep_last=2))
    adapters = {step: save(settings, step) for step in (100, 200, 300, 400)}

    assert not tier1_dir(settings, RUN, 100).exists() and not tier1_dir(settings, RUN, 200).exists()
    for step in (300, 400):
        assert (tier1_dir(settings, RUN, step) / "base.bin").read_bytes() == BASE
        verify_tier1(settings, step)
    root = Path(settings.tier1_url)
    manifests = sum((tier1_dir(settings, RUN, s) / "manifest.json").stat().st_size for s in (300, 400))
    # the retired adapters are gone from the content store too, the base stays once
    assert tier1_bytes(root) <= len(BASE) + len(adapters[300]) + len(adapters[400]) + manifests + 4096
    stored = sorted(p.stat().st_size for p in (root / CONTENT_DIR).rglob("*") if p.is_file())
    assert stored == sorted([len(BASE), len(adapters[300]), len(adapters[400])])
    with Catalog(settings.catalog_url) as cat:
        assert cat.stored_bytes(1) == sum(stored)


def test_a_stored_copy_that_differs_from_the_source_is_never_linked(settings_factory, db_url):
    settings = scenario_settings(settings_factory, db_url)
    save(settings, 100)
    rotten = tier1_dir(settings, RUN, 100) / "base.bin"
    flip_bit(rotten)  # the stored content rots: same name (size, CRC32C), other bytes

    save(settings, 200)

    fresh = tier1_dir(settings, RUN, 200) / "base.bin"
    assert fresh.read_bytes() == BASE and fresh.stat().st_ino != rotten.stat().st_ino
    verify_tier1(settings, 200)
    save(settings, 300)  # the fresh copy is the stored content now: shared again
    assert (tier1_dir(settings, RUN, 300) / "base.bin").stat().st_ino == fresh.stat().st_ino


def test_a_rotten_shared_file_is_reported_in_every_checkpoint_and_written_once_to_repair(settings_factory, db_url):
    from tasks.scrub import scrub

    settings = scenario_settings(settings_factory, db_url)
    for step in (100, 200, 300):
        save(settings, step)
    flip_bit(tier1_dir(settings, RUN, 200) / "base.bin")  # one inode, three checkpoints

    report = scrub(settings, fraction=1.0)

    assert sorted((b.step, b.tier, b.state) for b in report.bad) == [(s, 1, "corrupt") for s in (100, 200, 300)]
    assert all("base.bin" in b.reason for b in report.bad)
    assert sorted((r.step, r.ok) for r in report.repairs) == [(100, True), (200, True), (300, True)]
    repaired = {(tier1_dir(settings, RUN, s) / "base.bin").stat().st_ino for s in (100, 200, 300)}
    assert len(repaired) == 1  # the repair wrote the base once; the others link that copy
    for step in (100, 200, 300):
        assert (tier1_dir(settings, RUN, step) / "base.bin").read_bytes() == BASE
    assert scrub(settings, fraction=1.0).bad == []


def test_a_stagers_frozen_tensors_get_shards_of_their_own_that_tier1_holds_once(settings_factory, db_url):
    import numpy as np

    from ckpt.client import CheckpointStager
    from tests.kit.pipeline import pipeline_settings

    settings = pipeline_settings(settings_factory, db_url, runs=(RUN,))
    rng = np.random.default_rng(0)
    base = {f"base.{i}": rng.standard_normal(64 << 10, dtype=np.float32) for i in range(3)}

    def tensors() -> dict:  # the adapter between the base's layers, as a model's state names them
        out = dict(base)
        out["base.1.lora"] = rng.standard_normal(4 << 10, dtype=np.float32)
        return dict(sorted(out.items()))

    def shards(step: int) -> dict[str, tuple[int, str]]:
        return {f.path: (f.size, f.checksum) for f in saved[step].manifest.files if f.path.endswith(".safetensors")}

    with CheckpointStager(RUN, settings=settings, announce=False, shard_bytes=4 << 20, frozen=base) as stager:
        saved = {step: stager.save(step, tensors()) for step in (100, 200)}
    for step in (100, 200):
        assert promote(settings, RUN, step).durable

    same = set(shards(100).items()) & set(shards(200).items())
    assert len(same) == 1  # the base's shard, byte for byte
    (path, _), = same
    assert (tier1_dir(settings, RUN, 100) / path).stat().st_ino == (tier1_dir(settings, RUN, 200) / path).stat().st_ino
    with CheckpointStager(RUN, settings=settings, announce=False, shard_bytes=4 << 20) as relaunched:  # no frozen=
        saved.update({step: relaunched.save(step, tensors()) for step in (300, 400)})
    for step in (300, 400):  # it finds the base from its first save on (against Tier 0's step 200): the same file
        assert set(shards(step).items()) & set(shards(100).items()) == same


def test_a_fine_tune_saved_without_naming_its_base_holds_the_base_once_from_the_second_save_on(settings_factory,
                                                                                               db_url):
    import numpy as np
    from safetensors.numpy import load_file

    from ckpt.client import CheckpointStager
    from tests.kit.pipeline import pipeline_settings

    settings = pipeline_settings(settings_factory, db_url, runs=(RUN,))
    rng = np.random.default_rng(1)
    base = {f"base.{i}": rng.standard_normal(64 << 10, dtype=np.float32) for i in range(4)}  # 1 MiB
    given: dict[int, dict] = {}
    with CheckpointStager(RUN, settings=settings, announce=False, shard_bytes=4 << 20) as stager:  # no frozen=
        for step in (100, 200, 300, 400):
            given[step] = dict(sorted({**base, "base.1.lora": rng.standard_normal(4 << 10, dtype=np.float32)}.items()))
            stager.save(step, given[step])
            assert promote(settings, RUN, step).durable

    root = Path(settings.tier1_url)
    base_bytes = sum(a.nbytes for a in base.values())
    adapters = 4 * (16 << 10)
    folders = {step: tier1_dir(settings, RUN, step) for step in given}
    small = sum(f.stat().st_size for d in folders.values() for f in d.iterdir() if not f.name.endswith(".safetensors"))
    headers = 4 * 2 * 4096  # at most two shards a save, each header well under 4 KiB
    # the first save mixed the base with its adapter; from the second on the base is one file, linked
    assert tier1_bytes(root) <= 2 * base_bytes + adapters + small + headers + 4096  # + identity marker
    for step, tensors in given.items():  # each checkpoint loads in place, whole and equal
        loaded: dict = {}
        for f in folders[step].glob("*.safetensors"):
            loaded.update(load_file(str(f)))
        assert set(loaded) == set(tensors) and all(np.array_equal(loaded[k], v) for k, v in tensors.items())
        verify_tier1(settings, step)


def test_a_prune_drops_the_contents_its_own_files_linked_and_the_periodic_sweep_the_rest(settings_factory, db_url):
    import shutil

    from tasks.contents import sweep_shared_contents

    settings = scenario_settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1),
                                 retention_tier1=RetentionPolicy(keep_last=2))
    root = Path(settings.tier1_url)
    other = {"weights.bin": os.urandom(96 << 10)}
    commit_folder(settings, "run-other", 100, other)
    assert promote(settings, "run-other", 100).durable
    shutil.rmtree(root / checkpoint_prefix("run-other", 100))  # deleted by hand: its content name links nothing
    orphan = {p for p in (root / CONTENT_DIR).rglob("*") if p.is_file()}
    assert [p.stat().st_nlink for p in orphan] == [1]

    adapters = {step: save(settings, step) for step in (100, 200, 300, 400)}  # 100 and 200 pruned on the way

    stored = {p for p in (root / CONTENT_DIR).rglob("*") if p.is_file()}
    # the prunes dropped the retired adapters' names, and read no other: the orphan is the periodic pass's
    assert sorted(p.stat().st_size for p in stored - orphan) == sorted(
        [len(BASE), len(adapters[300]), len(adapters[400])])
    assert orphan <= stored
    assert sweep_shared_contents(settings, actor="test") == 1
    assert {p for p in (root / CONTENT_DIR).rglob("*") if p.is_file()} == stored - orphan
    for step in (300, 400):
        verify_tier1(settings, step)
    with Catalog(settings.catalog_url) as cat:
        assert any(a.subject == "contents@tier1" for a in cat.audit_log())


def test_a_copy_from_a_stream_links_the_stored_content_and_never_replaces_a_good_one(tmp_path):
    """Tier 2 rehydrating Tier 1 (or a restore into it) reads a body, not a local file: once written and
    verified, its bytes are compared with the stored content's, which is linked when they are equal; a
    stored content whose bytes differ (rot) is replaced, and the copy never linked to it."""
    import io

    from core.checksum import hash_bytes

    store = LocalStore(tmp_path, 1, shared_content=True)
    crc = hash_bytes(BASE)
    store.put_verified("run/step-00000100/base.bin", io.BytesIO(BASE), len(BASE), crc)
    held = (tmp_path / "run/step-00000100/base.bin").stat().st_ino

    def ranged(fd: int) -> tuple[int, str]:  # parallel ranged reads, each written at its offset
        for at in range(0, len(BASE), 256 << 10):
            os.pwrite(fd, BASE[at:at + (256 << 10)], at)
        return len(BASE), crc

    store.put_verified("run/step-00000200/base.bin", io.BytesIO(BASE), len(BASE), crc)  # streamed
    store.put_written("run/step-00000300/base.bin", ranged, len(BASE), crc)
    copies = [tmp_path / f"run/step-00000{s}00/base.bin" for s in (1, 2, 3)]
    assert {p.stat().st_ino for p in copies} == {held}  # the tier holds the base once
    assert tier1_bytes(tmp_path) == len(BASE)

    flip_bit(copies[0])  # the stored content rots
    store.put_verified("run/step-00000400/base.bin", io.BytesIO(BASE), len(BASE), crc)
    fresh = tmp_path / "run/step-00000400/base.bin"
    assert fresh.read_bytes() == BASE and fresh.stat().st_ino != held
    store.put_written("run/step-00000500/base.bin", ranged, len(BASE), crc)  # the fresh copy is the content now
    assert (tmp_path / "run/step-00000500/base.bin").stat().st_ino == fresh.stat().st_ino


def test_two_copies_written_at_once_keep_the_first_stored_content_and_replace_only_a_rotten_one(tmp_path):
    """Two copies of the same bytes that each found no stored content (written at once, by two nodes)
    both offer their file as the content: the first stays, so later copies link the bytes every
    earlier one links; only a stored content whose bytes differ is replaced."""
    from core.checksum import hash_bytes
    from core.storage.content import ContentStore

    content, crc = ContentStore(tmp_path, 1 << 20), hash_bytes(BASE)
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(BASE)
    second.write_bytes(BASE)
    content.remember(first, len(BASE), crc)
    content.remember(second, len(BASE), crc)
    assert content.entry(len(BASE), crc).stat().st_ino == first.stat().st_ino

    flip_bit(first)
    content.remember(second, len(BASE), crc)
    assert content.entry(len(BASE), crc).stat().st_ino == second.stat().st_ino
