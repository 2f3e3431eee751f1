"""Where a run and its stages write, and running one stage in this process.

`posttrain run` (posttrain.pipeline), a launched child (posttrain.launch) and `posttrain eval`
(posttrain.evaluation.run) all name the run directory, and the first two build each stage's StageRun, the same way:
here. A stage's config hash covers its slice of the recipe (posttrain.config.stage_view), its parent's manifest and
its inputs' manifests, so a child composing the same recipe gets the same hash as its parent process.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from posttrain import registry, tracking, training
from posttrain.artifacts import manifest_sha256
from posttrain.config import stage_view
from posttrain.training import StageRun, stage_hash


def run_dir_of(cfg) -> tuple[Path, str]:
    training.quiet_other_ranks()
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    if not cfg.run.name and training.world_size() > 1:
        # several processes (torchrun, accelerate launch): each read its own clock; rank 0's names the run
        stages = [cfg.stage] if cfg.stage else list(cfg.pipeline.stages)
        first = next((s for s in stages if s in cfg and "trainer" in cfg[s]), None)
        training.init_distributed(OmegaConf.to_container(cfg[first].trainer, resolve=True) if first else None)
        name = training.from_main_process(name)
    return Path(cfg.run.root) / name, name


def stage_run(cfg, name: str, index: int, parent: Path | None, run_dir: Path, run_name: str,
              inputs: dict[str, Path] | None = None) -> StageRun:
    """Where stage `name` writes and the config hash that decides skip / resume (the same in a launched child)."""
    registry.parse(name)  # an unknown stage fails here, naming the valid ones
    out_dir = run_dir / f"{index:02d}-{name.replace(':', '-')}"
    config = stage_view(cfg, name)
    inputs = dict(inputs or {})
    digest = stage_hash(config, manifest_sha256(parent) if parent else None,
                        {k: manifest_sha256(v) for k, v in inputs.items()})
    return StageRun(name=name, out_dir=out_dir, parent=parent, config=config, config_hash=digest, run_name=run_name,
                    inputs=inputs, debug=OmegaConf.to_container(cfg.debug, resolve=True) if "debug" in cfg else {})


def execute_stage(cfg, run: StageRun, run_dir: Path) -> None:
    """Run the stage function in this process (in a launched child: in each of its processes)."""
    tracking.configure(cfg.tracking, run_dir, run.run_name, run.name, cfg=cfg, parent=run.parent, inputs=run.inputs)
    try:
        registry.stage_main(run.name)(cfg, run)
    finally:
        finish_tracking()


def finish_tracking() -> None:
    if "wandb" in sys.modules:
        wandb = sys.modules["wandb"]  # loaded by the stage's tracking; a run without it never imports it
        if wandb.run is not None:
            wandb.finish()


def reset_peak_memory() -> bool:
    """Restart the kernel's count of this process's peak resident memory (VmHWM), so a stage's own peak can be read
    at its end. False where the kernel does not allow it (not Linux, or before 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_bytes() -> int | None:
    """This process's peak resident memory since the last reset (or its start); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
