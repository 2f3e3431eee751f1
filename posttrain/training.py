"""What every training stage shares: the stage directory's life cycle, TRL config construction, resume, saving."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from posttrain import tracking
from posttrain.artifacts import MANIFEST, now, sha256_json, write_manifest

log = logging.getLogger("posttrain")
INTENT = ".config_hash"  # written when a stage starts: checkpoints of another config are stale


@dataclass
class StageRun:
    """Where one stage writes, what it came from and the hash that decides skip / resume."""

    name: str
    out_dir: Path
    parent: Path | None
    config: dict
    config_hash: str
    run_name: str
    inputs: dict[str, Path] = field(default_factory=dict)  # other artifacts the stage reads (grpo: reward_model)
    started_at: str = field(default_factory=now)

    @property
    def checkpoints(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def model_dir(self) -> Path:
        return self.out_dir / "model"


def stage_hash(config: dict, parent_manifest_sha: str | None, inputs: dict[str, str] | None = None) -> str:
    if inputs:
        return sha256_json({"config": config, "parent": parent_manifest_sha, "inputs": inputs})
    return sha256_json({"config": config, "parent": parent_manifest_sha})


def begin(run: StageRun) -> None:
    """Make the stage directory ready: an old manifest stops looking finished first; stale checkpoints go."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / MANIFEST).unlink(missing_ok=True)
    intent = run.out_dir / INTENT
    if intent.exists() and intent.read_text().strip() != run.config_hash:
        log.info("%s: config or parent changed since the last attempt; discarding its checkpoints", run.name)
        shutil.rmtree(run.checkpoints, ignore_errors=True)
    shutil.rmtree(run.model_dir, ignore_errors=True)
    intent.write_text(run.config_hash)


def last_checkpoint(run: StageRun) -> str | None:
    """The newest *complete* trainer checkpoint, or None.

    transformers writes trainer_state.json last in a checkpoint, so a checkpoint without a readable one was cut
    short by a kill; its own `get_last_checkpoint` would pick it by number alone and resume would crash.
    """
    import json
    import re

    if not run.checkpoints.is_dir():
        return None
    numbered = []
    for path in run.checkpoints.iterdir():
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and path.is_dir():
            numbered.append((int(match.group(1)), path))
    for _, path in sorted(numbered, reverse=True):
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError):
            log.info("%s: ignoring incomplete checkpoint %s", run.name, path)
            continue
        return str(path)
    return None


def trl_args(class_name: str, trainer_block, run: StageRun, tracking_cfg):
    """A TRL config from the recipe's trainer block (TRL's own field names) plus where to write and log."""
    import trl

    kwargs = OmegaConf.to_container(trainer_block, resolve=True) if not isinstance(trainer_block, dict) else dict(trainer_block)
    kwargs.setdefault("output_dir", str(run.checkpoints))
    kwargs["report_to"] = tracking.report_to(tracking_cfg)
    kwargs.setdefault("run_name", f"{run.run_name}/{run.name}")
    kwargs.setdefault("save_strategy", "steps")
    return getattr(trl, class_name)(**kwargs)


def train_metrics(trainer) -> dict:
    """Loss at the first and last logging step, and the trainer's own summary."""
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "global_step": trainer.state.global_step,
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        "log_history": [h for h in trainer.state.log_history if "loss" in h or "train_runtime" in h],
    }


def save_model(model, tokenizer, run: StageRun) -> None:
    """Write model/ (safetensors, config, tokenizer with its chat template) for the artifact."""
    model.save_pretrained(run.model_dir, safe_serialization=True)
    tokenizer.save_pretrained(run.model_dir)


def drop_checkpoints(run: StageRun) -> None:
    """Trainer checkpoints only serve resume; the finished artifact is model/."""
    shutil.rmtree(run.checkpoints, ignore_errors=True)


def finish(run: StageRun, model, tokenizer, *, datasets: list[dict], metrics: dict, extra: dict) -> dict:
    """Save model/, drop the trainer checkpoints, then write the manifest last: the stage is now an artifact."""
    device = str(next(model.parameters()).device)  # where the weights were trained (cpu, cuda:0, ...)
    save_model(model, tokenizer, run)
    drop_checkpoints(run)
    write_manifest(run.out_dir, stage=run.name, parent=run.parent, config=run.config, config_hash=run.config_hash,
                   datasets=datasets, metrics=metrics, started_at=run.started_at, extra={"device": device, **extra})
    return metrics


def launcher_strategy() -> str:
    """The planner's name for how `accelerate launch` shards this run: ZeRO stage from DeepSpeed, FSDP as ZeRO-3
    (it shards weights, gradients and optimizer states alike), else DDP."""
    import os

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return f"zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "zero3"
    return "ddp"


def log_capacity_plan(stage: str, location, *, method: str, seq_len: int | None, micro_batch: int,
                      lora_rank: int | None = None) -> str | None:
    """On a GPU box, the capacity planner's verdict for this stage's model, method and launcher, logged before the
    model loads (on CPU: nothing). A config the planner cannot read is a warning, never a failed stage."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    from posttrain.planner import PlannerError, load_config, plan_model, verdict_line

    gpus = int(os.environ.get("WORLD_SIZE", torch.cuda.device_count()))
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / 1e9
    try:
        plan = plan_model(load_config(location), gpus=gpus, gpu_mem_gb=gpu_mem, seq_len=seq_len or 4096,
                          micro_batch=micro_batch, lora_rank=lora_rank or 16)
        line = verdict_line(plan, method, launcher_strategy())
    except (PlannerError, ValueError, OSError) as err:
        log.warning("%s: capacity planner could not read %s: %s", stage, location, err)
        return None
    log.info("%s: capacity plan: %s", stage, line)
    return line
