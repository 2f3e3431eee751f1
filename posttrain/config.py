"""Recipe composition (Hydra) and validation against typed schemas.

Hydra composes the YAML tree under `recipes/`; the result is checked against the dataclasses of
posttrain.config_schema, and every stage's `trainer` block against TRL's own config class, by name and type, so a
misspelled key or a wrong value fails at start-up with the key, the recipe file or override it came from and the
keys that are valid there (with a close match when there is one).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from posttrain.config_fields import describe, fits, lora_fields, trl_field_types, trl_fields
from posttrain.config_schema import GGUF_TYPES, OPTION_VALUES, QUANT_OPTION_VALUES, TRAINER_CLASSES, RootCfg
from posttrain.registry import parse

RECIPES_DIR = Path(os.environ.get("POSTTRAIN_RECIPES", Path(__file__).resolve().parents[1] / "recipes"))
GROUPS = ("model", "data", "pretrain", "sft", "reward_model", "grpo", "dpo", "quantize", "eval", "tracking", "pipeline")


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names the key, the file and what is valid."""


# --- composition -----------------------------------------------------------------------------------------------------


def normalize_overrides(overrides: list[str]) -> list[str]:
    """`model=<hub id or path>` is not a recipe file: turn it into `model=hf model.name_or_path=<it>`. Any key of the
    schema (RootCfg) or of a stage's TRL config class may be set on the command line whether or not the recipe
    YAML names it."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model" and value and not (RECIPES_DIR / "model" / f"{value}.yaml").exists():
            out += ["model=hf", f"model.name_or_path={value}", f"model.name={value.rstrip('/').split('/')[-1]}"]
        elif _is_schema_key(key) or _is_trainer_key(key):
            # Set it whether or not the recipe has the key (Hydra needs ++ for that): every field of the schema and
            # of a stage's TRL config class is a valid knob, checked by name and type in `validate`.
            out.append(f"++{item}")
        else:
            out.append(item)
    return out


def _is_schema_key(key: str) -> bool:
    """A dotted key naming a plain field of a config group in the schema (`debug.fault.rank`, `serve.port`)."""
    parts, cls = key.split("."), RootCfg
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return False
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return False
        kind = typing.get_type_hints(cls).get(part)
        if depth == len(parts) - 1:
            return not dataclasses.is_dataclass(kind)
        cls = kind
    return False


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
        missing = re.match(r"Could not override '([\w.]+)'", str(err))
        if missing and (message := _unknown_override(missing.group(1), overrides)):
            raise RecipeError(message) from None
        raise RecipeError(f"could not compose the recipe from {RECIPES_DIR}: {err}") from err
    choices = dict(cfg.hydra.runtime.choices)
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra")
    with_hydra["overrides"] = given  # a launched stage composes its config again from these (posttrain.launch)
    return validate(OmegaConf.create(with_hydra), choices, given)  # key_source names what the user typed


def _unknown_override(key: str, overrides: list[str]) -> str | None:
    """The message for a command-line key the recipe does not have: the first part of it that is not there, its
    close matches and the valid keys, found by composing the recipe without that override. None where the key is
    there after all (Hydra refused the override for another reason)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    given = next((item for item in overrides if item.lstrip("+~").split("=")[0] == key), key)
    rest = [item for item in overrides if item != given]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
            tree = hydra_compose("config", overrides=rest)
    except Exception:  # noqa: BLE001 - another override is wrong too: say what is known about this one
        tree = None
    parts, node = key.split("."), tree
    for depth, part in enumerate(parts):  # the first part of the key that is not in the recipe is the wrong one
        if not isinstance(node, DictConfig) or part not in node:
            break
        node = node[part]
    else:
        return None
    wrong = ".".join(parts[: depth + 1])
    valid = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
    if not valid:
        return f"unknown recipe key '{wrong}' in command-line override '{given}'"
    close = difflib.get_close_matches(parts[depth], valid, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (f"unknown recipe key '{wrong}' in command-line override '{given}' (the recipe has no such key).{hint}\n"
            f"Valid keys here: {', '.join(valid)}")


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
    _check_stage_options(cfg, choices, overrides)
    for key, valid in OPTION_VALUES.items():
        value = OmegaConf.select(cfg, key)
        if value not in valid:
            where = key_source(key, choices, overrides)
            raise RecipeError(f"recipe key '{key}' in {where} is '{value}'; valid values: {', '.join(valid)}")
    for name, variant in cfg.quantize.variants.items():
        options = {**QUANT_OPTION_VALUES, **({"gguf_type": GGUF_TYPES} if variant["fmt"] == "gguf" else {})}
        for option, valid in options.items():
            if variant[option] not in valid:
                key = f"quantize.variants.{name}.{option}"
                raise RecipeError(f"recipe key '{key}' in {key_source(key, choices, overrides)} is "
                                  f"'{variant[option]}'; valid values: {', '.join(valid)}")
    OmegaConf.set_readonly(cfg, True)
    return cfg


# Values a trainer field takes beyond its TRL type, resolved where the TRL config is built (posttrain.training)
TRAINER_EXTRA_VALUES = {"bf16": ("auto",)}  # bf16 autocast where the hardware has bf16 arithmetic


def _check_types(block, prefix: str, class_name: str, choices, overrides) -> None:
    """Each value of a trainer block against its field's type in TRL's config class: a value the class would take
    now and fail on later (a string for a learning rate) stops the run before any stage starts."""
    field_types = trl_field_types(class_name)
    for key, value in OmegaConf.to_container(block, resolve=True).items():
        extra = TRAINER_EXTRA_VALUES.get(key, ())
        if key in field_types and not fits(value, field_types[key]) and value not in extra:
            full = f"{prefix}.{key}"
            also = "".join(f" or {v!r}" for v in extra)
            raise RecipeError(f"recipe key '{full}' in {key_source(full, choices, overrides)} is {value!r}; expected "
                              f"{describe(field_types[key])}{also} (the type of {class_name}.{key})")


def _check_stage_options(cfg: DictConfig, choices, overrides) -> None:
    """Keys the schema has that a stage would otherwise ignore or overwrite without a word."""
    for stage in TRAINER_CLASSES:
        if stage != "sft" and cfg[stage].qlora:
            key = f"{stage}.qlora"
            raise RecipeError(f"recipe key '{key}' in {key_source(key, choices, overrides)} is true, but only sft "
                              f"trains on a 4-bit parent (QLoRA); {stage} would ignore it")
    if cfg.grpo.rollout.backend == "posttrain" and cfg.grpo.trainer.get("use_vllm"):
        key = "grpo.trainer.use_vllm"
        raise RecipeError(f"recipe key '{key}' in {key_source(key, choices, overrides)} is true, but "
                          "grpo.rollout.backend is posttrain (the engine generates); use rollout.backend=vllm")
    if cfg.grpo.trainer.get("reward_weights") is not None:
        key = "grpo.trainer.reward_weights"
        raise RecipeError(f"recipe key '{key}' in {key_source(key, choices, overrides)}: GRPO takes its rewards' "
                          "weights from grpo.rewards (name: weight), and would replace these")


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
    entry, variant = parse(stage)
    if entry.name == "quantize":
        block = OmegaConf.to_container(cfg.quantize, resolve=True)
        variant = variant or block["variant"]
        if variant not in block["variants"]:
            raise RecipeError(f"quantize variant '{variant}' is not in quantize.variants "
                              f"(has {', '.join(block['variants']) or 'none'})")
        block.update(variant=variant, variants={variant: block["variants"][variant]})
        keep["quantize"] = block
    elif entry.name in cfg:
        keep[entry.name] = cfg[entry.name]
    # each part resolved where it sits, so an interpolation into another stage's block (dpo.pairs.n_eval:
    # ${reward_model.pairs.n_eval}) resolves, and the hash covers the value it resolved to
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in keep.items()}
