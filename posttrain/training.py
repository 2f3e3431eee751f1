"""What every training stage shares: the stage directory's life cycle, TRL config construction, saving (resuming a
killed stage: posttrain.resume).

Under several processes (`torchrun` or `accelerate launch`) every rank runs the whole stage, but only rank 0
touches the stage directory: `begin` prepares it on rank 0 while the others wait at a barrier, `finish` saves the
model and writes the manifest on rank 0 after every rank has finished training, and everyone leaves `finish`
together so no rank reads a half-written artifact in the next stage.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from posttrain import sharding, tracking
from posttrain.artifacts import MANIFEST, now, sha256_json, write_manifest
from posttrain.models.loading import load_tokenizer, model_location
from posttrain.models.precision import resolve_bf16_auto
from posttrain.planner import PlannerError, load_config, plan_model, verdict_line

log = logging.getLogger("posttrain")
INTENT = ".config_hash"  # written when a stage starts: checkpoints of another config are stale
DDP_TIMEOUT_DEFAULT = 1800  # transformers' own default


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
    debug: dict = field(default_factory=dict)  # the recipe's `debug` group: test switches, outside the config hash

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


# --- processes: rank, barrier, timeout ------------------------------------------------------------------------------
def world_size() -> int:
    """Processes in this run, from the launcher's environment (torchrun / accelerate launch set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def ddp_timeout(trainer_block: dict | None = None) -> int:
    """Seconds a collective waits for a peer before failing: the recipe's trainer.ddp_timeout, else 1800."""
    if trainer_block and trainer_block.get("ddp_timeout") is not None:
        return int(trainer_block["ddp_timeout"])
    return DDP_TIMEOUT_DEFAULT


def init_distributed(trainer_block: dict | None = None) -> None:
    """Start the process group (gloo on CPU, NCCL on GPUs) with our timeout, before the trainer does.

    transformers starts it without a timeout when `use_cpu` is set, and keeps a group that already exists, so the
    timeout only holds if the group is made here first. One process: nothing to start.
    """
    if world_size() == 1:
        return
    quiet_other_ranks()
    sharding.enable_fsdp_on_cpu()
    if is_distributed_ready():
        return
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    cpu = bool((trainer_block or {}).get("use_cpu")) or not torch.cuda.is_available()
    PartialState(cpu=cpu, timeout=timedelta(seconds=ddp_timeout(trainer_block)))


def quiet_other_ranks() -> None:
    """Rank 0 tells the story (stage progress, the data check); the other ranks only warn."""
    if not is_main_process():
        log.setLevel(logging.WARNING)


def is_distributed_ready() -> bool:
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _process_group():
    """torch.distributed, once init_distributed has run. The collectives below call it directly rather than
    through PartialState: transformers resets PartialState when it builds TrainingArguments, and a PartialState
    rebuilt without cpu=True on a CPU machine reports no distribution and would skip the barrier silently."""
    import torch.distributed as dist

    if not is_distributed_ready():
        raise RuntimeError(f"rank {rank()} of {world_size()}: a collective before the process group was started "
                           "(posttrain.training.init_distributed)")
    return dist


def barrier() -> None:
    """Wait for every rank (a no-op in one process). Fails, rather than hangs, when a peer is dead."""
    if world_size() > 1:
        _process_group().barrier()


def from_main_process(value):
    """Rank 0's value on every rank (one process: the value)."""
    if world_size() == 1:
        return value
    box = [value]
    _process_group().broadcast_object_list(box, src=0)
    return box[0]


def gather_rows(rows: list) -> list:
    """Every rank's rows, in rank order (the order of the trainer's global batch); one process: the rows."""
    if world_size() == 1:
        return rows
    parts: list = [None] * world_size()
    _process_group().all_gather_object(parts, rows)
    return [row for part in parts for row in part]


# --- the stage directory ---------------------------------------------------------------------------------------------
def begin(run: StageRun) -> None:
    """Make the stage directory ready: an old manifest stops looking finished first; stale checkpoints go.
    Rank 0 does it; the others wait, so no rank sees a half-prepared directory."""
    init_distributed(run.config.get(run.name, {}).get("trainer"))
    if is_main_process():
        run.out_dir.mkdir(parents=True, exist_ok=True)
        (run.out_dir / MANIFEST).unlink(missing_ok=True)
        intent = run.out_dir / INTENT
        if intent.exists() and intent.read_text().strip() != run.config_hash:
            log.info("%s: config or parent changed since the last attempt; discarding its checkpoints", run.name)
            shutil.rmtree(run.checkpoints, ignore_errors=True)
        shutil.rmtree(run.model_dir, ignore_errors=True)
        intent.write_text(run.config_hash)
    barrier()


def open_stage(cfg, run: StageRun, config_class: str, seq_len=None):
    """A training stage's first steps, in order: its directory made ready (`begin`), TRL's `config_class` from the
    stage's `trainer` block, the parent's location and tokenizer, the capacity plan logged, the torch seed set.
    `seq_len(args)` gives the planned sequence length where it is not `max_length` (GRPO's prompt + completion).
    Returns (args, location, tokenizer)."""
    import torch

    begin(run)
    block = cfg[run.name]
    args = trl_args(config_class, block.trainer, run, cfg.tracking, cfg.seed)
    location = model_location(cfg.model, run.parent)
    tokenizer = load_tokenizer(location)
    log_stage_plan(run.name, location, block, args, seq_len(args) if seq_len else None)
    torch.manual_seed(cfg.seed)
    return args, location, tokenizer


def trl_args(class_name: str, trainer_block, run: StageRun, tracking_cfg, seed: int):
    """A TRL config from the recipe's trainer block (TRL's own field names) plus where to write and log.

    `seed` is the run's seed (the root `seed` key): one override reseeds every stage's trainer (initialisation,
    data order, sampling); a trainer block that names its own `seed` keeps it.
    """
    import trl

    kwargs = OmegaConf.to_container(trainer_block, resolve=True) if not isinstance(trainer_block, dict) else dict(trainer_block)
    if kwargs.get("bf16") == "auto":
        resolve_bf16_auto(kwargs)
    kwargs.setdefault("seed", seed)
    kwargs.setdefault("output_dir", str(run.checkpoints))
    kwargs["report_to"] = tracking.report_to(tracking_cfg)
    kwargs.setdefault("run_name", f"{run.run_name}/{run.name}")
    kwargs.setdefault("save_strategy", "steps")
    kwargs["ddp_timeout"] = ddp_timeout(kwargs)
    return getattr(trl, class_name)(**kwargs)


def lora_config(lora_block, **fixed):
    """peft's LoraConfig from a stage's `lora:` block (peft's own field names), or None when the block is null (the
    stage trains its weights). `fixed` adds what the stage sets itself, such as the reward model's task type."""
    if lora_block is None:
        return None
    from peft import LoraConfig

    return LoraConfig(**fixed, **OmegaConf.to_container(lora_block, resolve=True))


def train_metrics(trainer) -> dict:
    """Loss at the first and last logging step, and the trainer's own summary."""
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "global_step": trainer.state.global_step,
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        "log_history": [h for h in trainer.state.log_history if "loss" in h or "train_runtime" in h],
    }


def save_model(model, tokenizer, run: StageRun, state_dict: dict | None = None) -> None:
    """Write model/ (safetensors, config, tokenizer with its chat template) for the artifact; `state_dict`: the
    gathered weights of a sharded model (see full_state_dict)."""
    if state_dict is not None:  # gathered copies no longer share storage: drop tied duplicates as save would
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            if source in state_dict and target in state_dict:
                del state_dict[target]
    model.save_pretrained(run.model_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(run.model_dir)


def full_state_dict(trainer, model) -> dict | None:
    """Under FSDP or DeepSpeed ZeRO-3 each rank holds a shard of the trainer's weights: gather one full state dict
    (a collective, so every rank calls it; rank 0 gets the weights). None when `model` is whole where it is saved
    (one process, DDP, ZeRO-1/2, or LoRA adapters merged by sharding.merge_lora): the model saves its own."""
    if model is None or trainer is None or model is not trainer.model or not sharding.is_sharded(trainer):
        return None
    return sharding.gather_state_dict(trainer)


def drop_checkpoints(run: StageRun) -> None:
    """Trainer checkpoints only serve resume; the finished artifact is model/."""
    shutil.rmtree(run.checkpoints, ignore_errors=True)


def shared_dataset(dataset, run: StageRun, name: str):
    """Under several processes, the dataset saved once (rank 0) under checkpoints/ and read back by every rank.

    TRL's DPO caches the precomputed reference log-probabilities next to the dataset's files and has rank 0
    write that cache for the others to read; an in-memory dataset's cache lives in a temporary folder of each
    process, where the other ranks cannot find it. One process: the dataset as it is.
    """
    if world_size() == 1:
        return dataset
    from datasets import load_from_disk

    path = run.checkpoints / f"dataset-{name}"  # goes with the checkpoints when the stage finishes
    if is_main_process():
        shutil.rmtree(path, ignore_errors=True)
        dataset.save_to_disk(str(path))
    barrier()
    return load_from_disk(str(path))


def save_adapter(model, run: StageRun) -> None:
    """LoRA adapters to <stage>/adapter (rank 0), readable by every rank once this returns."""
    if is_main_process():
        model.save_pretrained(run.out_dir / "adapter")
    barrier()


def finish(run: StageRun, model, tokenizer, *, datasets: list[dict], metrics: dict, extra: dict,
           trainer=None) -> dict:
    """Save model/, drop the trainer checkpoints, then write the manifest last: the stage is now an artifact.

    Only rank 0 writes, after every rank has finished training (a rank that died never gets here, so neither
    does the manifest); every rank leaves together, so the next stage never reads a half-written artifact.
    `trainer` lets a sharded model (FSDP, ZeRO-3) be gathered before rank 0 saves it; after a sharded LoRA merge
    the merged model exists on rank 0 only and the other ranks pass None.
    """
    state_dict = full_state_dict(trainer, model)
    if model is not None and (state_dict or not sharding.is_sharded(trainer) or model is not trainer.model):
        write_weight_digest(model, run, state_dict)  # sharded: rank 0, from the gathered weights
    barrier()
    if is_main_process():
        device = str(next(model.parameters()).device)  # where the weights were trained (cpu, cuda:0, ...)
        save_model(model, tokenizer, run, state_dict)
        write_artifact(run, datasets=datasets, metrics=metrics,
                       extra={"device": device, "processes": world_size(), "strategy": sharding.strategy(trainer),
                              **extra})
    barrier()
    return metrics


def write_artifact(run: StageRun, *, datasets: list[dict], metrics: dict, extra: dict, stage: str | None = None) -> None:
    """With model/ written: drop the trainer checkpoints, then write the manifest, last, which makes the stage
    directory an artifact (a stage that stops before this leaves no manifest, so it is never read as finished)."""
    drop_checkpoints(run)
    write_manifest(run.out_dir, stage=stage or run.name, parent=run.parent, config=run.config,
                   config_hash=run.config_hash, datasets=datasets, metrics=metrics, started_at=run.started_at,
                   extra=extra)


# --- test hooks ------------------------------------------------------------------------------------------------------
def write_weight_digest(model, run: StageRun, state_dict: dict | None = None) -> None:
    """Test hook: with `debug.weight_digest_dir` set, every rank writes the sha256 of its final weights (names,
    shapes and bytes in name order) to <dir>/<stage>.rank<r>.sha256, so a test can see that the ranks agree."""
    target = run.debug.get("weight_digest_dir")
    if not target:
        return
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted((state_dict or model.state_dict()).items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype}".encode())
        digest.update(data.view(-1).view(torch.uint8).numpy().tobytes())
    Path(target).mkdir(parents=True, exist_ok=True)
    (Path(target) / f"{run.name.replace(':', '-')}.rank{rank()}.sha256").write_text(digest.hexdigest())


def install_test_hooks(trainer, run: StageRun) -> None:
    """Test hook: with `debug.fault.rank` set, that rank raises when it starts training step `debug.fault.step` (of
    stage `debug.fault.stage`, or of every stage), as a crashed process would. Nothing is added otherwise."""
    fault = run.debug.get("fault") or {}
    if fault.get("rank") is None or fault.get("stage") not in (None, run.name):
        return
    from transformers import TrainerCallback

    class FaultInjection(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            # global_step counts finished steps: step N begins when N - 1 are done
            if rank() == fault["rank"] and state.global_step + 1 == fault["step"]:
                raise RuntimeError(f"debug.fault: injected failure in rank {rank()} at step {fault['step']} "
                                   f"of {run.name}")

    trainer.add_callback(FaultInjection())


def launcher_strategy() -> str:
    """The planner's name for how `accelerate launch` shards this run: ZeRO stage from DeepSpeed, FSDP as ZeRO-3
    (it shards weights, gradients and optimizer states alike), else DDP."""
    import os

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return f"zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "zero3"
    return "ddp"


def log_stage_plan(stage: str, location, block, args, seq_len: int | None = None) -> str | None:
    """`log_capacity_plan` for a training stage: the method (full, lora or qlora) and LoRA rank from the stage's
    recipe block, the micro-batch from its trainer arguments, the sequence length from `max_length` unless given."""
    lora = block.get("lora")
    method = "qlora" if block.get("qlora") else ("lora" if lora is not None else "full")
    return log_capacity_plan(stage, location, method=method,
                             seq_len=seq_len if seq_len is not None else args.max_length,
                             micro_batch=args.per_device_train_batch_size,
                             lora_rank=lora.get("r") if lora is not None else None)


def log_capacity_plan(stage: str, location, *, method: str, seq_len: int | None, micro_batch: int,
                      lora_rank: int | None = None) -> str | None:
    """On a GPU box, the capacity planner's verdict for this stage's model, method and launcher, logged before the
    model loads (on CPU: nothing). A config the planner cannot read is a warning, never a failed stage."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None

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
