"""What sharding changes for a training stage: the strategy a launcher asks for and the one that ran, FSDP on CPU
processes, saving a model whose weights are spread over the processes (FSDP2, DeepSpeed ZeRO-3) with its LoRA
adapters merged, and running models outside the trainer under ZeRO-3.

The launcher config asks for a strategy (`requested_strategy`); accelerate decides what runs. On CPU processes it
silently fell back to plain data parallel for FSDP (`enable_fsdp_on_cpu` now stops that), so every manifest
records what the trainer's accelerator really did (`strategy`), and tests compare the two.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

from posttrain.config import RECIPES_DIR, RecipeError

log = logging.getLogger("posttrain")


SHARDED = ("fsdp1", "fsdp2", "zero3", "zero3_offload")  # each rank holds a shard of the weights


# --- what a launcher asks for ----------------------------------------------------------------------------------------
def launcher_config(launcher: str) -> Path | None:
    """The accelerate YAML `pipeline.launcher` names (recipes/accelerate/<name>.yaml or a path); None for single."""
    if launcher == "single":
        return None
    folder = RECIPES_DIR / "accelerate"
    named = not launcher.endswith((".yaml", ".yml")) and "/" not in launcher
    path = folder / f"{launcher}.yaml" if named else Path(launcher)
    if not path.is_file():
        names = sorted(p.stem for p in folder.glob("*.yaml"))
        raise RecipeError(f"pipeline.launcher '{launcher}': no accelerate config at {path}; give a name in {folder} "
                          f"({', '.join(names)}) or the path of an accelerate YAML")
    return path


def requested_strategy(launcher: str) -> str:
    """What `pipeline.launcher`'s accelerate YAML asks for, by the names `strategy` records: single, ddp, fsdp1,
    fsdp2, zero1, zero2, zero3 or zero3_offload (the ZeRO stage and offload read from its DeepSpeed JSON)."""
    import yaml

    path = launcher_config(launcher)
    if path is None:
        return "single"
    config = yaml.safe_load(path.read_text()) or {}
    kind = str(config.get("distributed_type", "NO"))
    if kind == "FSDP":
        return f"fsdp{(config.get('fsdp_config') or {}).get('fsdp_version', 1)}"
    if kind != "DEEPSPEED":
        return "single" if kind == "NO" else "ddp"
    deepspeed = config.get("deepspeed_config") or {}
    if deepspeed.get("deepspeed_config_file"):
        json_path = Path(deepspeed["deepspeed_config_file"])
        json_path = json_path if json_path.is_absolute() else RECIPES_DIR.parent / json_path
        try:
            zero = json.loads(json_path.read_text()).get("zero_optimization", {})
        except (OSError, json.JSONDecodeError) as err:
            raise RecipeError(f"{path}: cannot read its DeepSpeed config {json_path}: {err}") from None
        stage = zero.get("stage", 0)
        offloaded = any((zero.get(f"offload_{part}") or {}).get("device", "none") != "none"
                        for part in ("optimizer", "param"))
    else:
        stage = deepspeed.get("zero_stage", 0)
        offloaded = any(deepspeed.get(f"offload_{part}_device", "none") != "none" for part in ("optimizer", "param"))
    return f"zero{stage}" + ("_offload" if offloaded else "")


# --- what ran --------------------------------------------------------------------------------------------------------
def strategy(trainer) -> dict:
    """How the trainer distributed this run, read from its accelerator after training: a name in the launchers'
    terms ("single", "ddp", "zero2", "zero3", "zero3_offload", "fsdp2"), accelerate's distributed type and the
    details (ZeRO stage and offload devices, FSDP version)."""
    if trainer is None:
        return {"name": "single", "distributed_type": "NO", "processes": 1}
    state = trainer.accelerator.state
    out = {"distributed_type": state.distributed_type.value, "processes": state.num_processes}
    if trainer.is_deepspeed_enabled:
        plugin = state.deepspeed_plugin
        zero = plugin.deepspeed_config.get("zero_optimization", {})
        offload = {part: zero.get(f"offload_{part}", {}).get("device", "none") for part in ("optimizer", "param")}
        out.update(zero_stage=plugin.zero_stage, offload=offload)
        offloaded = any(device != "none" for device in offload.values())
        out["name"] = f"zero{plugin.zero_stage}" + ("_offload" if offloaded else "")
    elif trainer.is_fsdp_enabled:
        out.update(fsdp_version=state.fsdp_plugin.fsdp_version,
                   reshard_after_forward=bool(state.fsdp_plugin.reshard_after_forward))
        out["name"] = f"fsdp{state.fsdp_plugin.fsdp_version}"
    else:
        out["name"] = "ddp" if state.num_processes > 1 else "single"
    return out


def enable_fsdp_on_cpu() -> bool:
    """Let accelerate run FSDP on CPU processes (gloo), as a GPU run would; True when it was needed.

    accelerate turns a launch's FSDP settings (ACCELERATE_USE_FSDP) into DistributedType.FSDP only for GPU-like
    devices; on CPU processes it keeps MULTI_CPU and the model trains under plain DDP, with the FSDP config
    silently ignored. torch's `fully_shard` itself runs on CPU tensors with gloo, and accelerate's FSDP2 path
    (sharding, gathering, sharded checkpoints) has no device-specific step on CPU, so after accelerate builds
    its state we switch the type to FSDP (in PartialState too, as accelerate does on GPUs) and attach the plugin it
    was given. GPU runs are left untouched.
    """
    import os

    import torch

    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true" or torch.cuda.is_available():
        return False
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "posttrain_cpu_fsdp", False):
        return True
    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # every later AcceleratorState() copies PartialState's type over its own, as a GPU run's init sets it
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init.posttrain_cpu_fsdp = True
    AcceleratorState.__init__ = init
    log.info("FSDP on CPU processes: accelerate's state is switched from MULTI_CPU to FSDP")
    return True


# --- saving a sharded model ------------------------------------------------------------------------------------------
def is_sharded(trainer) -> bool:
    """True when each rank holds only a shard of the weights (FSDP, DeepSpeed ZeRO-3): saving needs a gather."""
    if trainer is None:
        return False
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    return bool(zero3 or trainer.is_fsdp_enabled)


def gather_state_dict(trainer) -> dict:
    """The trained model's full state dict, gathered from every rank's shard. A collective: every rank calls it;
    rank 0 gets the weights (on CPU), the others an empty or partial dict."""
    zero3 = trainer.is_deepspeed_enabled
    # DeepSpeed gathers through its engine (stage3_gather_16bit_weights_on_model_save); FSDP2 through the module
    return trainer.accelerator.get_state_dict(trainer.model_wrapped if zero3 else trainer.model)


def merge_lora(trainer, load_base, adapter_dir=None, check=None):
    """The trained PEFT model with its LoRA adapters merged, ready for `training.finish`; the adapter is saved to
    `adapter_dir` first when given (by rank 0). `check(peft_model)` may inspect the adapters before the merge.

    Weights whole on every rank (one process, DDP, ZeRO-1/2): each rank merges its own copy. Sharded (FSDP,
    ZeRO-3): peft's merge cannot run on the sharded modules (under ZeRO-3 each rank's weight is an empty
    placeholder, under FSDP2 a DTensor shard), so the whole PEFT model is gathered (a collective) and rank 0
    rebuilds it unsharded on a freshly loaded base (`load_base()`), loads the gathered weights (every key must
    match) and merges; the other ranks get None. The gathered dict holds the trained base weights too, so modules
    trained in full (`modules_to_save`, a reward model's score head) come back as trained.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    model = trainer.model
    if is_sharded(trainer):
        if main:
            model = rebuild_gathered_peft(trainer, load_base)
        else:
            gather_state_dict(trainer)  # this rank's part of the collective; rank 0 keeps the weights
            model = None
    if model is not None and check is not None:
        check(model)
    if model is not None and main and adapter_dir is not None:
        model.save_pretrained(adapter_dir)
    if distributed:
        dist.barrier()  # the adapter is on disk before any rank goes on
    return model.merge_and_unload() if model is not None else None


def rebuild_gathered_peft(trainer, load_base):
    """Rank 0's unsharded copy of the trainer's PEFT model, from the gathered weights (rank 0 of a collective)."""
    from peft import get_peft_model

    config = trainer.accelerator.unwrap_model(trainer.model).peft_config["default"]
    state = gather_state_dict(trainer)
    with loading_whole():
        model = get_peft_model(load_base(), config)
    expected = model.state_dict().keys()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise RuntimeError(f"LoRA merge after sharded training: the gathered weights do not fit the rebuilt model "
                           f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.load_state_dict(state, strict=True)
    return model


def whole_weights(model):
    """A context in which `model` can run forward outside the trainer. Under DeepSpeed ZeRO-3 a model loaded
    before training (transformers loads it under zero.Init) holds an empty placeholder per weight and none of the
    engine's gather hooks yet: every rank gathers the whole model for the duration (a collective; every rank must
    run the same forward passes inside). Anything else: the model as it is."""
    from contextlib import nullcontext

    params = list(model.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


@contextmanager
def loading_whole():
    """Models loaded inside are whole in this process, even under DeepSpeed ZeRO-3, where transformers would
    otherwise load them under zero.Init (partitioned across the ranks, and a collective every rank must join): a
    frozen scorer each rank runs on its own completions, or rank 0's base for a LoRA merge. transformers decides
    by a module-level reference to the trainer's DeepSpeed config; it is cleared for the duration and restored."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref  # no public getter returns the object itself
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
