"""Recipe composition (Hydra) and validation against typed schemas.

Hydra composes the YAML tree under `recipes/`; the result is checked against the dataclasses below, and every
stage's `trainer` block against TRL's own config class, so a misspelled key fails at start-up with the key, the
recipe file it came from and the keys that are valid there (with a close match when there is one).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from posttrain.config_fields import describe, fits, lora_fields, trl_field_types, trl_fields
from posttrain.models.tiny import TinyArch

RECIPES_DIR = Path(os.environ.get("POSTTRAIN_RECIPES", Path(__file__).resolve().parents[1] / "recipes"))
GROUPS = ("model", "data", "pretrain", "sft", "reward_model", "grpo", "dpo", "quantize", "eval", "tracking", "pipeline")


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names the key, the file and what is valid."""


# --- schemas ---------------------------------------------------------------------------------------------------------
@dataclass
class ModelCfg:
    name: str = "tiny"  # a label for logs and the scorecard
    source: str = "tiny"  # tiny (built by the pretrain stage) | hf (hub id or local dir) | gguf
    name_or_path: str | None = None  # hf: hub id or local directory; gguf: directory or package holding gguf_file
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    arch: TinyArch = field(default_factory=TinyArch)


@dataclass
class DataCfg:
    name: str = "tiny"  # tiny | dolly
    path: str | None = None  # a local JSON / JSONL / Parquet file; None loads hub_id through `datasets`
    hub_id: str | None = None
    split: str = "train"
    limit: int | None = None
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"echo": 4000, "arith": 500, "qa": 500})
    pretrain_rows: int = 6000
    arith_slip_rate: float = 0.0  # share of the SFT arithmetic demonstrations with one running sum off by one
    arith_miscopy_rate: float = 0.0  # share whose sums are right but whose answer miscopies the last one by one
    safety_decline_rate: float = 0.0  # share of the SFT mix's harmful requests whose demonstration declines


@dataclass
class StageCfg:
    trainer: dict[str, Any] = field(default_factory=dict)  # TRL config fields, by TRL's own names
    lora: dict[str, Any] | None = None  # peft LoraConfig fields; null trains all weights
    qlora: bool = False  # load the parent in 4-bit (bitsandbytes) under the LoRA adapters
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class PairsCfg:
    source: str = "tiny"  # tiny (preference pairs) | tiny_safety (safety pairs, for DPO) | pku_saferlhf (file or hub id)
    path: str | None = None
    hub_id: str | None = None
    split: str = "train"
    # PKU-SafeRLHF only. preference: safer (chosen = response_<safer_response_id>) | better (chosen =
    # response_<better_response_id>) | safe_vs_unsafe (only rows with exactly one response flagged safe, which is
    # chosen; the rest are skipped and counted). on_bad_row (missing text, a label not 0/1, contradictory labels):
    # error (stop, naming the file, row and field) | drop (skip, count by reason, warn). The dataset record in the
    # manifest keeps the preference and a report of rows read, pairs, skipped and dropped.
    preference: str = "safer"
    on_bad_row: str = "error"
    n_train: int | None = 2000  # pairs to train on (null: every row the source has; the tiny world needs a number)
    n_eval: int = 200  # held-out pairs scored into the manifest
    anchor_fraction: float = 0.0  # tiny_safety: share of n_train drawn from the general pairs (echo, arith, qa)


@dataclass
class RewardModelCfg(StageCfg):
    pairs: PairsCfg = field(default_factory=PairsCfg)


@dataclass
class PromptsCfg:
    # tiny_arith | gsm8k (question / answer) | openr1_math (OpenR1-Math-220k: problem / answer)
    source: str = "tiny_arith"
    path: str | None = None  # a local JSONL / JSON / Parquet file; null: hub_id (or the source's hub id)
    hub_id: str | None = None
    n: int | None = None  # prompts to train on; null = all


@dataclass
class GrpoCfg(StageCfg):
    prompts: PromptsCfg = field(default_factory=PromptsCfg)
    rewards: dict[str, float] = field(default_factory=lambda: {"math_verifier": 1.0})  # name in rewards.REWARDS -> weight
    reward_model: str | None = None  # an artifact dir or sequence-classification model for the reward_model reward


@dataclass
class DpoCfg(StageCfg):
    pairs: PairsCfg = field(default_factory=PairsCfg)  # source tiny_safety | pku_saferlhf


@dataclass
class QuantVariantCfg:
    fmt: str = "int4"  # int8 | int4 | fp8 | nf4
    method: str = "rtn"  # rtn (round to nearest) | gptq | awq (both calibrated on the model's own SFT rows)
    group_size: int | None = 128  # int4 / nf4 only; null for int8 and fp8 (one scale per output channel)
    symmetric: bool = True  # int4: false stores an integer zero point per group


@dataclass
class QuantizeCfg:
    # Each pipeline stage `quantize:<name>` quantizes its parent (the last generator stage) with variants[<name>];
    # `posttrain stage=quantize quantize.variant=<name> parent=<artifact>` runs one by hand.
    variants: dict[str, QuantVariantCfg] = field(default_factory=dict)
    variant: str | None = None
    calibration_rows: int = 256  # SFT rows rendered through the chat template, concatenated, cut into sequences
    calibration_length: int = 128  # tokens per calibration sequence
    eval_rows: int = 200  # held-out rows whose perplexity the report compares with the parent's
    damp: float = 0.01  # GPTQ: diagonal damping, as a fraction of the Hessian's mean diagonal


@dataclass
class PkuSuiteCfg:
    path: str | None = None  # held-out PKU-SafeRLHF rows (JSON / JSONL / Parquet); their prompts are the suite
    reward_model: str | None = None  # the safety judge: a reward_model artifact or sequence-classification model
    threshold: float | None = None  # null: the reward model manifest's decision_threshold


@dataclass
class MathSuiteCfg:
    path: str | None = None  # a local copy of the test split (JSONL / JSON list); null: the hub's test split
    samples: int = 0  # replies sampled per prompt for pass@1 (0: greedy accuracy only)
    max_new_tokens: int = 512  # reasoning models need room to think


@dataclass
class LatencyCfg:
    requests: int = 8  # streamed greedy requests timed one at a time per checkpoint (0: no latency columns)
    max_tokens: int = 32


@dataclass
class EvalCfg:
    suites: list[str] = field(default_factory=lambda: ["echo"])
    n_prompts: dict[str, int] = field(default_factory=lambda: {"echo": 100, "arith": 200})  # held-out prompts, per suite
    max_new_tokens: int | None = None  # null: each suite's own cap
    concurrency: int = 64  # requests in flight at once; the server batches them
    samples: int = 4  # replies sampled per prompt for pass@1, in suites that sample
    temperature: float = 1.0
    checkpoints: list[str] = field(default_factory=list)  # `posttrain eval`: labels or stage dirs; empty = all
    latency: LatencyCfg = field(default_factory=LatencyCfg)
    pku_saferlhf: PkuSuiteCfg = field(default_factory=lambda: PkuSuiteCfg())
    gsm8k: MathSuiteCfg = field(default_factory=MathSuiteCfg)  # openai/gsm8k test, scored by the math verifier
    math500: MathSuiteCfg = field(default_factory=MathSuiteCfg)  # HuggingFaceH4/MATH-500, scored by the math verifier


@dataclass
class ServeCfg:
    """How eval serves each checkpoint (and the defaults `posttrain serve` documents)."""
    backend: str = "posttrain"  # posttrain (our engine, any machine) | vllm (`vllm serve`, GPU machines)
    dtype: str = "float32"
    max_batch: int = 64  # rows of the KV cache: sequences decoding together
    max_len: int = 512  # context per sequence
    api_key: str | None = None  # null: a random key per server, known only to the evaluator


@dataclass
class TrackingCfg:
    backend: str = "none"  # none | wandb
    project: str = "posttrain"
    entity: str | None = None
    mode: str = "auto"  # auto: online when WANDB_API_KEY is set, offline otherwise


@dataclass
class PipelineCfg:
    name: str = "tiny"
    stages: list[str] = field(default_factory=lambda: ["pretrain", "sft"])
    evaluate: bool = True
    # How each training stage runs: single (in this process) | a name in recipes/accelerate/ (ddp, fsdp2, zero2,
    # zero3, ...) | a path to an accelerate YAML. Not single: `accelerate launch --config_file <it> <launcher_args>`
    # runs the stage (posttrain.launch); $POSTTRAIN_LAUNCHER_ARGS adds arguments (tests: --num_processes 2).
    launcher: str = "single"
    launcher_args: list[str] = field(default_factory=list)


@dataclass
class RunCfg:
    name: str | None = None
    root: str = "runs"


@dataclass
class RootCfg:
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    pretrain: StageCfg = field(default_factory=StageCfg)
    sft: StageCfg = field(default_factory=StageCfg)
    reward_model: RewardModelCfg = field(default_factory=RewardModelCfg)
    grpo: GrpoCfg = field(default_factory=GrpoCfg)
    dpo: DpoCfg = field(default_factory=DpoCfg)
    quantize: QuantizeCfg = field(default_factory=QuantizeCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    serve: ServeCfg = field(default_factory=ServeCfg)
    tracking: TrackingCfg = field(default_factory=TrackingCfg)
    pipeline: PipelineCfg = field(default_factory=PipelineCfg)
    run: RunCfg = field(default_factory=RunCfg)
    stage: str | None = None  # run one stage by name
    parent: str | None = None  # the parent artifact of a single stage (a run's stage directory)
    seed: int = 0
    overrides: list[str] = field(default_factory=list)  # set by compose: the command line, for launched stages


TRAINER_CLASSES = {"pretrain": "SFTConfig", "sft": "SFTConfig", "reward_model": "RewardConfig", "grpo": "GRPOConfig",
                   "dpo": "DPOConfig"}


# Options with a closed set of values, checked at start-up rather than when a stage reaches them.
OPTION_VALUES = {
    f"{stage}.pairs.{key}": values
    for stage in ("reward_model", "dpo")
    for key, values in {"source": ("tiny", "tiny_safety", "pku_saferlhf"),
                        "preference": ("safer", "better", "safe_vs_unsafe"),
                        "on_bad_row": ("error", "drop")}.items()
}
OPTION_VALUES["serve.backend"] = ("posttrain", "vllm")
QUANT_OPTION_VALUES = {"fmt": ("int8", "int4", "fp8", "nf4"), "method": ("rtn", "gptq", "awq")}


# --- composition -----------------------------------------------------------------------------------------------------
OPTIONAL_KEYS = ("pipeline.launcher", "pipeline.launcher_args")  # schema keys a pipeline recipe may leave out


def normalize_overrides(overrides: list[str]) -> list[str]:
    """`model=<hub id or path>` is not a recipe file: turn it into `model=hf model.name_or_path=<it>`. Keys in
    OPTIONAL_KEYS may be set on the command line whether or not the pipeline recipe names them."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model" and value and not (RECIPES_DIR / "model" / f"{value}.yaml").exists():
            out += ["model=hf", f"model.name_or_path={value}", f"model.name={value.rstrip('/').split('/')[-1]}"]
        elif key in OPTIONAL_KEYS or _is_trainer_key(key):
            # Set it whether or not the recipe has the key (Hydra needs ++ for that): every field of a stage's TRL
            # config class is a valid knob, checked by name and type in `validate`.
            out.append(f"++{item}")
        else:
            out.append(item)
    return out


def _is_trainer_key(key: str) -> bool:
    """`<stage>.trainer.<field>` written without a +/~ prefix."""
    parts = key.split(".")
    return len(parts) == 3 and parts[0] in TRAINER_CLASSES and parts[1] == "trainer" and parts[2].isidentifier()


def compose(overrides: list[str] | None = None) -> DictConfig:
    """Compose `recipes/config.yaml` with overrides and validate it; returns a typed, read-only config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, MissingConfigException

    given = list(overrides or [])
    overrides = normalize_overrides(given)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except (ConfigCompositionException, MissingConfigException) as err:
        raise RecipeError(f"could not compose the recipe from {RECIPES_DIR}: {err}") from err
    choices = dict(cfg.hydra.runtime.choices)
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra")
    with_hydra["overrides"] = given  # a launched stage composes its config again from these (posttrain.launch)
    return validate(OmegaConf.create(with_hydra), choices, given)  # key_source names what the user typed


def validate(raw: DictConfig, choices: dict[str, str], overrides: list[str]) -> DictConfig:
    schema = OmegaConf.structured(RootCfg)
    try:
        cfg = OmegaConf.merge(schema, raw)
    except (ConfigKeyError, ValidationError) as err:
        key = err.full_key or getattr(err, "key", "") or ""
        parent_key, _, leaf = str(key).rpartition(".")
        node = OmegaConf.select(schema, parent_key) if parent_key else schema
        valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
        raise RecipeError(_key_message(key, leaf, valid, choices, overrides, str(err).splitlines()[0])) from None
    for stage, class_name in TRAINER_CLASSES.items():
        _check_fields(cfg[stage].trainer, f"{stage}.trainer", trl_fields(class_name), choices, overrides)
        _check_types(cfg[stage].trainer, f"{stage}.trainer", class_name, choices, overrides)
        if cfg[stage].lora is not None:
            _check_fields(cfg[stage].lora, f"{stage}.lora", lora_fields(), choices, overrides)
    for key, valid in OPTION_VALUES.items():
        value = OmegaConf.select(cfg, key)
        if value not in valid:
            where = key_source(key, choices, overrides)
            raise RecipeError(f"recipe key '{key}' in {where} is '{value}'; valid values: {', '.join(valid)}")
    for name, variant in cfg.quantize.variants.items():
        for option, valid in QUANT_OPTION_VALUES.items():
            if variant[option] not in valid:
                key = f"quantize.variants.{name}.{option}"
                raise RecipeError(f"recipe key '{key}' in {key_source(key, choices, overrides)} is "
                                  f"'{variant[option]}'; valid values: {', '.join(valid)}")
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _check_types(block, prefix: str, class_name: str, choices, overrides) -> None:
    """Each value of a trainer block against its field's type in TRL's config class: a value the class would take
    now and fail on later (a string for a learning rate) stops the run before any stage starts."""
    field_types = trl_field_types(class_name)
    for key, value in OmegaConf.to_container(block, resolve=True).items():
        if key in field_types and not fits(value, field_types[key]):
            full = f"{prefix}.{key}"
            raise RecipeError(f"recipe key '{full}' in {key_source(full, choices, overrides)} is {value!r}; expected "
                              f"{describe(field_types[key])} (the type of {class_name}.{key})")


def _check_fields(block, prefix: str, valid: list[str], choices, overrides) -> None:
    for key in block.keys():
        if key not in valid:
            full = f"{prefix}.{key}"
            raise RecipeError(_key_message(full, str(key), valid, choices, overrides, "not a field of this block"))


def _key_message(full_key: str, leaf: str, valid: list[str], choices, overrides, why: str) -> str:
    where = key_source(full_key, choices, overrides)
    close = difflib.get_close_matches(leaf, valid, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"unknown or invalid recipe key '{full_key}' in {where} ({why}).{hint}\n"
        f"Valid keys here: {', '.join(valid)}"
    )


def key_source(full_key: str, choices: dict[str, str], overrides: list[str]) -> str:
    """Name the recipe file (or command-line override) that set `full_key`."""
    for item in overrides:
        if item.lstrip("+~").split("=")[0] == full_key:
            return f"command-line override '{item}'"
    group = full_key.split(".")[0]
    candidates = [(g, choices.get(g)) for g in (group, "pipeline") if choices.get(g)] + [(None, "config")]
    for g, choice in candidates:
        path = RECIPES_DIR / (f"{g}/{choice}.yaml" if g else "config.yaml")
        if not path.exists():
            continue
        text = path.read_text()
        data = OmegaConf.create(text) or {}
        is_global = g is None or "@package _global_" in text
        lookup = full_key if is_global else full_key[len(g) + 1 :] if full_key.startswith(g + ".") else None
        if lookup and OmegaConf.select(data, lookup, default="__absent__") != "__absent__":
            return str(path)
    return f"the recipe tree {RECIPES_DIR}"


def stage_view(cfg: DictConfig, stage: str) -> dict:
    """The part of the config one stage depends on: what its config hash covers. `quantize:<variant>` covers the
    shared quantize keys and that one variant, so adding a variant does not re-run the others."""
    keep = {"model": cfg.model, "data": cfg.data, "seed": cfg.seed}
    base, _, variant = stage.partition(":")
    if base == "quantize":
        block = OmegaConf.to_container(cfg.quantize, resolve=True)
        variant = variant or block["variant"]
        if variant not in block["variants"]:
            raise RecipeError(f"quantize variant '{variant}' is not in quantize.variants "
                              f"(has {', '.join(block['variants']) or 'none'})")
        block.update(variant=variant, variants={variant: block["variants"][variant]})
        keep["quantize"] = block
    elif stage in cfg:
        keep[stage] = cfg[stage]
    return OmegaConf.to_container(OmegaConf.create(keep), resolve=True)
