"""What `posttrain run` checks before its first stage: TRL's own config checks, reward names, the model; and
`--dry-run`, which stops there."""

from __future__ import annotations

import pytest

from posttrain.config import RecipeError, compose
from posttrain.preflight import preflight
from tests.helpers import posttrain


def test_trl_config_checks_run_before_the_first_stage():
    cfg = compose(["pipeline=tiny", "grpo.trainer.num_generations=7"])
    with pytest.raises(RecipeError, match=r"grpo.trainer: GRPOConfig refuses these settings: generation_batch_size "
                                          r"\(128\) must be divisible by num_generations \(7\)"):
        preflight(cfg, list(cfg.pipeline.stages))
    assert "grpo.trainer (GRPOConfig)" not in preflight(cfg, ["pretrain", "sft"])  # a stage not run is not checked


def test_every_grpo_reward_name_exists():
    cfg = compose(["pipeline=tiny", "+grpo.rewards.code_verifer=0.5"])
    with pytest.raises(RecipeError, match="grpo.rewards: unknown reward 'code_verifer'; valid: code_verifier"):
        preflight(cfg, ["grpo"])


def test_dry_run_checks_and_stops(tmp_path):
    result = posttrain("run", "pipeline=tiny", f"run.root={tmp_path}", "--dry-run", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "grpo.trainer (GRPOConfig)" in result.stdout and "grpo.rewards (math_verifier)" in result.stdout
    assert not list(tmp_path.iterdir())  # nothing written
    result = posttrain("run", "pipeline=tiny", f"run.root={tmp_path}", "--dry-run", "grpo.trainer.num_generations=7",
                       timeout=120)
    assert result.returncode == 2 and "grpo.trainer: GRPOConfig refuses these settings" in result.stderr, result.stderr
