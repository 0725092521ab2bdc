"""The training-side client commits checkpoints on Tier 0 that the pipeline can trust."""

from __future__ import annotations

import json
import os
import time
from itertools import pairwise

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ckpt.client import CheckpointStager
from core import checksum, formats
from core.errors import BadInput, ConflictError, PathEscape
from core.manifest import Manifest, ParentRef


def _tensors(seed: int = 0, n: int = 6, size: int = 64 * 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(size, dtype=np.float32) for i in range(n)}


def _stager(settings, **kw) -> CheckpointStager:
    # announce=False: no catalog, no Prefect server in unit tests (integration covers them)
    kw.setdefault("announce", False)
    kw.setdefault("shard_bytes", 512 * 1024)
    return CheckpointStager("run-a", settings=settings, **kw)


def _load_all(folder, manifest: Manifest) -> dict[str, np.ndarray]:
    out = {}
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            out.update(load_file(str(folder / f.path)))
    return out


def _validate_on_disk(folder, manifest: Manifest) -> None:
    """What the promote flow will check: every file's size and CRC32C, and the format."""
    for f in manifest.files:
        assert checksum.hash_file(folder / f.path) == (f.size, f.checksum), f.path
    sizes = {f.path: f.size for f in manifest.files}
    formats.validate(manifest.format, sizes, lambda r: open(folder / r, "rb"),  # noqa: SIM115 - validate closes it
                     complete=manifest.parts == 1)


def test_save_commits_sharded_safetensors_with_manifest(settings_factory):
    s = settings_factory()
    tensors = _tensors()
    with _stager(s) as st:
        saved = st.save(100, tensors, metrics={"loss": 1.25})
    folder = saved.path
    assert folder.as_posix().endswith("tier0/node-0/run-a/step-00000100")
    m = Manifest.from_json((folder / "manifest.json").read_bytes())
    assert m == saved.manifest
    assert m.format == "hf-sharded" and m.kind == "step" and m.metrics == {"loss": 1.25}
    assert sum(f.path.endswith(".safetensors") for f in m.files) == 3  # 1.5 MiB in 512 KiB shards
    assert m.writer_stall_seconds > 0 and m.node == "node-0"
    _validate_on_disk(folder, m)
    loaded = _load_all(folder, m)
    assert set(loaded) == set(tensors)
    assert all(np.array_equal(loaded[k], tensors[k]) for k in tensors)
    # nothing but the committed folder is left on Tier 0
    assert os.listdir(folder.parent) == ["step-00000100"]


def test_save_again_same_bytes_is_harmless_different_bytes_refused(settings_factory):
    s = settings_factory()
    with _stager(s) as st:
        first = st.save(5, _tensors(1))
        again = st.save(5, _tensors(1))
        assert again.manifest.digest() == first.manifest.digest()
        with pytest.raises(ConflictError):
            st.save(5, _tensors(2))
    m = Manifest.from_json((first.path / "manifest.json").read_bytes())
    assert m.digest() == first.manifest.digest()
    _validate_on_disk(first.path, m)
    assert os.listdir(first.path.parent) == ["step-00000005"]  # no staging leftovers


def test_adopts_a_folder_a_framework_wrote(settings_factory, tmp_path):
    s = settings_factory()
    src = tmp_path / "hf-out"
    src.mkdir()
    t = _tensors(3, n=4)
    save_file({k: t[k] for k in list(t)[:2]}, str(src / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in list(t)[2:]}, str(src / "model-00002-of-00002.safetensors"))
    wm = {k: f"model-0000{1 + i // 2}-of-00002.safetensors" for i, k in enumerate(t)}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with _stager(s) as st:
        saved = st.save(7, src, epoch_end=True)
    assert not src.exists()  # renamed, not copied
    m = saved.manifest
    assert m.format == "hf-sharded" and m.kind == "epoch" and len(m.files) == 3
    _validate_on_disk(saved.path, m)


def test_adopting_a_folder_with_a_symlink_is_refused(settings_factory, tmp_path):
    s = settings_factory()
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(b"x")
    (src / "__0_0.distcp").symlink_to("/etc/hostname")
    with _stager(s) as st, pytest.raises(PathEscape):
        st.save(1, src)
    assert not (s.data_dir / "tier0" / "node-0" / "run-a" / "step-00000001").exists()


def test_background_mode_snapshots_so_training_may_change_tensors(settings_factory):
    s = settings_factory()
    tensors = _tensors(4)
    expected = {k: v.copy() for k, v in tensors.items()}
    with _stager(s, background=True) as st:
        pending = st.save(9, tensors, milestone=True)
        for v in tensors.values():  # the training step right after save()
            v *= 0
        saved = pending.result(timeout=30)
        # the next save reuses the finished write's snapshot buffers: both checkpoints intact
        for v in tensors.values():
            v += 7
        second = st.save(10, tensors).result(timeout=30)
    assert saved.manifest.kind == "milestone"
    assert saved.manifest.writer_stall_seconds == pytest.approx(pending.stall_seconds, abs=1e-5)
    loaded = _load_all(saved.path, saved.manifest)
    assert all(np.array_equal(loaded[k], expected[k]) for k in expected)
    loaded2 = _load_all(second.path, second.manifest)
    assert all(np.array_equal(loaded2[k], expected[k] * 0 + 7) for k in expected)
    _validate_on_disk(second.path, second.manifest)


def test_background_write_errors_surface_on_wait(settings_factory):
    s = settings_factory()
    st = _stager(s, background=True)
    st.save(1, _tensors())
    st.wait()
    bad = {"x": np.zeros(3, dtype=np.complex64)}  # no safetensors dtype
    with pytest.raises(BadInput):
        st.save(2, bad)  # rejected at snapshot time, in the caller
    st.save(1, _tensors(seed=99))  # same step, other bytes: the write thread refuses it
    try:
        with pytest.raises(ConflictError):
            st.wait(timeout=30)
        st.save(2, _tensors())  # and the stager keeps working afterwards
        st.wait(timeout=30)
    finally:
        st.close()
    assert sorted(os.listdir(st.root / "run-a")) == ["step-00000001", "step-00000002"]


def test_background_stall_is_shorter_than_a_foreground_save(settings_factory):
    """The point of background mode: training waits for a memory copy, not for the disk."""
    s = settings_factory()
    tensors = _tensors(5, n=8, size=2 * 1024 * 1024)  # 64 MiB
    fg, bg = [], []
    with _stager(s, shard_bytes=16 << 20) as st:
        fg.extend(st.save(step, tensors).stall_seconds for step in range(3))
    with _stager(s, shard_bytes=16 << 20, background=True) as st:
        for step in range(10, 13):
            p = st.save(step, tensors)
            bg.append(p.stall_seconds)
            p.result(timeout=60)
    assert min(bg) < min(fg), (bg, fg)


def test_the_run_origin_goes_into_every_manifest(settings_factory):
    """The origin travels with each checkpoint: a catalog rebuilt from the manifests has it,
    whether or not the job ever reached the catalog (announce=False here)."""
    s = settings_factory()
    with _stager(s, resumed_from=("run-0", 40)) as st:
        first = st.save(41, _tensors(n=1))
        second = st.save(42, _tensors(n=1))
        other = st.save(43, _tensors(n=1), parent=("run-x", 7))  # an explicit parent of this save
    assert first.manifest.parent == second.manifest.parent == ParentRef("run-0", 40, "resumed_from")
    assert other.manifest.parent == ParentRef("run-x", 7, "resumed_from")
    with _stager(s, branched_from=("run-0", 41)) as st:
        assert st.save(50, _tensors(n=1)).manifest.parent == ParentRef("run-0", 41, "branched_from")
    with pytest.raises(BadInput):
        CheckpointStager("r", settings=s, resumed_from=("a", 1), fine_tuned_from=("b", 2), announce=False)


def test_parts_of_one_checkpoint_share_a_folder(settings_factory):
    """Two parts written to the same Tier 0 root: side by side, one manifest each."""
    s = settings_factory()
    with _stager(s, part=0, parts=2) as a, _stager(s, part=1, parts=2, node="node-1") as b:
        pa = a.save(3, _tensors(6, n=2))
        pb = b.save(3, _tensors(7, n=2))
    assert pa.path == pb.path
    names = sorted(os.listdir(pa.path))
    assert names == ["manifest.part-00000-of-00002.json", "manifest.part-00001-of-00002.json",
                     "part-00000", "part-00001"]
    for saved in (pa, pb):
        m = Manifest.from_json((saved.path / saved.manifest.name).read_bytes())
        assert all(f.path.startswith(f"part-{m.part:05d}/") for f in m.files)
        _validate_on_disk(saved.path, m)
    assert pb.manifest.node == "node-1"


def test_unreachable_prefect_never_reaches_training(settings_factory, caplog):
    """Events to a port nothing listens on: save returns at local-commit speed, close returns,
    and the job is told where it tried and that the agent's reconcile promotes the checkpoint."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = settings_factory(prefect_api_url=f"http://127.0.0.1:{port}/api", catalog_url=f"sqlite:///{os.getcwd()}/nope/c.db")
    st = CheckpointStager("run-a", settings=s, shard_bytes=1 << 20)
    t0 = time.perf_counter()
    saved = st.save(1, _tensors(n=2))
    assert time.perf_counter() - t0 < 2.0
    st.close(timeout=20)
    assert st._announcer.delivered == [("run-a", 1, 0, False)]
    assert (saved.path / "manifest.json").is_file()
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("emit failed")]
    assert len(told) == 1, told
    assert f"http://127.0.0.1:{port}/api" in told[0] and "run-a step 1" in told[0]
    interval = s.reconcile_interval_seconds
    assert f"reconcile of node {s.node} promotes it within its interval ({interval} s)" in told[0]


@pytest.mark.parametrize("step", [-1, "12", 1.5, True])
def test_bad_step_is_refused(settings_factory, step):
    with _stager(settings_factory()) as st, pytest.raises(BadInput):
        st.save(step, _tensors(n=1))


def test_hostile_run_name_is_refused(settings_factory):
    with pytest.raises(PathEscape):
        CheckpointStager("../escape", settings=settings_factory(), announce=False)


# --- unchanged tensors: shards of their own, found by the stager ---------------------------------
def _shards(saved) -> dict[str, tuple[int, str]]:
    return {f.path: (f.size, f.checksum) for f in saved.manifest.files if f.path.endswith(".safetensors")}


def _weight_map(saved) -> dict[str, str]:
    return json.loads((saved.path / "model.safetensors.index.json").read_bytes())["weight_map"]


def _check_loads_back(saved, tensors: dict[str, np.ndarray]) -> None:
    _validate_on_disk(saved.path, saved.manifest)
    loaded = _load_all(saved.path, saved.manifest)
    assert set(loaded) == set(tensors)
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("background", [False, True])
def test_a_fine_tunes_unchanged_base_is_written_into_the_same_files_from_the_second_save_on(settings_factory,
                                                                                           background):
    rng = np.random.default_rng(5)
    base = {f"layers.{i}.weight": rng.standard_normal(64 << 10, dtype=np.float32) for i in range(4)}  # 1 MiB

    def tensors() -> dict[str, np.ndarray]:  # an adapter among the base's layers, as a model names them
        return dict(sorted({**base, "layers.0.lora": rng.standard_normal(4 << 10, dtype=np.float32)}.items()))

    with _stager(settings_factory(), background=background) as st:  # no frozen=
        saves, given = [], []
        for step in (100, 200, 300, 400):
            given.append(tensors())
            pending = st.save(step, given[-1])
            saves.append(pending.result(timeout=30) if background else pending)

    for saved, t in zip(saves, given, strict=True):
        _check_loads_back(saved, t)
    new_bytes = [sum(size for size, crc in _shards(now).values() if (size, crc) not in set(_shards(before).values()))
                 for before, now in pairwise(saves)]
    base_bytes = sum(a.nbytes for a in base.values())
    assert new_bytes[0] > base_bytes  # the first save could not know: the base mixed with the adapter
    assert all(n < base_bytes / 8 for n in new_bytes[1:]), new_bytes  # then only the adapter's shard is new
    shared = {path for path, f in _shards(saves[-1]).items() if f in set(_shards(saves[1]).values())}
    assert {name for name, path in _weight_map(saves[-1]).items() if path in shared} == set(base)


def test_a_pretraining_run_whose_every_tensor_changes_keeps_its_layout(settings_factory):
    from core.safetensors_writer import as_host_array, plan_shards

    with _stager(settings_factory()) as st:
        saves = [st.save(step, _tensors(seed=step)) for step in (1, 2, 3)]
    planned = plan_shards({k: as_host_array(v) for k, v in _tensors().items()}, 512 * 1024)
    for saved in saves:
        groups: dict[str, list[str]] = {}
        for name, path in _weight_map(saved).items():
            groups.setdefault(path, []).append(name)
        assert sorted(groups.values()) == sorted(planned)
        _check_loads_back(saved, _tensors(seed=saved.step))


def test_a_tensor_that_changes_again_leaves_the_unchanged_shards_and_loads_back(settings_factory):
    rng = np.random.default_rng(9)
    base, head = (rng.standard_normal(8 << 10, dtype=np.float32) for _ in range(2))

    def tensors(head_changes: bool) -> dict[str, np.ndarray]:
        nonlocal head
        if head_changes:
            head = head + 1
        return {"base": base, "head": head.copy(), "lora": rng.standard_normal(8 << 10, dtype=np.float32)}

    given = [tensors(False), tensors(False), tensors(True), tensors(False)]
    with _stager(settings_factory(), shard_bytes=1 << 20) as st:  # all three fit one shard
        saves = [st.save(step, t) for step, t in zip((1, 2, 3, 4), given, strict=True)]

    def with_head(saved) -> set[str]:
        wm = _weight_map(saved)
        return {name for name, path in wm.items() if path == wm["head"]}

    assert [with_head(s) for s in saves] == [{"base", "head", "lora"}, {"base", "head"}, {"head", "lora"},
                                             {"base", "head"}]
    for saved, t in zip(saves, given, strict=True):
        _check_loads_back(saved, t)


def test_after_a_restart_the_first_save_writes_the_unchanged_base_into_the_files_tier0_holds(settings_factory):
    s = settings_factory()
    rng = np.random.default_rng(3)
    base = {f"layers.{i}.weight": rng.standard_normal(64 << 10, dtype=np.float32) for i in range(4)}

    def tensors() -> dict[str, np.ndarray]:
        return dict(sorted({**base, "layers.0.lora": rng.standard_normal(4 << 10, dtype=np.float32)}.items()))

    with _stager(s) as first_launch:
        before = [first_launch.save(step, tensors()) for step in (100, 200)]
    with _stager(s) as relaunched:  # a new process: nothing in memory, the checkpoints on Tier 0
        t = tensors()
        after = relaunched.save(300, t)

    _check_loads_back(after, t)
    shared = {path for path, f in _shards(after).items() if f in set(_shards(before[-1]).values())}
    assert {name for name, path in _weight_map(after).items() if path in shared} == set(base)


def test_a_fine_tunes_save_repeated_with_the_same_tensors_is_the_same_checkpoint(settings_factory):
    rng = np.random.default_rng(4)
    base = {f"layers.{i}.weight": rng.standard_normal(64 << 10, dtype=np.float32) for i in range(2)}
    with _stager(settings_factory(), shard_bytes=1 << 20) as st:  # room for all in one shard
        st.save(100, {**base, "lora": rng.standard_normal(4 << 10, dtype=np.float32)})
        t = {**base, "lora": rng.standard_normal(4 << 10, dtype=np.float32)}
        first = st.save(200, t)  # the base apart
        again = st.save(200, t)  # a retry: every tensor equals the previous save's
    assert again.manifest.digest() == first.manifest.digest()
    _check_loads_back(again, t)
