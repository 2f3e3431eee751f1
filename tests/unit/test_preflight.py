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


def test_a_quantize_group_that_does_not_divide_a_layer_fails_before_the_first_stage(tmp_path):
    """SmolLM2's hidden size, 576, is 4.5 groups of 128: issue 8's run reached int4 after an hour of training and
    failed there. The widths come from the model's config (here the tiny arch, and a saved config.json)."""
    stages = ["pretrain", "sft", "quantize:int4-rtn"]
    cfg = compose(["pipeline=tiny", "model.arch.hidden_size=576", "model.arch.head_dim=144",
                   "quantize.variants.int4-rtn.group_size=128"])
    with pytest.raises(RecipeError, match=r"quantize.variants.int4-rtn: int4 group_size 128 must be positive and divide "
                                          r"the weight's in_features 576 \(q/k/v/gate/up_proj \(hidden_size\)"):
        preflight(cfg, stages)
    cfg = compose(["pipeline=tiny", "model.arch.hidden_size=576", "model.arch.head_dim=144",
                   "quantize.variants.int4-rtn.group_size=64"])
    assert any(c.startswith("quantize group sizes (int4-rtn)") for c in preflight(cfg, stages))

    (tmp_path / "config.json").write_text('{"hidden_size": 576, "intermediate_size": 1536, '
                                          '"num_attention_heads": 9, "model_type": "llama"}')
    cfg = compose(["pipeline=tiny", "model=hf", f"model.name_or_path={tmp_path}"])
    with pytest.raises(RecipeError, match="in_features 576"):
        preflight(cfg, ["quantize:int4-rtn"])
