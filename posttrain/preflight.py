"""What `posttrain run` and `posttrain stage=...` check before the first stage starts, so that a setting that would
fail in the third stage fails now, in one line: the model can be loaded (a local directory, or a hub id in the
cache when offline), every training stage's trainer block builds its TRL config object, every GRPO reward
name exists, no stage asks for both LoRA and train_top_layers, nothing asks for what the launcher's strategy
cannot do (QLoRA or engine roll-outs on sharded weights), every quantize variant's group size divides the
widths of the layers it will quantize, and the ifeval suite holds out the constrained prompts GRPO trains without.
`posttrain run --dry-run` runs these checks and stops.

Recipe keys and value types are checked earlier still, when the recipe is composed (posttrain.config).
"""

from __future__ import annotations

import difflib
import tempfile
import warnings
from pathlib import Path

from posttrain import sharding, training
from posttrain.config import RecipeError
from posttrain.config_schema import TRAINER_CLASSES
from posttrain.models.loading import cache_dir, check_model_reachable
from posttrain.planner.config import PlannerError, load_config
from posttrain.planner.stages import render_stage_plans, stage_plans
from posttrain.quant.formats import resolve_group_size
from posttrain.registry import parse
from rewards import REWARDS


def preflight(cfg, stages: list[str]) -> list[str]:
    """Check everything the run's `stages` need that can be known now; returns what was checked, for --dry-run."""
    checked = []
    if cfg.model.source == "hf" and not cfg.parent:
        check_model_reachable(cfg.model.name_or_path, cfg.model.revision)
        checked.append(f"model {cfg.model.name_or_path}")
    # Under torchrun each rank is already one of several: a TRL config object built now would start the process
    # group without the run's timeout (training.init_distributed starts it first, when the stage begins).
    trainers = [] if training.world_size() > 1 else list(dict.fromkeys(parse(name)[0].name for name in stages))
    with tempfile.TemporaryDirectory(prefix="posttrain-preflight-") as scratch:
        for stage in trainers:
            if stage in TRAINER_CLASSES:
                check_trainer(cfg, stage, Path(scratch))
                checked.append(f"{stage}.trainer ({TRAINER_CLASSES[stage]})")
    for stage in ("sft", "reward_model"):
        if stage in stages:
            check_partial_training(cfg, stage)
    if "grpo" in stages:
        check_rewards(cfg)
        checked.append(f"grpo.rewards ({', '.join(cfg.grpo.rewards)})")
        if check_constraint_split(cfg):
            checked.append("eval.ifeval holds out what grpo.prompts trains on")
    if cfg.pipeline.launcher != "single":
        checked.append(f"launcher {cfg.pipeline.launcher} ({check_launcher(cfg, stages)})")
    if cfg.pipeline.gpus and cfg.pipeline.gpu_mem_gb:
        checked.append(check_capacity(cfg))
    variants = [v for stage, v in map(parse, stages) if stage.name == "quantize" and v]
    if variants and (widths := layer_widths(cfg)):
        check_group_sizes(cfg, variants, widths)
        checked.append(f"quantize group sizes ({', '.join(variants)}) against widths {sorted(set(widths.values()))}")
    return checked


def check_partial_training(cfg, stage: str) -> None:
    """`train_top_layers` and LoRA (or QLoRA) are two ways to train part of the model; a stage takes one. SFT's
    QLoRA trains LoRA adapters over 4-bit weights, so it needs a `lora` block."""
    block = cfg[stage]
    if block.get("train_top_layers") is not None and (block.lora is not None or block.qlora):
        raise RecipeError(f"{stage}.train_top_layers and {stage}.lora / {stage}.qlora are two ways to train part of "
                          f"the model: set one of them")
    if stage == "sft" and block.qlora and block.lora is None:
        raise RecipeError("sft.qlora=true needs sft.lora: a 4-bit model is trained through LoRA adapters only")


def layer_widths(cfg) -> dict[str, int]:
    """The input widths of the linear layers a quantizer meets (name -> width), from the model's config when it
    can be read without loading weights; empty when it cannot (the quantize stage checks again itself)."""
    if cfg.model.source == "tiny":
        arch = cfg.model.arch
        config = {"hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
                  "num_attention_heads": arch.num_attention_heads, "head_dim": arch.head_dim}
    else:
        if cfg.parent:
            source = Path(cfg.parent) / "model"
        elif cfg.model.source == "gguf":  # the cached safetensors copy, when it exists (it holds the config)
            source = cache_dir() / "gguf" / Path(cfg.model.gguf_file).stem
        else:
            source = cfg.model.name_or_path
        try:
            config = load_config(source)
        except (PlannerError, OSError, ValueError):
            return {}
        config = config.get("text_config", config)
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    widths = {"q/k/v/gate/up_proj (hidden_size)": hidden, "o_proj (heads x head_dim)": heads * head_dim if heads
              and head_dim else None, "down_proj (intermediate_size)": config.get("intermediate_size"),
              "experts' down_proj (moe_intermediate_size)": config.get("moe_intermediate_size")}
    return {k: int(v) for k, v in widths.items() if v}


def check_group_sizes(cfg, variants: list[str], widths: dict[str, int]) -> None:
    """A group must divide each quantized layer's input width (SmolLM2's 576 is not a multiple of 128)."""
    for name in variants:
        block = cfg.quantize.variants.get(name)
        if block is None or block.fmt == "gguf":
            continue  # the quantize stage names a missing variant itself; GGUF picks a block type per tensor width
        for layer, width in widths.items():
            try:
                resolve_group_size(block.fmt, block.group_size, width)
            except ValueError as err:
                raise RecipeError(f"quantize.variants.{name}: {err} ({layer} of {cfg.model.name}); choose a "
                                  f"group_size dividing {sorted(set(widths.values()))}") from None


def check_trainer(cfg, stage: str, scratch: Path) -> None:
    """Build the stage's TRL config object as the stage will (its __post_init__ checks how fields fit together)."""
    run = training.StageRun(name=stage, out_dir=scratch / stage, parent=None, config={}, config_hash="",
                            run_name="preflight")
    try:
        with warnings.catch_warnings():  # deprecation notes: the stage itself shows them when it starts
            warnings.simplefilter("ignore", FutureWarning)
            training.trl_args(TRAINER_CLASSES[stage], cfg[stage].trainer, run, cfg.tracking, cfg.seed)
    except (ValueError, TypeError) as err:
        raise RecipeError(f"{stage}.trainer: {TRAINER_CLASSES[stage]} refuses these settings: {err}") from None


def check_launcher(cfg, stages: list[str]) -> str:
    """Settings that cannot run under the launcher's strategy fail now, not when that stage starts; returns it."""
    strategy = sharding.requested_strategy(cfg.pipeline.launcher)
    names = {parse(name)[0].name for name in stages}
    if "sft" in names and cfg.sft.qlora and strategy in sharding.SHARDED:
        raise RecipeError(f"sft.qlora=true under pipeline.launcher={cfg.pipeline.launcher} ({strategy}): the 4-bit "
                          f"base (bitsandbytes) cannot be sharded by FSDP or ZeRO-3 here; use launcher ddp or "
                          f"zero2, or LoRA on the full-precision base (sft.qlora=false)")
    if "grpo" in names and cfg.grpo.rollout.backend == "posttrain" and strategy.startswith(("zero", "fsdp")):
        raise RecipeError(f"grpo.rollout.backend=posttrain under pipeline.launcher={cfg.pipeline.launcher} "
                          f"({strategy}): the engine runs each process's own whole model, which DeepSpeed and "
                          f"FSDP take over; use rollout.backend=trl (or vllm on GPUs), or launcher ddp")
    return strategy


def check_capacity(cfg) -> str:
    """The planner's GB per GPU for each training stage on the recipe's machine (pipeline.gpus x gpu_mem_gb) under
    every strategy; a stage that does not fit under the launcher's strategy fails the run. A model config the
    planner cannot read (offline, not cached) skips the check, saying so."""
    source = Path(cfg.parent) / "model" if cfg.parent else cfg.model.name_or_path
    launcher = cfg.pipeline.launcher
    try:
        plans = stage_plans(cfg, load_config(source), sharding.requested_strategy(launcher), cfg.pipeline.gpus,
                            cfg.pipeline.gpu_mem_gb)
    except (PlannerError, OSError) as err:
        return (f"capacity on {cfg.pipeline.gpus} x {cfg.pipeline.gpu_mem_gb:g} GB: skipped, no config for {source} "
                f"({err})")
    shown = render_stage_plans(plans, launcher)
    if not all(p.fits for p in plans):
        raise RecipeError(f"pipeline.launcher={launcher}: by the capacity planner, a stage does not fit on "
                          f"{cfg.pipeline.gpus} x {cfg.pipeline.gpu_mem_gb:g} GB (GB per GPU; * the launcher's):\n"
                          f"{shown}")
    return f"capacity on {cfg.pipeline.gpus} x {cfg.pipeline.gpu_mem_gb:g} GB (GB per GPU; * the launcher's):\n{shown}"


def check_constraint_split(cfg) -> bool:
    """GRPO on constrained prompts scored by the ifeval suite: both must split the same base prompts with the same
    seed, or the suite's held-out prompts are not the ones training left out (a prompt trained on could be scored).
    Returns whether the check applied."""
    if cfg.grpo.prompts.source != "constraints" or "ifeval" not in (cfg.eval.suites or []):
        return False
    pairs = [("eval.ifeval.split_seed", cfg.eval.ifeval.split_seed, "data.seed", cfg.data.seed),
             ("eval.ifeval.gsm8k_path", cfg.eval.ifeval.gsm8k_path, "grpo.prompts.path", cfg.grpo.prompts.path),
             ("eval.ifeval.dolly_path", cfg.eval.ifeval.dolly_path, "grpo.prompts.dolly_path",
              cfg.grpo.prompts.dolly_path)]
    for key, value, other, expected in pairs:
        if value != expected:
            raise RecipeError(f"{key} is {value!r} but {other} is {expected!r}: the ifeval suite's held-out prompts "
                              f"must come from the split GRPO trains on (set {key}: ${{{other}}})")
    return True


def check_rewards(cfg) -> None:
    valid = [*REWARDS, "reward_model"]
    for name in cfg.grpo.rewards:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise RecipeError(f"grpo.rewards: unknown reward '{name}'.{hint} Valid: {', '.join(valid)}")
