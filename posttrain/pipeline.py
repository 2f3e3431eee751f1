"""Chain stages into a run: each reads its parent artifact and writes `runs/<run>/<NN-stage>/`.

A stage whose manifest matches its config hash and parent is skipped (after checking its weights); a stage that
was killed resumes from its last trainer checkpoint; a stage whose config or parent changed runs again.

Stages that do not produce a generator (the reward model) do not become the next stage's parent: the chain
base -> sft -> reward_model -> grpo -> dpo trains GRPO on the SFT model and hands it the reward model as an
input; DPO then starts from (and is regularized towards) the GRPO model.

`pipeline.launcher` other than single runs each training stage under `accelerate launch` with that config
(posttrain.launch); the skip check and the hand-off between stages stay here, in the parent process, which holds
each stage's directory (posttrain.artifacts.own_stage_dir) while the stage runs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from pathlib import Path

from posttrain import registry, training
from posttrain.artifacts import own_stage_dir, read_manifest, verify_artifact
from posttrain.config import RecipeError
from posttrain.evaluation.run import evaluate
from posttrain.evaluation.scorecard import check_suites
from posttrain.launch import launch_stage, launcher_config, launcher_for
from posttrain.preflight import preflight
from posttrain.runs import execute_stage, peak_memory_bytes, reset_peak_memory, run_dir_of, stage_run
from posttrain.training import StageRun

log = logging.getLogger("posttrain")


def run_stage(cfg, name: str, index: int, parent: Path | None, run_dir: Path, run_name: str,
              inputs: dict[str, Path] | None = None) -> Path:
    run = stage_run(cfg, name, index, parent, run_dir, run_name, inputs)
    owner = own_stage_dir(run.out_dir) if training.is_main_process() else contextlib.nullcontext()
    with owner:
        return _run_owned_stage(cfg, run, run_dir)


def _run_owned_stage(cfg, run: StageRun, run_dir: Path) -> Path:
    name = run.name
    manifest = read_manifest(run.out_dir)
    if manifest is not None and manifest.get("config_hash") == run.config_hash:
        verify_artifact(run.out_dir)
        log.info("%s: up to date (%s), skipped", name, run.out_dir)
        return run.out_dir
    log.info("%s: running -> %s", name, run.out_dir)
    started = time.perf_counter()
    config_file = launcher_for(cfg, name)
    if config_file is not None:  # training stage, launcher not single: `accelerate launch` runs it
        launch_stage(cfg, run, run_dir, config_file)
        log.info("%s: done in %.1f s", name, time.perf_counter() - started)
    else:
        measured = reset_peak_memory()
        execute_stage(cfg, run, run_dir)
        peak = peak_memory_bytes() if measured else None
        log.info("%s: done in %.1f s%s", name, time.perf_counter() - started,
                 f", peak resident memory {peak / 2**30:.2f} GiB" if peak else "")
    return run.out_dir


def check_processes(cfg, stages: list[str], evaluate: bool) -> None:
    """Under several processes (torchrun, accelerate launch) only training stages run: quantize and eval are
    one-process work, and would run, and write, once per rank."""
    if training.world_size() == 1:
        return
    other = [s for s in stages if not registry.stage_of(s).trains] + (["eval"] if evaluate else [])
    if other:
        raise RecipeError(f"{', '.join(other)} run in one process, and this is one of {training.world_size()}: "
                          f"under torchrun / accelerate launch give only training stages ({', '.join(registry.TRAINING_STAGES)})"
                          f" and pipeline.evaluate=false, or run `posttrain run` in one process with "
                          f"pipeline.launcher=<name>, which launches only the training stages")


def run_pipeline(cfg) -> Path:
    check_processes(cfg, list(cfg.pipeline.stages), cfg.pipeline.evaluate)
    preflight(cfg, list(cfg.pipeline.stages))
    if cfg.pipeline.evaluate:  # the eval's files and prompt counts, before hours of training
        log.info("pipeline: eval suites %s read and built", check_suites(cfg.eval, cfg.seed))
    run_dir, run_name = run_dir_of(cfg)
    launcher_config(cfg.pipeline.launcher)  # a launcher that does not exist fails before anything is written
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("pipeline %s: stages %s -> %s", cfg.pipeline.name, list(cfg.pipeline.stages), run_dir)
    started = time.perf_counter()
    parent = Path(cfg.parent) if cfg.parent else None
    stage_dirs, inputs, times = [], {}, []
    for index, name in enumerate(cfg.pipeline.stages):
        stage_started = time.perf_counter()
        out = run_stage(cfg, name, index, parent, run_dir, run_name, inputs)
        times.append(f"{name} {time.perf_counter() - stage_started:.0f} s")
        stage_dirs.append(out)
        role = registry.stage_of(name).role
        if role == registry.INPUT:
            inputs[name] = out
        elif role == registry.PARENT:
            parent = out
    if cfg.pipeline.evaluate:
        eval_started = time.perf_counter()
        evaluate(cfg, run_dir, stage_dirs)
        times.append(f"eval {time.perf_counter() - eval_started:.0f} s")
    log.info("pipeline %s finished in %.1f s (%s)", cfg.pipeline.name, time.perf_counter() - started, ", ".join(times))
    return run_dir


def run_single_stage(cfg) -> Path:
    """`posttrain stage=<name>`: one stage, on `parent=<artifact>` or on the model the recipe names."""
    check_processes(cfg, [cfg.stage], False)
    preflight(cfg, [cfg.stage])
    run_dir, run_name = run_dir_of(cfg)
    launcher_config(cfg.pipeline.launcher)
    parent = Path(cfg.parent) if cfg.parent else None
    index = 0
    if parent is not None:
        match = re.match(r"(\d+)-", parent.name)
        index = int(match.group(1)) + 1 if match else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_stage(cfg, cfg.stage, index, parent, run_dir, run_name)
