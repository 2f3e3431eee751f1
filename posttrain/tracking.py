"""Experiment tracking: `tracking=wandb` logs each stage as a W&B run grouped by the pipeline run.

Without WANDB_API_KEY (or with mode=offline) W&B runs offline and its files land under the run directory, to be
synced later with `wandb sync`. `tracking=none` logs nothing. The trainers log through transformers' own
WandbCallback, which reads the WANDB_* variables set here.
"""

from __future__ import annotations

import os
from pathlib import Path


def report_to(tracking_cfg) -> list[str]:
    if tracking_cfg.backend == "none":
        return []
    if tracking_cfg.backend == "wandb":
        return ["wandb"]
    raise ValueError(f"tracking.backend '{tracking_cfg.backend}' is not one of none, wandb")


def configure(tracking_cfg, run_dir: Path, run_name: str, stage: str) -> None:
    """Set the W&B environment for one stage; a no-op for tracking=none."""
    if tracking_cfg.backend != "wandb":
        os.environ["WANDB_DISABLED"] = "true"
        return
    os.environ.pop("WANDB_DISABLED", None)
    mode = tracking_cfg.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    os.environ["WANDB_MODE"] = mode
    os.environ["WANDB_DIR"] = str(Path(run_dir).resolve())
    os.environ["WANDB_PROJECT"] = tracking_cfg.project
    os.environ["WANDB_RUN_GROUP"] = run_name
    os.environ["WANDB_NAME"] = f"{run_name}/{stage}"
    os.environ["WANDB_JOB_TYPE"] = stage
    os.environ.setdefault("WANDB_SILENT", "true")
    if tracking_cfg.entity:
        os.environ["WANDB_ENTITY"] = tracking_cfg.entity
