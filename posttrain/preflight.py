"""What `posttrain run` and `posttrain stage=...` check before the first stage starts, so that a setting that would
fail in the third stage fails now, in one line: the model can be loaded (a local directory, or a hub id in the
cache when offline), every training stage's trainer block builds its TRL config object, and every GRPO reward
name exists. `posttrain run --dry-run` runs these checks and stops.

Recipe keys and value types are checked earlier still, when the recipe is composed (posttrain.config).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from posttrain import training
from posttrain.config import RecipeError
from posttrain.config_schema import TRAINER_CLASSES
from posttrain.models.loading import check_model_reachable
from rewards import REWARDS


def preflight(cfg, stages: list[str]) -> list[str]:
    """Check everything the run's `stages` need that can be known now; returns what was checked, for --dry-run."""
    checked = []
    if cfg.model.source == "hf" and not cfg.parent:
        check_model_reachable(cfg.model.name_or_path, cfg.model.revision)
        checked.append(f"model {cfg.model.name_or_path}")
    # Under torchrun each rank is already one of several: a TRL config object built now would start the process
    # group without the run's timeout (training.init_distributed starts it first, when the stage begins).
    trainers = [] if training.world_size() > 1 else list(dict.fromkeys(name.partition(":")[0] for name in stages))
    with tempfile.TemporaryDirectory(prefix="posttrain-preflight-") as scratch:
        for stage in trainers:
            if stage in TRAINER_CLASSES:
                check_trainer(cfg, stage, Path(scratch))
                checked.append(f"{stage}.trainer ({TRAINER_CLASSES[stage]})")
    if "grpo" in stages:
        check_rewards(cfg)
        checked.append(f"grpo.rewards ({', '.join(cfg.grpo.rewards)})")
    return checked


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


def check_rewards(cfg) -> None:
    valid = [*REWARDS, "reward_model"]
    for name in cfg.grpo.rewards:
        if name not in valid:
            raise RecipeError(f"grpo.rewards: unknown reward '{name}'; valid: {', '.join(valid)}")
