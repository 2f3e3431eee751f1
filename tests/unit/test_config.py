"""Recipe composition and validation: misspelled keys fail with the key, the file and the valid keys."""

from __future__ import annotations

import re
import shutil

import pytest

from posttrain import config as config_mod
from posttrain.config import RecipeError, compose


def test_tiny_pipeline_composes_with_trl_field_names():
    cfg = compose(["pipeline=tiny"])
    assert list(cfg.pipeline.stages) == ["pretrain", "sft", "reward_model", "grpo", "dpo", "quantize:int8",
                                         "quantize:int4-gptq", "quantize:nvfp4", "quantize:gguf-q4_k_m"]
    for stage, class_name in config_mod.TRAINER_CLASSES.items():
        assert set(cfg[stage].trainer) <= set(config_mod.trl_fields(class_name)), stage


def test_quantize_variants_are_checked_at_start_up_and_hashed_one_by_one():
    with pytest.raises(config_mod.RecipeError, match="quantize.variants.int8.fmt.*int5.*valid values: int8, int4"):
        compose(["quantize.variants.int8.fmt=int5"])
    cfg = compose(["pipeline=tiny"])
    view = config_mod.stage_view(cfg, "quantize:int8")
    assert view["quantize"]["variant"] == "int8" and list(view["quantize"]["variants"]) == ["int8"]
    with pytest.raises(config_mod.RecipeError, match="quantize variant 'int3' is not in quantize.variants"):
        config_mod.stage_view(cfg, "quantize:int3")


def test_a_stage_view_resolves_interpolations_into_other_blocks():
    """recipes/pipeline/smollm2.yaml holds DPO's pairs out as the reward model does: dpo.pairs.n_eval is
    ${reward_model.pairs.n_eval}. The stage's view (what its config hash covers) once copied the dpo block out of the
    tree before resolving it, and the run failed at the DPO stage with "key 'reward_model.pairs.n_eval' not found"."""
    cfg = compose(["pipeline=smollm2", "reward_model.pairs.n_eval=7"])
    view = config_mod.stage_view(cfg, "dpo")
    assert view["dpo"]["pairs"]["n_eval"] == 7 and view["seed"] == cfg.seed
    changed = config_mod.stage_view(compose(["pipeline=smollm2", "reward_model.pairs.n_eval=8"]), "dpo")
    assert changed["dpo"]["pairs"]["n_eval"] == 8  # the hash follows the value the interpolation resolves to


def test_smollm2_long_is_smollm2_with_longer_dpo_and_grpo_on_constraints():
    """recipes/pipeline/smollm2-long.yaml is pipeline=smollm2 with pipeline=smollm2-ifeval's GRPO (on constrained
    prompts) and a longer DPO: every other stage's view (what its config hash covers) is smollm2's, so the stages of
    the two chains are the same work, and its eval is smollm2's plus the ifeval suite."""
    short, long = compose(["pipeline=smollm2"]), compose(["pipeline=smollm2-long"])
    ifeval = compose(["pipeline=smollm2-ifeval"])
    assert long.pipeline.stages == short.pipeline.stages and long.pipeline.name == "smollm2-long"
    for stage in ("sft", "reward_model", "quantize:int4-gptq"):
        assert config_mod.stage_view(long, stage) == config_mod.stage_view(short, stage), stage
    assert long.eval.suites == [*short.eval.suites, "ifeval"] and long.eval.gsm8k == short.eval.gsm8k
    assert long.eval.ifeval == ifeval.eval.ifeval and long.eval.n_prompts.ifeval == 300
    assert config_mod.stage_view(long, "grpo") == config_mod.stage_view(ifeval, "grpo")
    assert (long.grpo.trainer.max_steps, long.grpo.trainer.num_generations) == (40, 8)
    assert long.grpo.prompts.source == "constraints" and dict(long.grpo.rewards) == {"instruction_grounded": 1.0}
    assert (long.dpo.pairs.n_train, long.dpo.trainer.max_steps, len(long.dpo.lora.target_modules)) == (800, 100, 7)
    assert long.dpo.pairs.n_eval == short.reward_model.pairs.n_eval  # DPO still holds out the judge's conversations


def test_model_override_with_a_path_becomes_hf(tmp_path):
    cfg = compose([f"model={tmp_path}"])
    assert cfg.model.source == "hf" and cfg.model.name_or_path == str(tmp_path)


@pytest.fixture
def recipe_copy(tmp_path, monkeypatch):
    root = tmp_path / "recipes"
    shutil.copytree(config_mod.RECIPES_DIR, root)
    monkeypatch.setattr(config_mod, "RECIPES_DIR", root)
    return root


@pytest.mark.parametrize(
    "file, old, new, key, hint",
    [
        ("sft/tiny.yaml", "  learning_rate:", "  learnin_rate:", "sft.trainer.learnin_rate", "learning_rate"),
        ("model/tiny.yaml", "  hidden_size:", "  hiden_size:", "model.arch.hiden_size", "hidden_size"),
        ("eval/tiny.yaml", "n_prompts:", "n_prompt:", "eval.n_prompt", "n_prompts"),
        ("pipeline/tiny.yaml", "  stages:", "  stage:", "pipeline.stage", "stages"),
    ],
)
def test_misspelled_key_names_key_file_and_valid_keys(recipe_copy, file, old, new, key, hint):
    path = recipe_copy / file
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(RecipeError) as err:
        compose(["pipeline=tiny"])
    message = str(err.value)
    assert f"'{key}'" in message
    assert str(path) in message
    assert f"'{hint}'" in message  # the close match
    assert "Valid keys here:" in message and hint in message.split("Valid keys here:")[1]


def test_misspelled_lora_key_is_checked_against_peft(recipe_copy):
    path = recipe_copy / "sft/lora.yaml"
    path.write_text(path.read_text().replace("lora_alpha:", "lora_alfa:"))
    with pytest.raises(RecipeError, match=r"sft\.lora\.lora_alfa.*sft/lora\.yaml"):
        compose(["sft=lora"])


def test_wrong_type_is_rejected_with_the_key():
    with pytest.raises(RecipeError, match="eval.n_prompts.echo"):
        compose(["eval.n_prompts.echo=many"])


def test_misspelled_override_is_rejected():
    with pytest.raises(RecipeError, match="learnin_rate"):
        compose(["sft.trainer.learnin_rate=0.1"])


@pytest.mark.parametrize("group", [g for g in config_mod.GROUPS if g != "pipeline"])
def test_every_recipe_option_composes_and_validates(group):
    options = sorted(p.stem for p in (config_mod.RECIPES_DIR / group).glob("*.yaml"))
    assert options
    for option in options:
        cfg = compose([f"{group}={option}"])  # raises RecipeError on a key TRL / peft / the schema does not know
        assert cfg[group] is not None


@pytest.mark.parametrize("pipeline", sorted(p.stem for p in (config_mod.RECIPES_DIR / "pipeline").glob("*.yaml")))
def test_pipelines_compose(pipeline):
    assert compose([f"pipeline={pipeline}"]).pipeline.stages


@pytest.mark.parametrize("overrides, key", [
    (["dpo=pku_saferlhf", "dpo.pairs.preference=safest"], "dpo.pairs.preference"),
    (["reward_model=pku_saferlhf", "reward_model.pairs.on_bad_row=skip"], "reward_model.pairs.on_bad_row"),
    (["dpo.pairs.source=pku"], "dpo.pairs.source"),
    (["grpo.rollout.backend=engine"], "grpo.rollout.backend"),
])
def test_closed_option_values_fail_at_start_up_naming_the_key(overrides, key):
    with pytest.raises(RecipeError, match=rf"recipe key '{key}' in command-line override .* valid values: "):
        compose(overrides)


def test_engine_rollouts_with_vllm_generation_is_refused_at_start_up():
    assert compose(["grpo.rollout.backend=posttrain"]).grpo.rollout.backend == "posttrain"
    with pytest.raises(RecipeError, match=r"'grpo.trainer.use_vllm' .* is true, but grpo.rollout.backend is posttrain"):
        compose(["grpo.rollout.backend=posttrain", "grpo.trainer.use_vllm=true"])


@pytest.mark.parametrize("override, expected", [
    ("grpo.trainer.learning_rate=abc", "'grpo.trainer.learning_rate' in command-line override "
                                       "'grpo.trainer.learning_rate=abc' is 'abc'; expected float"),
    ("grpo.trainer.bf16=maybe", "'grpo.trainer.bf16' in command-line override 'grpo.trainer.bf16=maybe' is 'maybe'; "
                                "expected bool or None or 'auto' (the type of GRPOConfig.bf16)"),
    ("sft.trainer.max_steps=2.5", "'sft.trainer.max_steps' in command-line override 'sft.trainer.max_steps=2.5' is "
                                  "2.5; expected int (the type of SFTConfig.max_steps)"),
])
def test_trainer_values_are_checked_against_the_trl_field_types_at_start_up(override, expected):
    with pytest.raises(RecipeError) as error:
        compose(["pipeline=tiny", override])
    assert expected in str(error.value)


def test_bf16_takes_auto_beside_the_trl_type():
    assert compose(["pipeline=tiny", "grpo.trainer.bf16=auto"]).grpo.trainer.bf16 == "auto"


def test_any_trl_field_is_a_valid_override_without_plus_and_misspellings_get_close_matches():
    cfg = compose(["pipeline=tiny", "grpo.trainer.num_iterations=4", "dpo.trainer.learning_rate=1e-4"])
    assert cfg.grpo.trainer.num_iterations == 4 and cfg.dpo.trainer.learning_rate == 1e-4
    with pytest.raises(RecipeError, match=r"'sft.trainer.learnin_rate' in command-line override "
                                          r"'sft.trainer.learnin_rate=1e-3' \(not a field of this block\)\. "
                                          r"Did you mean 'learning_rate'"):
        compose(["pipeline=tiny", "sft.trainer.learnin_rate=1e-3"])


@pytest.mark.parametrize("override, message", [
    ("sft.trainr.max_steps=3", "unknown recipe key 'sft.trainr' in command-line override 'sft.trainr.max_steps=3' "
                               "(the recipe has no such key). Did you mean 'trainer'?\n"
                               "Valid keys here: lm_head, lora, trainer"),
    ("sedd=3", "unknown recipe key 'sedd' in command-line override 'sedd=3' (the recipe has no such key). "
               "Did you mean 'seed'?"),
])
def test_a_command_line_key_the_recipe_lacks_gets_the_close_matches(override, message):
    with pytest.raises(RecipeError) as error:
        compose(["pipeline=tiny", override])
    assert message in str(error.value)


@pytest.mark.parametrize("override, message", [
    ("+dpo.qlora=true", "recipe key 'dpo.qlora' in command-line override '+dpo.qlora=true' is true, but only sft "
                        "trains"),
    ("grpo.trainer.reward_weights=[1.0]", "GRPO takes its rewards' weights from grpo.rewards"),
])
def test_keys_a_stage_would_ignore_or_overwrite_fail_at_start_up(override, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        compose(["pipeline=tiny", override])
