"""The stage registry: every stage posttrain runs, and what the rest of the package needs to know about it.

A recipe names a stage by its name, or `name:variant` for a stage with variants (`quantize:int4`). Everything that
differs from stage to stage outside the stage's own module is one entry here: the module whose `main(cfg, run)` runs
it, the TRL config class its `<stage>.trainer` block builds, what it reads and writes, whether it trains (and so runs
under `accelerate launch` when `pipeline.launcher` is not `single`), how its artifact joins the chain, and the label
its scorecard row carries. The pipeline, the launcher, preflight, the recipe schema and the scorecard read this
table rather than keep their own.

A new stage is a module in `posttrain/stages/` with a `main(cfg, run)` and one entry in STAGES (and its config
group in `posttrain/config_schema.py` and `recipes/`).

This module imports nothing from posttrain: every layer may read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

# How a stage's artifact joins the chain base -> sft -> grpo -> dpo.
PARENT = "parent"  # the next stage's parent (a generator: it is served and scored)
INPUT = "input"  # read by later stages by name (the reward model); not a parent, not a generator
LEAF = "leaf"  # an end point: `quantize:int8` and `quantize:int4` both quantize the same parent


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # its main(cfg, run) runs the stage
    trainer_config: str | None  # the TRL config class `<name>.trainer` builds; None for a stage without a trainer
    consumes: str
    produces: str
    role: str  # PARENT, INPUT or LEAF
    label: str | None = None  # its scorecard row's name when not the stage's (a variant's manifest names its own)
    variants: bool = False  # named as `name:variant`; each variant is its own stage directory

    @property
    def trains(self) -> bool:
        """A training stage: runs under `accelerate launch` with a launcher; quantize and eval run in-process."""
        return self.trainer_config is not None

    @property
    def generates(self) -> bool:
        """Its artifact is a causal LM that the eval serves and scores."""
        return self.role != INPUT


STAGES = {s.name: s for s in (
    Stage("pretrain", "posttrain.stages.pretrain", "SFTConfig", "the tiny world's plain text (builds the tiny model "
          "and tokenizer)", "a base causal LM", PARENT, label="base"),
    Stage("sft", "posttrain.stages.sft", "SFTConfig", "a causal LM; chat rows (tiny world or Dolly-style)",
          "a causal LM that follows instructions (loss on assistant tokens only)", PARENT),
    Stage("reward_model", "posttrain.stages.reward_model", "RewardConfig", "a causal LM; preference pairs",
          "a sequence-classification reward model", INPUT),
    Stage("grpo", "posttrain.stages.grpo", "GRPOConfig", "a causal LM; prompts with gold answers; the recipe's "
          "rewards (and a reward model when one is named)", "a causal LM, and completions.jsonl of every scored "
          "sample", PARENT),
    Stage("dpo", "posttrain.stages.dpo", "DPOConfig", "a causal LM (also its frozen reference); preference pairs",
          "a causal LM, and the likelihood shift of held-out pairs", PARENT),
    Stage("quantize", "posttrain.stages.quantize", None, "a causal LM (and calibration rows for GPTQ / AWQ)",
          "the quantized checkpoint of one variant (format, method, group size), and its held-out perplexity",
          LEAF, variants=True),
)}
TRAINING_STAGES = tuple(name for name, s in STAGES.items() if s.trains)


def parse(name: str) -> tuple[Stage, str | None]:
    """(the stage, its variant or None) of a recipe's stage name; ValueError naming the valid stages."""
    base, sep, variant = name.partition(":")
    stage = STAGES.get(base)
    if stage is None:
        raise ValueError(f"unknown stage '{name}'; valid stages: {', '.join(STAGES)}")
    if sep and not stage.variants:
        raise ValueError(f"stage '{base}' has no variants ('{name}'); only {', '.join(variant_stages())} take "
                         f"`name:variant`")
    return stage, (variant or None)


def variant_stages() -> list[str]:
    return [name for name, s in STAGES.items() if s.variants]


def stage_of(name: str) -> Stage:
    return parse(name)[0]


def stage_main(name: str) -> Callable:
    """The stage's `main(cfg, run)`. Imported when it runs, by module name: a stage module pulls in torch and its
    trainer, which commands that never train (plan, serve, data check) should not pay for."""
    return importlib.import_module(stage_of(name).module).main


def checkpoint_label(stage: str) -> str:
    """A stage's scorecard row name ("base" for pretrain); a stage name that is not registered is its own label."""
    base = stage.partition(":")[0]
    return (STAGES[base].label if base in STAGES else None) or stage


def is_generator(stage: str) -> bool:
    """Whether a manifest's stage is served and scored; a stage name that is not registered counts as one."""
    base = stage.partition(":")[0]
    return STAGES[base].generates if base in STAGES else True
