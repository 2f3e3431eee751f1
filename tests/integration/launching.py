"""What the multi-process tests share: the tiny base they all train from, the four training stages with a small
batch and a loss at every step, and how to read a finished stage (its losses, its weights, its timing).

A run in one process with a batch of 2B and a run of two processes with B each see the same global batch, so
their losses agree step for step (test_distributed.py and test_sharded_launchers.py state the tolerances).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, cli_env, posttrain

B = 4  # rows (GRPO: completions x 2) per process and step; the one-process reference takes twice as many
STEPS = 4
STAGES = ("sft", "reward_model", "dpo", "grpo")
DIRS = {stage: f"{i:02d}-{stage}" for i, stage in enumerate(STAGES)}
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-3  # |w_two - w_one| / |w_one - w_parent|
LORA = "sft.lora={r:8,lora_alpha:16,lora_dropout:0.0,target_modules:all-linear,task_type:CAUSAL_LM}"


def pipeline_args(root: Path, name: str, base: Path, per_device: int, stages=STAGES) -> list[str]:
    """The training stages on `base`, STEPS steps each, a loss logged every step."""
    args = ["run", "pipeline=tiny-ci", f"pipeline.stages=[{','.join(stages)}]", "pipeline.evaluate=false",
            f"parent={base}", f"run.root={root}", f"run.name={name}"]
    for stage in stages:
        batch = 2 * per_device if stage == "grpo" else per_device  # GRPO: 4 generations of 2 prompts per process
        # ddp_timeout: a peer that died fails the stage within a minute rather than transformers' 30
        args += [f"{stage}.trainer.max_steps={STEPS}", f"{stage}.trainer.logging_steps=1",
                 f"{stage}.trainer.ddp_timeout=60", f"{stage}.trainer.per_device_train_batch_size={batch}",
                 f"{stage}.trainer.save_steps=100"]
    if "dpo" in stages:  # plain sigmoid loss (test_distributed.py says why); the reference pass covers 64 pairs
        args += ["dpo.trainer.loss_type=[sigmoid]", "dpo.trainer.loss_weights=[1.0]", "dpo.pairs.n_train=64",
                 "dpo.pairs.n_eval=16"]
    if "reward_model" in stages:
        args += ["reward_model.pairs.n_eval=16"]
    return args


def launcher_args(launcher: str, processes: int = 2) -> list[str]:
    """`pipeline.launcher=<launcher>` on `processes` CPU processes: the configs' GPU settings overridden as the
    README says (process count, no bf16 autocast), on a free rendezvous port."""
    return [f"pipeline.launcher={launcher}",
            f"pipeline.launcher_args=[--num_processes,{processes},--mixed_precision,no,--main_process_port,"
            f"{free_port()}]"]


def torchrun(*args: str, timeout: float, **env) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 -m posttrain ARGS` (standalone: a free rendezvous port)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "posttrain", *args]
    return subprocess.run(command, cwd=REPO, env=cli_env(**env), capture_output=True, text=True, timeout=timeout)


def pretrain_base(root: Path) -> Path:
    result = posttrain("stage=pretrain", "pipeline=tiny-ci", "pretrain.trainer.max_steps=4", "data.pretrain_rows=200",
                       f"run.root={root}", "run.name=b", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "b" / "00-pretrain"


def manifest(stage_dir: Path) -> dict:
    return json.loads((stage_dir / "manifest.json").read_text())


def losses(stage_dir: Path) -> list[float]:
    return [h["loss"] for h in manifest(stage_dir)["metrics"]["log_history"] if "loss" in h]


def largest_loss_difference(one: list[float], two: list[float]) -> float:
    """max over steps of |one - two| / |one|."""
    assert len(one) == len(two) == STEPS, (one, two)
    return max(abs(a - b) / abs(a) for a, b in zip(one, two))


def weights(stage_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(stage_dir / "model" / "model.safetensors")


def weight_distance(a: dict, b: dict, keys=None) -> float:
    """L2 distance over every tensor the two state dicts share (or `keys`)."""
    keys = [k for k in a if k in b] if keys is None else keys
    return sum(((a[k] - b[k]).double() ** 2).sum().item() for k in keys) ** 0.5


def stage_seconds(log: str) -> dict[str, float]:
    """Each stage's wall time from the pipeline's own "<stage>: done in N s" lines."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"\] (\w+): done in ([\d.]+) s", log)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
