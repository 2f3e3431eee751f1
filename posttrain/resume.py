"""Resuming a killed training stage: which trainer checkpoint to take up, the per-step logs to cut back to it, and
the `trainer.train` call every stage makes.

A stage directory's `checkpoints/` holds transformers' `checkpoint-<N>` folders (N is the global step they were
saved after). A stage whose config and parent are unchanged resumes from the newest complete one (see
posttrain.training.begin, which discards the checkpoints of another config).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("posttrain")


def last_checkpoint(run) -> str | None:
    """The newest *complete* trainer checkpoint of a stage run (anything with `checkpoints` and `name`), or None.

    transformers writes trainer_state.json last in a checkpoint, so a checkpoint without a readable one was cut
    short by a kill; its own `get_last_checkpoint` would pick it by number alone and resume would crash.
    """
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


def checkpoint_step(checkpoint: str) -> int:
    """The global step a `checkpoint-<N>` directory was saved at."""
    return int(str(checkpoint).rstrip("/").rsplit("-", 1)[-1])


def cut_step_rows(path: Path, step: int) -> int:
    """Cut a per-step JSONL log (rows with a "step") back to before `step`, atomically; returns the rows dropped.

    A stage resumed from checkpoint-N redoes step N onward; what the killed attempt wrote for those steps would
    otherwise be there twice.
    """
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and (json.loads(line).get("step") or 0) < step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def train_from_checkpoint(trainer, run, resume: str | None = None) -> str | None:
    """`trainer.train`, from the run's newest complete checkpoint (or `resume`, when the stage already looked it
    up); returns the checkpoint it started from, None on a fresh start.

    A checkpoint saved at the last step (`max_steps`; a run killed while it saved the model) has nothing left to
    train, but transformers' loop checks `max_steps` only after a step, so `train()` would run one more update than
    the recipe asks for. Then the checkpoint's weights and trainer state are loaded and no step runs.
    """
    resume = resume or last_checkpoint(run)
    if resume:
        log.info("%s: resuming from %s", run.name, resume)
    max_steps = trainer.args.max_steps
    at_end = resume is not None and 0 < max_steps <= checkpoint_step(resume)
    # DeepSpeed and FSDP load a checkpoint into the prepared (wrapped) model, inside train() only
    sharded = getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)
    if at_end and sharded:
        log.warning("%s: %s is at max_steps (%d); under DeepSpeed / FSDP transformers resumes by training one more "
                    "step", run.name, resume, max_steps)
    elif at_end:
        from transformers.trainer_callback import TrainerState

        log.info("%s: %s is at max_steps (%d): loading it, no step left to train", run.name, resume, max_steps)
        trainer._load_from_checkpoint(resume)  # what train(resume_from_checkpoint=...) calls first
        trainer.state = TrainerState.load_from_json(os.path.join(resume, "trainer_state.json"))
        return resume
    trainer.train(resume_from_checkpoint=resume)
    return resume
