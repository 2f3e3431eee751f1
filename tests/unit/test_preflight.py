"""What `posttrain run` checks before its first stage: TRL's own config checks, reward names, the model; and
`--dry-run`, which stops there."""

from __future__ import annotations

import pytest

from posttrain.config import RecipeError, compose
from posttrain.preflight import check_capacity, check_constraint_split, preflight
from tests.conftest import REPO
from tests.helpers import posttrain


def test_trl_config_checks_run_before_the_first_stage():
    cfg = compose(["pipeline=tiny", "grpo.trainer.num_generations=7"])
    with pytest.raises(RecipeError, match=r"grpo.trainer: GRPOConfig refuses these settings: generation_batch_size "
                                          r"\(128\) must be divisible by num_generations \(7\)"):
        preflight(cfg, list(cfg.pipeline.stages))
    assert "grpo.trainer (GRPOConfig)" not in preflight(cfg, ["pretrain", "sft"])  # a stage not run is not checked


def test_every_grpo_reward_name_exists():
    cfg = compose(["pipeline=tiny", "+grpo.rewards.code_verifer=0.5"])
    with pytest.raises(RecipeError, match="grpo.rewards: unknown reward 'code_verifer'. Did you mean 'code_verifier'"):
        preflight(cfg, ["grpo"])


@pytest.mark.parametrize("stage, lora", [("sft", "sft=lora"), ("reward_model", "reward_model.lora={r: 4}"),
                                         ("sft", "sft.qlora=true")])
def test_train_top_layers_beside_lora_fails_before_the_first_stage(stage, lora):
    cfg = compose(["pipeline=tiny", lora, f"{stage}.train_top_layers=2"])
    with pytest.raises(RecipeError, match=rf"{stage}.train_top_layers and {stage}.lora / {stage}.qlora are two ways "
                                          r"to train part of the model: set one of them"):
        preflight(cfg, [stage])
    assert "sft.trainer (SFTConfig)" in preflight(compose(["pipeline=tiny", "sft.train_top_layers=2"]), ["sft"])


def test_sft_qlora_without_lora_fails_before_the_first_stage():
    cfg = compose(["pipeline=tiny", "sft.qlora=true"])
    with pytest.raises(RecipeError, match="sft.qlora=true needs sft.lora: a 4-bit model is trained through LoRA "
                                          "adapters only"):
        preflight(cfg, ["sft"])


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


def test_what_the_launcher_cannot_do_fails_before_the_first_stage():
    """QLoRA on sharded weights, and engine roll-outs under DeepSpeed or FSDP, stop at preflight naming both."""
    cfg = compose(["pipeline=tiny", "pipeline.launcher=fsdp2", "sft=lora", "sft.qlora=true"])
    with pytest.raises(RecipeError, match=r"sft.qlora=true under pipeline.launcher=fsdp2 \(fsdp2\)"):
        preflight(cfg, ["sft"])
    assert any(line == "launcher fsdp2 (fsdp2)" for line in preflight(cfg.copy(), ["pretrain"]))
    cfg = compose(["pipeline=tiny", "pipeline.launcher=zero2", "grpo.rollout.backend=posttrain"])
    with pytest.raises(RecipeError, match=r"grpo.rollout.backend=posttrain under pipeline.launcher=zero2 \(zero2\)"):
        preflight(cfg, ["grpo"])
    preflight(compose(["pipeline=tiny", "pipeline.launcher=ddp", "grpo.rollout.backend=posttrain"]), ["grpo"])


def test_a_launcher_that_does_not_fit_the_recipes_machine_fails_before_the_first_stage():
    """pipeline=qwen3-8b is sized for 8 x 80 GB under zero3; under ddp its full fine-tuning needs ~137 GB per GPU.
    The planner reads the model's config.json (here the fixture written from the model card). The capacity check
    alone: the recipe's GPU trainer blocks do not build on this CPU machine."""
    config = REPO / "tests" / "fixtures" / "qwen3-8b.config.json"
    cfg = compose(["pipeline=qwen3-8b", f"model.name_or_path={config}", "pipeline.launcher=ddp"])
    with pytest.raises(RecipeError, match=r"(?s)launcher=ddp: by the capacity planner, a stage does not fit on "
                                          r"8 x 80 GB.*sft .*DDP: DOES NOT FIT"):
        check_capacity(cfg)
    shown = check_capacity(compose(["pipeline=qwen3-8b", f"model.name_or_path={config}"]))
    assert "capacity on 8 x 80 GB" in shown and "ZeRO-3: fits" in shown and "DOES NOT FIT" not in shown


def test_an_ifeval_split_other_than_grpos_fails_before_the_first_stage():
    assert check_constraint_split(compose(["pipeline=smollm2-ifeval"]))  # the recipe ties them together
    assert check_constraint_split(compose(["pipeline=smollm2-ifeval", "seed=3"]))
    with pytest.raises(RecipeError, match=r"eval.ifeval.split_seed is 5 but data.seed is 0: the ifeval suite's "
                                          r"held-out prompts must come from the split GRPO trains on"):
        check_constraint_split(compose(["pipeline=smollm2-ifeval", "eval.ifeval.split_seed=5"]))
    with pytest.raises(RecipeError, match="eval.ifeval.dolly_path"):
        check_constraint_split(compose(["pipeline=smollm2-ifeval", "eval.ifeval.dolly_path=other.jsonl"]))
    assert not check_constraint_split(compose(["pipeline=tiny"]))  # no constrained prompts: nothing to tie
