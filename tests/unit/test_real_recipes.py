"""The real-model pipeline recipes (pipeline=qwen3-0.6b, qwen3-8b, qwen3-30b-a3b) fit on 8 GPUs of 80 GB with the
launcher, method and batch sizes they choose, by the capacity planner; the CPU pipeline=smollm2 composes offline.

Per training stage: the sequence is the trainer's max_length (GRPO: a 512-token prompt budget, GSM8K's p99 is about
160 tokens, plus max_completion_length); DPO and the reward model put chosen and rejected through the model
together, so their micro-batch counts twice; full-FT DPO also holds a frozen bf16 reference, sharded like the
weights; GRPO's colocated vLLM keeps `vllm_gpu_memory_utilization` of each GPU for itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import compose
from posttrain.planner import load_config, plan_model
from tests.conftest import REPO, shared_path

STRATEGY = {"ddp": "ddp", "zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3", "fsdp2": "zero3"}
GPUS, GPU_GB = 8, 80
PROMPT_BUDGET = 512


def model_config(name: str) -> dict:
    if name == "qwen3-8b":  # not among ../shared's reference configs; written from the model card
        return load_config(REPO / "tests" / "fixtures" / "qwen3-8b.config.json")
    return load_config(shared_path("data", "reference", "configs", f"{name}.config.json"))


def stage_budget(cfg, stage: str) -> tuple[str, int, int, float]:
    """(method, seq_len, micro_batch, usable bytes per GPU) for one training stage of a composed pipeline."""
    block, trainer = cfg[stage], cfg[stage].trainer
    method = "lora" if block.lora is not None else "full"
    micro = trainer.per_device_train_batch_size
    if stage == "grpo":
        seq = PROMPT_BUDGET + trainer.max_completion_length
    else:
        seq = trainer.max_length
    if stage in ("dpo", "reward_model"):
        micro *= 2  # chosen and rejected
    usable = 0.9 * GPU_GB * 1e9
    if stage == "grpo" and trainer.get("use_vllm") and trainer.get("vllm_mode") == "colocate":
        usable -= trainer.vllm_gpu_memory_utilization * GPU_GB * 1e9
    return method, seq, micro, usable


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_real_pipeline_fits_on_eight_80gb_gpus(name):
    cfg = compose([f"pipeline={name}"])
    assert cfg.model.name_or_path.startswith("Qwen/") and cfg.pipeline.launcher in STRATEGY
    assert (REPO / "recipes" / "accelerate" / f"{cfg.pipeline.launcher}.yaml").exists()
    assert cfg.grpo.trainer.use_vllm and cfg.grpo.rewards == {"math_verifier": 1.0, "think_format": 0.1}
    strategy = STRATEGY[cfg.pipeline.launcher]
    config = model_config(name)
    for stage in ("sft", "reward_model", "grpo", "dpo"):
        method, seq, micro, usable = stage_budget(cfg, stage)
        lora = cfg[stage].lora
        plan = plan_model(config, gpus=GPUS, gpu_mem_gb=GPU_GB, seq_len=seq, micro_batch=micro,
                          lora_rank=lora.r if lora is not None else 16,
                          gradient_checkpointing=bool(cfg[stage].trainer.activation_checkpointing))
        row = plan.training.row(method, strategy)
        reference = 0.0
        if stage == "dpo" and method == "full":
            reference = plan.training.base_bytes_bf16 / (GPUS if strategy == "zero3" else 1)
        need = row.total + reference
        assert need <= usable, (f"{name} {stage}: {method} {strategy} needs {need / 1e9:.1f} GB per GPU, "
                                f"{usable / 1e9:.1f} GB usable")


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
    assert cfg.sft.lora is not None and cfg.dpo.lora is not None
    for path in (cfg.data.path, cfg.grpo.prompts.path, cfg.dpo.pairs.path, cfg.eval.gsm8k.path):
        assert Path(path).is_absolute() or (REPO / path).resolve().is_relative_to(REPO.parent)
