"""``ckpt commit DIR``: a folder a job wrote becomes a committed, announced checkpoint part, with
a manifest that matches the documented schema (core/manifest.schema.json)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from ckpt.cli import app
from core import checksum, events
from core.manifest import Manifest
from tasks import prefect_events

SCHEMA = json.loads((Path(__file__).parents[2] / "core" / "manifest.schema.json").read_text())


def _job_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    save_file({"w": np.arange(1000, dtype=np.float32)}, str(path / "model.safetensors"))
    (path / "optimizer.pt").write_bytes(b"\x00" * 4096)
    return path


@pytest.fixture
def env(settings_factory, tmp_path, monkeypatch):
    settings = settings_factory()
    monkeypatch.setenv("CKPT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("CKPT_NODE", "node-0")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return settings


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def _manifest_doc(settings, run: str, step: int, name: str = "manifest.json") -> dict:
    return json.loads((settings.data_dir / "tier0" / "node-0" / run / f"step-{step:08d}" / name).read_text())


def test_commit_writes_a_schema_valid_manifest_under_the_layout_and_leaves_the_job_folder(env, tmp_path):
    job = _job_folder(tmp_path / "job" / "checkpoint-40")
    out = _cli("commit", str(job), "--run", "ext-run", "--step", "40", "--milestone", "--parent", "base:7",
               "--no-announce")
    doc = _manifest_doc(env, "ext-run", 40)
    jsonschema.validate(doc, SCHEMA)
    m = Manifest.from_json(json.dumps(doc))
    assert (m.kind, m.parent.run, m.parent.step, m.node) == ("milestone", "base", 7, "node-0")
    final = env.data_dir / "tier0" / "node-0" / "ext-run" / "step-00000040"
    for f in m.files:  # the recorded CRC32C is the bytes' own
        assert checksum.hash_file(final / f.path) == (f.size, f.checksum)
    assert sorted(p.name for p in job.iterdir()) == ["model.safetensors", "optimizer.pt"]  # untouched
    assert "committed ext-run step 40" in out and "announced" not in out


def test_every_manifest_the_client_writes_matches_the_schema(env):
    from ckpt.client import CheckpointStager

    with CheckpointStager("run-s", settings=env, part=1, parts=2, announce=False) as stager:
        saved = stager.save(3, {"w": np.ones(10, dtype=np.float32)}, metrics={"loss": 1.5}, epoch_end=True)
    jsonschema.validate(json.loads((saved.path / saved.manifest.name).read_text()), SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"run": "../x", "step": 1, "files": []}, SCHEMA)


def test_commit_announces_the_documented_event_body(env, tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(events, "post_events", lambda url, batch, **kw: sent.extend(batch))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    job = _job_folder(tmp_path / "job" / "step-5")
    assert "announced" in _cli("commit", str(job), "--run", "ext-run", "--step", "5", "--part", "1", "--parts", "2")
    (ev,) = sent
    assert ev["event"] == events.COMPLETED and ev["resource"]["ckpt.node"] == "node-0"
    assert ev["id"] == str(events.event_id(events.COMPLETED, "ext-run", 5, 1))
    assert {k: ev["payload"][k] for k in ("run", "step", "part", "parts", "manifest")} == {
        "run": "ext-run", "step": 5, "part": 1, "parts": 2, "manifest": "manifest.part-00001-of-00002.json"}
    jsonschema.validate(_manifest_doc(env, "ext-run", 5, "manifest.part-00001-of-00002.json"), SCHEMA)


def test_an_event_that_does_not_arrive_fails_the_command_but_keeps_the_commit(env, tmp_path, monkeypatch):
    def down(url, batch, **kw):
        raise ConnectionError("refused")

    monkeypatch.setattr(events, "post_events", down)
    monkeypatch.setattr(prefect_events.time, "sleep", lambda s: None)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    _cli("commit", str(_job_folder(tmp_path / "j")), "--run", "r", "--step", "1", code=1)
    assert _manifest_doc(env, "r", 1)["step"] == 1


@pytest.mark.parametrize(("option", "relation"), [("--resumed-from", "resumed_from"),
                                                 ("--fine-tuned-from", "fine_tuned_from"),
                                                 ("--branched-from", "branched_from")])
def test_commit_records_the_origin_with_its_relation(env, tmp_path, option, relation):
    job = _job_folder(tmp_path / "job" / "checkpoint-3")
    _cli("commit", str(job), "--run", "ft-run", "--step", "3", option, "base/7", "--no-announce")
    m = Manifest.from_json(json.dumps(_manifest_doc(env, "ft-run", 3)))
    assert (m.parent.run, m.parent.step, m.parent.relation) == ("base", 7, relation)


@pytest.mark.parametrize("args", [["--run", "../etc", "--step", "1"], ["--run", "r", "--step", "1", "--parent", "x"]])
def test_bad_input_is_refused_in_one_line(env, tmp_path, args):
    from ckpt.cli import main

    job = _job_folder(tmp_path / "j")
    import sys

    argv = sys.argv
    sys.argv = ["ckpt", "commit", str(job), "--no-announce", *args]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = argv
    assert exc.value.code == 2


def test_a_folder_that_fails_its_format_is_not_committed(env, tmp_path):
    job = tmp_path / "bad"
    job.mkdir()
    (job / "model.safetensors").write_bytes(b"\xff" * 64)  # no valid header
    result = CliRunner().invoke(app, ["commit", str(job), "--run", "r", "--step", "2", "--no-announce"])
    assert result.exit_code != 0
    assert not (env.data_dir / "tier0" / "node-0" / "r" / "step-00000002" / "manifest.json").exists()
