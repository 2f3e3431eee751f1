"""W&B tracking in offline mode: each stage's run carries the pipeline run's group, the recipe name and the parent
artifact, its resolved config and its metrics, read back from the run files in the run directory."""

from __future__ import annotations

import json

import yaml

import pytest

from posttrain.artifacts import manifest_sha256
from posttrain.tracking import read_offline_run
from tests.helpers import posttrain

pytestmark = pytest.mark.slow


def test_offline_wandb_runs_are_read_back_with_group_recipe_parent_config_and_metrics(tmp_path):
    result = posttrain("run", "pipeline=tiny-ci", "pipeline.stages=[pretrain,sft]", "pipeline.evaluate=false",
                       "tracking=wandb", "pretrain.trainer.max_steps=4", "pretrain.trainer.logging_steps=2",
                       "sft.trainer.max_steps=4", "sft.trainer.logging_steps=2", f"run.root={tmp_path}", "run.name=wb",
                       WANDB_API_KEY="", WANDB_MODE="")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "wb"
    runs = {}
    for path in (run_dir / "wandb").glob("offline-run-*"):
        record = read_offline_run(path)
        runs[record["name"].split("/", 1)[1]] = record  # job_type sticks at the first stage's in one process
    assert set(runs) == {"pretrain", "sft"}
    for stage, record in runs.items():
        assert record["group"] == "wb" and record["name"] == f"wb/{stage}"
        # the recipe and model; the stage tag (like job_type) keeps the first stage's value within one process,
        # because wandb reads its environment once per process
        assert {"tiny-ci", "tiny"} <= set(record["tags"])
        import yaml

        config = yaml.safe_load((run_dir / "wandb" / f"{stage}.config.yaml").read_text())
        assert record["config"]["max_steps"] == 4  # the trainer's arguments, as W&B holds them
        assert config["recipe"] == "tiny-ci" and config["stage"] == stage
        assert config["posttrain"][stage]["trainer"]["max_steps"] == 4  # the resolved recipe
        assert config["posttrain"]["pipeline"]["stages"] == ["pretrain", "sft"]
        losses = [row["train/loss"] for row in record["history"] if "train/loss" in row]
        assert len(losses) == 2 and all(loss > 0 for loss in losses)  # logged at steps 2 and 4
        assert record["summary"]["train/global_step"] == 4
    configs = {s: yaml.safe_load((run_dir / "wandb" / f"{s}.config.yaml").read_text()) for s in runs}
    assert configs["pretrain"]["parent_artifact"] is None
    parent = configs["sft"]["parent_artifact"]
    assert parent["path"] == str((run_dir / "00-pretrain").resolve())
    assert parent["manifest_sha256"] == manifest_sha256(run_dir / "00-pretrain")
    # what the manifest says the stage logged is what W&B holds
    manifest = json.loads((run_dir / "01-sft" / "manifest.json").read_text())
    assert manifest["metrics"]["last_logged_loss"] == pytest.approx(
        [row["train/loss"] for row in runs["sft"]["history"] if "train/loss" in row][-1], rel=1e-4)
