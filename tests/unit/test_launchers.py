"""The accelerate launcher configs load with accelerate's own loader and launch-argument validation, each DeepSpeed JSON
has the stage its config claims and only "auto" values transformers fills, every header names its own command; and
`pipeline.launcher` resolves, builds its command, and hands a launched child the same config hash."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace
from unittest import mock

import pytest

from posttrain import launch, registry, runs, sharding
from posttrain.config import RECIPES_DIR, RecipeError, compose

ACCELERATE = RECIPES_DIR / "accelerate"
CONFIGS = sorted(ACCELERATE.glob("*.yaml"))
# name -> (distributed type, DeepSpeed JSON, ZeRO stage, offload device)
EXPECTED = {
    "single": ("NO", None, None, None),
    "ddp": ("MULTI_GPU", None, None, None),
    "fsdp2": ("FSDP", None, None, None),
    "zero2": ("DEEPSPEED", "zero2.json", 2, None),
    "zero3": ("DEEPSPEED", "zero3.json", 3, None),
    "zero3_offload": ("DEEPSPEED", "zero3_offload.json", 3, "cpu"),
    "multi_node": ("DEEPSPEED", "zero3.json", 3, None),
}
REPO = RECIPES_DIR.parent


def test_every_expected_launcher_exists():
    assert {p.stem for p in CONFIGS} == set(EXPECTED)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_with_accelerates_loader_and_header_runs_its_own_file(path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig) and config == ClusterConfig.from_yaml_file(str(path))
    kind, ds_json, _, _ = EXPECTED[path.stem]
    assert config.distributed_type.value == kind
    if ds_json:
        assert config.deepspeed_config["deepspeed_config_file"] == f"recipes/accelerate/deepspeed/{ds_json}"
        assert (REPO / config.deepspeed_config["deepspeed_config_file"]).is_file()  # relative to the repo root

    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    runs = [line for line in header if line.startswith("# Run: ")]
    assert runs, f"{path}: the header has no '# Run: ' line"
    assert re.match(rf"# Run: accelerate launch --config_file recipes/accelerate/{path.name} .*-m posttrain ", runs[0])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_accelerate_launch_accepts_the_config(path, monkeypatch):
    """The launch command's own validation, and the environment it would hand the processes (nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(path), "-m", "posttrain", "stage=sft"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_fsdp:
        env = prepare_multi_gpu_env(args)
        assert env["FSDP_VERSION"] == "2" and env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
        assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    if args.use_deepspeed:
        # as launch_command does; DeepSpeedPlugin refuses accelerate settings that a DeepSpeed JSON also sets
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
        from accelerate.utils import DeepSpeedPlugin

        monkeypatch.chdir(REPO)  # the JSON path is relative to the repository root, where the header says to run
        with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}):
            plugin = DeepSpeedPlugin()
        assert plugin.zero_stage == EXPECTED[path.stem][2]


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json"])
def test_deepspeed_json_has_its_stage_and_only_autos_transformers_fills(name):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    path = ACCELERATE / "deepspeed" / name
    config = json.loads(path.read_text())
    zero = config["zero_optimization"]
    stage = 2 if name == "zero2.json" else 3
    assert zero["stage"] == stage
    assert config["bf16"]["enabled"] == "auto" and config["gradient_clipping"] == "auto"
    assert config["train_micro_batch_size_per_gpu"] == "auto" and config["gradient_accumulation_steps"] == "auto"
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # one 16-bit model on save
    offload = "offload" in name
    assert (zero.get("offload_optimizer", {}).get("device") == "cpu") is offload
    assert (zero.get("offload_param", {}).get("device") == "cpu") is offload

    args = TrainingArguments(output_dir="unused", use_cpu=True, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-4, report_to=[])
    filled = HfTrainerDeepSpeedConfig(str(path))
    filled.trainer_config_process(args)
    filled.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=256)), 100)
    assert "auto" not in json.dumps(filled.config), filled.config
    assert filled.config["gradient_clipping"] == 0.5 and filled.config["train_micro_batch_size_per_gpu"] == 4
    assert filled.config["bf16"]["enabled"] is False  # the recipe's bf16, not the file's


# --- pipeline.launcher -----------------------------------------------------------------------------------------------
def test_launcher_names_paths_and_unknown_names():
    assert launch.launcher_config("single") is None
    assert launch.launcher_config("zero3") == ACCELERATE / "zero3.yaml"
    assert launch.launcher_config(str(ACCELERATE / "ddp.yaml")) == ACCELERATE / "ddp.yaml"
    with pytest.raises(RecipeError, match=r"pipeline.launcher 'zero4': no accelerate config .* fsdp2, .*zero3"):
        launch.launcher_config("zero4")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_config_names_the_strategy_its_manifest_will_record(path, tmp_path):
    """sharding.requested_strategy: what the config asks for, in the names a stage's manifest records (`strategy`)
    and preflight checks against; the ZeRO stage and offload come from the DeepSpeed JSON."""
    _, _, zero, offload = EXPECTED[path.stem]
    kind = EXPECTED[path.stem][0]
    want = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp2"}.get(kind) or f"zero{zero}" + ("_offload" if offload else "")
    assert sharding.requested_strategy(path.stem) == want
    broken = tmp_path / "broken.yaml"  # a DeepSpeed config file that is not there: named in the error
    broken.write_text("distributed_type: DEEPSPEED\ndeepspeed_config: {deepspeed_config_file: /nonexistent.json}\n")
    with pytest.raises(RecipeError, match=r"broken.yaml: cannot read its DeepSpeed config /nonexistent.json"):
        sharding.requested_strategy(str(broken))


def test_only_training_stages_of_a_parent_process_are_launched(monkeypatch):
    cfg = compose(["pipeline=tiny-ci", "pipeline.launcher=fsdp2"])
    monkeypatch.delenv(launch.LAUNCHED_ENV, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert all(launch.launcher_for(cfg, s) == ACCELERATE / "fsdp2.yaml" for s in registry.TRAINING_STAGES)
    assert launch.launcher_for(cfg, "quantize:int8") is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # already one of several processes (torchrun, accelerate launch)
    assert launch.launcher_for(cfg, "sft") is None
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv(launch.LAUNCHED_ENV, "1")  # a launched child never launches again
    assert launch.launcher_for(cfg, "sft") is None
    assert launch.launcher_for(compose(["pipeline=tiny-ci"]), "sft") is None  # single


def test_launch_command_carries_the_recipe_arguments(tmp_path):
    cfg = compose(["pipeline=tiny-ci", "pipeline.launcher=ddp",
                   "pipeline.launcher_args=[--num_processes,2,--mixed_precision,no,--main_process_port,29999]"])
    command = launch.launch_command(ACCELERATE / "ddp.yaml", cfg, tmp_path / "launch.json")
    assert command[1:] == ["-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / "ddp.yaml"),
                           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "29999",
                           "-m", "posttrain.launch", str(tmp_path / "launch.json")]


def test_a_launched_child_rebuilds_the_same_stage_run(monkeypatch, tmp_path):
    """The spec the parent writes composes, in the child, to the same StageRun and config hash; a hash that
    differs (the recipe tree changed meanwhile) stops the child before anything runs."""
    overrides = ["pipeline=tiny-ci", "pipeline.launcher=ddp", "sft.trainer.max_steps=3", f"run.root={tmp_path}",
                 "run.name=r"]
    cfg = compose(overrides)
    run = runs.stage_run(cfg, "sft", 1, None, tmp_path / "r", "r")
    spec = launch.write_spec(cfg, run, tmp_path / "r")
    assert json.loads(spec.read_text())["overrides"] == overrides

    seen = []
    monkeypatch.setattr(launch, "execute_stage", lambda cfg, run, run_dir: seen.append((cfg, run, run_dir)))
    launch.run_spec(spec)
    (child_cfg, child_run, run_dir), = seen
    assert child_run.config_hash == run.config_hash and child_run.out_dir == run.out_dir == tmp_path / "r" / "01-sft"
    assert child_run.config == run.config and run_dir == tmp_path / "r" and child_cfg.sft.trainer.max_steps == 3

    data = json.loads(spec.read_text())
    spec.write_text(json.dumps({**data, "config_hash": "0" * 64}))
    with pytest.raises(RecipeError, match="differs from the parent's"):
        launch.run_spec(spec)
    assert len(seen) == 1


def test_an_unknown_launcher_fails_before_anything_is_written(tmp_path):
    from posttrain.pipeline import run_pipeline

    cfg = compose(["pipeline=tiny-ci", "pipeline.launcher=zero9", f"run.root={tmp_path}", "run.name=x"])
    with pytest.raises(RecipeError, match="zero9"):
        run_pipeline(cfg)
    assert not (tmp_path / "x").exists()


def test_test_switches_are_a_typed_debug_group_outside_the_config_hash(tmp_path):
    """`debug.*` reaches the StageRun (and a launched child composes it from the same overrides) without changing
    the stage's config hash; its values are typed like any recipe key."""
    from posttrain import training

    plain = compose(["pipeline=tiny-ci"])
    debug = compose(["pipeline=tiny-ci", "debug.fault.rank=1", "debug.fault.step=2", "debug.fault.stage=sft",
                     f"debug.weight_digest_dir={tmp_path}"])
    run, debug_run = (runs.stage_run(c, "sft", 1, None, tmp_path / "r", "r") for c in (plain, debug))
    assert debug_run.config_hash == run.config_hash
    assert debug_run.debug == {"fault": {"rank": 1, "step": 2, "stage": "sft"}, "weight_digest_dir": str(tmp_path)}
    assert run.debug["fault"]["rank"] is None
    with pytest.raises(RecipeError, match="debug.fault.step"):
        compose(["pipeline=tiny-ci", "debug.fault.step=two"])

    class Trainer:
        callbacks = []

        def add_callback(self, callback):
            self.callbacks.append(callback)

    for stage_run, added in ((run, 0), (debug_run, 1)):
        trainer = Trainer()
        trainer.callbacks = []
        training.install_test_hooks(trainer, stage_run)
        assert len(trainer.callbacks) == added
    state = SimpleNamespace(global_step=1)
    with mock.patch.object(training, "rank", return_value=1), pytest.raises(RuntimeError, match="rank 1 at step 2"):
        trainer.callbacks[0].on_step_begin(None, state, None)


def test_ddp_timeout_comes_from_the_recipe():
    from posttrain import training

    assert training.ddp_timeout({}) == 1800 and training.ddp_timeout(None) == 1800
    assert training.ddp_timeout({"ddp_timeout": 600}) == 600


def test_a_child_that_fails_or_writes_nothing_is_a_stage_launch_error(monkeypatch, tmp_path):
    import sys

    from posttrain.artifacts import ArtifactError

    cfg = compose(["pipeline=tiny-ci", "pipeline.launcher=ddp", f"run.root={tmp_path}", "run.name=r"])
    run = runs.stage_run(cfg, "sft", 1, None, tmp_path / "r", "r")
    child = "import sys; print('step 1'); print('[rank1]: RuntimeError: boom'); print('tail line'); sys.exit(3)"
    monkeypatch.setattr(launch, "launch_command", lambda *a: [sys.executable, "-c", child])
    with pytest.raises(launch.StageLaunchError) as err:
        launch.launch_stage(cfg, run, tmp_path / "r", ACCELERATE / "ddp.yaml")
    message = str(err.value)
    assert isinstance(err.value, ArtifactError)  # posttrain.cli: exit code 2, like every known error
    assert message.startswith("sft: the stage failed under accelerate launch (exit code 3)")
    assert f"command: {sys.executable} -c " in message and str(run.out_dir / "launch.log") in message
    assert "errors in" in message and "\n  [rank1]: RuntimeError: boom\n" in message and message.endswith("tail line")
    assert (run.out_dir / "launch.log").read_text().splitlines() == ["step 1", "[rank1]: RuntimeError: boom",
                                                                     "tail line"]

    monkeypatch.setattr(launch, "launch_command", lambda *a: [sys.executable, "-c", "pass"])
    with pytest.raises(launch.StageLaunchError, match="exited 0 but .* holds no manifest"):
        launch.launch_stage(cfg, run, tmp_path / "r", ACCELERATE / "ddp.yaml")


def test_one_process_stages_are_refused_under_several_processes(monkeypatch, tmp_path):
    from posttrain.pipeline import run_pipeline

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose(["pipeline=tiny-ci", f"run.root={tmp_path}", "run.name=x"])
    with pytest.raises(RecipeError, match=r"quantize:int8, quantize:int4-gptq, quantize:gguf-q4_k_m, eval run in one "
                                          r"process, and this is "
                                          r"one of 2"):
        run_pipeline(cfg)
    assert not (tmp_path / "x").exists()
