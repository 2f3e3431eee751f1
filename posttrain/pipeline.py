"""Chain stages into a run: each reads its parent artifact and writes `runs/<run>/<NN-stage>/`.

A stage whose manifest matches its config hash and parent is skipped (after checking its weights); a stage that
was killed resumes from its last trainer checkpoint; a stage whose config or parent changed runs again.

Stages that do not produce a generator (the reward model) do not become the next stage's parent: the chain
base -> sft -> reward_model -> grpo -> dpo trains GRPO on the SFT model and hands it the reward model as an
input; DPO then starts from (and is regularized towards) the GRPO model.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime
from pathlib import Path

from posttrain import tracking
from posttrain.artifacts import manifest_sha256, read_manifest, verify_artifact
from posttrain.config import stage_view
from posttrain.training import StageRun, stage_hash

log = logging.getLogger("posttrain")


def stage_mains():
    from posttrain.stages import dpo, grpo, pretrain, quantize, reward_model, sft

    return {"pretrain": pretrain.main, "sft": sft.main, "reward_model": reward_model.main, "grpo": grpo.main,
            "dpo": dpo.main, "quantize": quantize.main}


SIDE_STAGES = {"reward_model"}  # artifacts later stages read as inputs, not as their parent
LEAF_STAGES = {"quantize"}  # end points: `quantize:int8` and `quantize:int4` both quantize the same parent


def run_dir_of(cfg) -> tuple[Path, str]:
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.root) / name, name


def run_stage(cfg, name: str, index: int, parent: Path | None, run_dir: Path, run_name: str,
              inputs: dict[str, Path] | None = None) -> Path:
    mains = stage_mains()
    base = name.partition(":")[0]  # quantize:<variant>
    if base not in mains:
        raise ValueError(f"unknown stage '{name}'; valid stages: {', '.join(mains)}")
    out_dir = run_dir / f"{index:02d}-{name.replace(':', '-')}"
    config = stage_view(cfg, name)
    inputs = dict(inputs or {})
    digest = stage_hash(config, manifest_sha256(parent) if parent else None,
                        {k: manifest_sha256(v) for k, v in inputs.items()})
    manifest = read_manifest(out_dir)
    if manifest is not None and manifest.get("config_hash") == digest:
        verify_artifact(out_dir)
        log.info("%s: up to date (%s), skipped", name, out_dir)
        return out_dir
    tracking.configure(cfg.tracking, run_dir, run_name, name)
    run = StageRun(name=name, out_dir=out_dir, parent=parent, config=config, config_hash=digest, run_name=run_name,
                   inputs=inputs)
    log.info("%s: running -> %s", name, out_dir)
    started = time.perf_counter()
    try:
        mains[base](cfg, run)
    finally:
        finish_tracking()
    log.info("%s: done in %.1f s", name, time.perf_counter() - started)
    return out_dir


def finish_tracking() -> None:
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def run_pipeline(cfg) -> Path:
    from posttrain.evaluation.run import evaluate

    run_dir, run_name = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("pipeline %s: stages %s -> %s", cfg.pipeline.name, list(cfg.pipeline.stages), run_dir)
    started = time.perf_counter()
    parent = Path(cfg.parent) if cfg.parent else None
    stage_dirs, inputs = [], {}
    for index, name in enumerate(cfg.pipeline.stages):
        out = run_stage(cfg, name, index, parent, run_dir, run_name, inputs)
        stage_dirs.append(out)
        if name in SIDE_STAGES:
            inputs[name] = out
        elif name.partition(":")[0] not in LEAF_STAGES:
            parent = out
    if cfg.pipeline.evaluate:
        evaluate(cfg, run_dir, stage_dirs)
    log.info("pipeline %s finished in %.1f s", cfg.pipeline.name, time.perf_counter() - started)
    return run_dir


def run_single_stage(cfg) -> Path:
    """`posttrain stage=<name>`: one stage, on `parent=<artifact>` or on the model the recipe names."""
    run_dir, run_name = run_dir_of(cfg)
    parent = Path(cfg.parent) if cfg.parent else None
    index = 0
    if parent is not None:
        match = re.match(r"(\d+)-", parent.name)
        index = int(match.group(1)) + 1 if match else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_stage(cfg, cfg.stage, index, parent, run_dir, run_name)
