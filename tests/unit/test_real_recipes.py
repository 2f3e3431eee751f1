"""The real-model pipeline recipes (pipeline=qwen3-0.6b, qwen3-8b, qwen3-30b-a3b) fit on the 8 GPUs of 80 GB they
state (pipeline.gpus, pipeline.gpu_mem_gb) with the launcher, method and batch sizes they choose, by the capacity
planner per stage (posttrain.planner.stages says what each stage puts through the model); the CPU pipeline=smollm2
composes offline.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.config import compose
from posttrain.planner import load_config, plan_model
from posttrain.planner.stages import render_stage_plans, stage_plans
from posttrain.sharding import requested_strategy
from tests.conftest import REPO, shared_path

GPUS, GPU_GB = 8, 80


def model_config(name: str) -> dict:
    if name == "qwen3-8b":  # not among ../shared's reference configs; written from the model card
        return load_config(REPO / "tests" / "fixtures" / "qwen3-8b.config.json")
    return load_config(shared_path("data", "reference", "configs", f"{name}.config.json"))


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_real_pipeline_fits_on_eight_80gb_gpus(name):
    """Every training stage fits under the strategy its launcher runs; the table (GB per GPU under each strategy,
    the launcher's starred) is printed, as `posttrain run --dry-run` prints it."""
    cfg = compose([f"pipeline={name}"])
    assert cfg.model.name_or_path.startswith("Qwen/")
    assert (REPO / "recipes" / "accelerate" / f"{cfg.pipeline.launcher}.yaml").exists()
    assert cfg.grpo.trainer.use_vllm and cfg.grpo.rewards == {"math_verifier": 1.0, "think_format": 0.1}
    assert (cfg.pipeline.gpus, cfg.pipeline.gpu_mem_gb) == (GPUS, GPU_GB)
    strategy = requested_strategy(cfg.pipeline.launcher)
    plans = stage_plans(cfg, model_config(name), strategy, GPUS, GPU_GB)
    print(f"\n{name}, launcher {cfg.pipeline.launcher}:\n{render_stage_plans(plans, cfg.pipeline.launcher)}")
    assert [p.stage for p in plans] == ["sft", "reward_model", "grpo", "dpo"]
    for p in plans:
        assert p.fits, (f"{name} {p.stage}: {p.method} {p.strategy} needs {p.need_gb[p.strategy]:.1f} GB per GPU, "
                        f"{p.usable_gb:.1f} GB usable")


def test_a_launcher_the_planner_says_does_not_fit_is_caught():
    """The same check fails for a choice that cannot work: pipeline=qwen3-8b's full fine-tuning under plain DDP."""
    cfg = compose(["pipeline=qwen3-8b", "pipeline.launcher=ddp"])
    plans = stage_plans(cfg, model_config("qwen3-8b"), requested_strategy("ddp"), GPUS, GPU_GB)
    sft = next(p for p in plans if p.stage == "sft")
    assert sft.method == "full" and sft.strategy == "ddp" and not sft.fits and sft.need_gb["zero3"] <= sft.usable_gb
    assert "DDP: DOES NOT FIT" in render_stage_plans(plans, "ddp")


def test_the_planner_would_reject_a_launcher_that_does_not_fit():
    """The same check fails for a choice that cannot work: Qwen3-8B full fine-tuning under plain DDP."""
    config = model_config("qwen3-8b")
    plan = plan_model(config, gpus=GPUS, gpu_mem_gb=GPU_GB, seq_len=2048, micro_batch=2)
    assert abs(plan.params.total - 8.19e9) / 8.19e9 < 0.01  # the card: 8.2B, 6.95B without embeddings
    assert abs(plan.params.total - plan.params.embedding - plan.params.lm_head - 6.95e9) / 6.95e9 < 0.01
    assert not plan.training.row("full", "ddp").fits and plan.training.row("full", "zero3").fits


def test_smollm2_pipeline_composes_offline_on_the_cpu_recipes():
    cfg = compose(["pipeline=smollm2"])
    assert cfg.model.source == "gguf" and cfg.pipeline.launcher == "single"
    assert cfg.sft.lora is None and cfg.dpo.lora is not None  # SFT of the top layers on GSM8K solutions; LoRA DPO
    assert cfg.sft.train_top_layers == 15 and cfg.sft.trainer.bf16 == "auto"
    assert cfg.data.gsm8k.n > 0 and cfg.eval.base and cfg.eval.gsm8k.max_calculations == 2
    assert cfg.reward_model.pairs.source == "hh_rlhf" and cfg.eval.n_prompts.gsm8k >= 200
    for path in (cfg.data.path, cfg.data.gsm8k.path, cfg.grpo.prompts.path, cfg.dpo.pairs.path, cfg.eval.gsm8k.path,
                 cfg.reward_model.pairs.path):
        # lexically, not resolved: ../shared may be a link to the data elsewhere
        assert Path(path).is_absolute() or Path(os.path.normpath(REPO / path)).is_relative_to(REPO.parent)
