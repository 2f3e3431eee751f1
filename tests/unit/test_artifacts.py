"""The artifact contract: manifest written last and atomically, weight hashes verified on load."""

from __future__ import annotations

import json
import os

import pytest

from posttrain.artifacts import ArtifactError, read_manifest, verify_artifact, write_json_atomic, write_manifest


def make_artifact(tmp_path, payload=b"weights-v1"):
    stage_dir = tmp_path / "01-sft"
    (stage_dir / "model").mkdir(parents=True)
    (stage_dir / "model" / "model.safetensors").write_bytes(payload)
    (stage_dir / "model" / "config.json").write_text("{}")
    write_manifest(stage_dir, stage="sft", parent=None, config={"a": 1}, config_hash="h", datasets=[],
                   metrics={"loss": 1.0}, started_at="t0")
    return stage_dir


def test_manifest_records_every_weight_file_and_provenance(tmp_path):
    stage_dir = make_artifact(tmp_path)
    manifest = verify_artifact(stage_dir)
    assert list(manifest["weights"]) == ["model/model.safetensors"]
    for key in ("stage", "parent", "config", "config_hash", "datasets", "metrics", "packages", "git_revision",
                "started_at", "finished_at"):
        assert key in manifest
    assert manifest["packages"]["torch"] != "not installed"


def test_tampered_weight_file_is_named(tmp_path):
    stage_dir = make_artifact(tmp_path)
    (stage_dir / "model" / "model.safetensors").write_bytes(b"weights-v2")
    with pytest.raises(ArtifactError, match=r"model\.safetensors.*does not match"):
        verify_artifact(stage_dir)


def test_missing_and_unlisted_weight_files_are_named(tmp_path):
    stage_dir = make_artifact(tmp_path)
    (stage_dir / "model" / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"extra\.safetensors.*not listed"):
        verify_artifact(stage_dir)
    (stage_dir / "model" / "extra.safetensors").unlink()
    (stage_dir / "model" / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"model\.safetensors.*missing"):
        verify_artifact(stage_dir)


def test_directory_without_manifest_is_not_an_artifact(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ArtifactError, match="not a finished artifact"):
        verify_artifact(tmp_path)


def test_no_weights_means_no_manifest(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ArtifactError, match="no weight files"):
        write_manifest(tmp_path, stage="sft", parent=None, config={}, config_hash="h", datasets=[], metrics={},
                       started_at="t0")
    assert read_manifest(tmp_path) is None


def test_atomic_write_leaves_old_file_when_serialisation_fails(tmp_path):
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"ok": 1})

    class Unserialisable:
        def __repr__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_json_atomic(path, {"bad": Unserialisable()})
    assert json.loads(path.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp file left behind


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    from posttrain.resume import last_checkpoint
    from posttrain.training import StageRun

    run = StageRun(name="sft", out_dir=tmp_path, parent=None, config={}, config_hash="h", run_name="r")
    assert last_checkpoint(run) is None
    for step, state in ((4, "{}"), (8, "{}"), (12, None), (16, '{"trunc')):
        ckpt = tmp_path / "checkpoints" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        if state is not None:
            (ckpt / "trainer_state.json").write_text(state)
    assert last_checkpoint(run) == str(tmp_path / "checkpoints" / "checkpoint-8")


def test_a_stage_directory_has_one_owner_at_a_time(tmp_path, caplog):
    from posttrain.artifacts import OWNER, StageBusyError, own_stage_dir

    stage = tmp_path / "01-sft"
    with own_stage_dir(stage):
        assert f"pid {os.getpid()}" in (stage / OWNER).read_text()
        with pytest.raises(StageBusyError, match=rf"01-sft is in use by another run \(host .*, pid {os.getpid()},"):
            with own_stage_dir(stage):
                pass
    assert (stage / OWNER).read_text() == ""  # released
    (stage / OWNER).write_text("host h, pid 999999, since then: posttrain run")  # a run killed before releasing
    with caplog.at_level("WARNING", logger="posttrain"), own_stage_dir(stage):
        assert f"pid {os.getpid()}" in (stage / OWNER).read_text()
    assert "taking over from a run that ended without releasing it (host h, pid 999999" in caplog.text


def test_a_resumed_stage_cuts_its_step_log_back_to_the_checkpoint(tmp_path):
    from posttrain.resume import checkpoint_step, cut_step_rows

    log = tmp_path / "completions.jsonl"
    log.write_text("".join(json.dumps({"step": step, "i": i}) + "\n" for step in range(5) for i in range(2)))
    assert checkpoint_step(str(tmp_path / "checkpoints" / "checkpoint-3")) == 3
    assert cut_step_rows(log, 3) == 4
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 0, 1, 1, 2, 2]
    assert cut_step_rows(tmp_path / "missing.jsonl", 3) == 0
