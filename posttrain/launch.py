"""Run one training stage under `accelerate launch`, for `posttrain run` with `pipeline.launcher` other than single.

The parent (posttrain.pipeline.run_stage, after its skip check) writes `<stage dir>/launch.json`:

    {"overrides": [the command line], "stage": "sft", "index": 1, "parent": ".../00-pretrain", "inputs": {},
     "run_dir": "runs/<run>", "run_name": "<run>", "config_hash": "<the parent's hash of this stage>"}

and runs

    accelerate launch --config_file <recipes/accelerate/<launcher>.yaml> [launcher args] -m posttrain.launch <spec>

Every process of the child composes the config again from the same overrides, rebuilds the same StageRun (its
config hash must equal the parent's, or nothing runs) and calls the stage function, as `posttrain stage=...` would.
The child's output goes to the parent's stderr and to `<stage dir>/launch.log`; a child that fails is a
StageLaunchError naming the stage, the command and the last lines of that log.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections import deque
from pathlib import Path

from posttrain import registry
from posttrain.artifacts import ArtifactError, read_manifest
from posttrain.chat.render import MaskError
from posttrain.config import RecipeError, compose
from posttrain.data.dolly import DataError
from posttrain.runs import execute_stage, stage_run
from posttrain.sharding import launcher_config
from posttrain.training import world_size

log = logging.getLogger("posttrain")
LAUNCHED_ENV = "POSTTRAIN_LAUNCHED"  # set in a launched child: it runs its stage in-process, never launches again
SPEC, LOG = "launch.json", "launch.log"
TAIL_LINES = 40
MAX_ERRORS = 8
# "RuntimeError: ...", "[rank1]: ValueError: ...", "posttrain: error (rank 1): ..." (a known error, see main)
ERROR_LINE = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]+(Error|Exception)|posttrain: error\b[^:]*):")


class StageLaunchError(ArtifactError):
    """A stage run under `accelerate launch` failed, so its artifact was not produced; names the command and log."""


# --- which config, which arguments ----------------------------------------------------------------------------------
def launcher_for(cfg, stage: str) -> Path | None:
    """The config stage `stage` is launched with, or None to run it in this process: quantize and eval, the single
    launcher, and any process that is already one of several (a launched child, torchrun) run in-process."""
    if not registry.stage_of(stage).trains or os.environ.get(LAUNCHED_ENV) or world_size() > 1:
        return None
    return launcher_config(cfg.pipeline.launcher)


def launch_command(config_file: Path, cfg, spec: Path) -> list[str]:
    """`accelerate launch` (through this interpreter, so the same environment) with the recipe's
    `pipeline.launcher_args` before the module."""
    extra = list(cfg.pipeline.launcher_args)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file), *extra,
            "-m", "posttrain.launch", str(spec)]


# --- parent side -----------------------------------------------------------------------------------------------------
def write_spec(cfg, run, run_dir: Path) -> Path:
    run.out_dir.mkdir(parents=True, exist_ok=True)
    index = int(run.out_dir.name.split("-", 1)[0])
    spec = {"overrides": list(cfg.overrides), "stage": run.name, "index": index,
            "parent": str(run.parent) if run.parent else None, "inputs": {k: str(v) for k, v in run.inputs.items()},
            "run_dir": str(run_dir), "run_name": run.run_name, "config_hash": run.config_hash}
    path = run.out_dir / SPEC
    path.write_text(json.dumps(spec, indent=2) + "\n")
    return path


def launch_stage(cfg, run, run_dir: Path, config_file: Path) -> None:
    """Run the stage under `accelerate launch`; its output streams to stderr and <stage dir>/launch.log."""
    spec = write_spec(cfg, run, run_dir)
    command = launch_command(config_file, cfg, spec)
    shown = shlex.join(command)
    log.info("%s: launching: %s", run.name, shown)
    env = dict(os.environ, **{LAUNCHED_ENV: "1", "PYTHONUNBUFFERED": "1"})
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    errors: list[str] = []  # the exceptions the processes raised: the cause is often above the launcher's own tail
    log_path = run.out_dir / LOG
    with log_path.open("w") as log_file, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                          text=True, env=env) as child:
        for line in child.stdout:
            sys.stderr.write(line)
            log_file.write(line)
            line = line.rstrip("\n").split("\r")[-1]  # a progress bar's last state, not all its redraws
            tail.append(line)
            if ERROR_LINE.search(line) and line not in errors and len(errors) < MAX_ERRORS:
                errors.append(line)
        code = child.wait()
    if code != 0:
        found = "".join(f"\n  {e}" for e in errors) or " none found"
        raise StageLaunchError(f"{run.name}: the stage failed under accelerate launch (exit code {code}).\n"
                               f"command: {shown}\nerrors in {log_path}:{found}\n"
                               f"last {len(tail)} lines of it:\n" + "\n".join(tail))
    manifest = read_manifest(run.out_dir)
    if manifest is None or manifest.get("config_hash") != run.config_hash:
        raise StageLaunchError(f"{run.name}: accelerate launch exited 0 but {run.out_dir} holds no manifest for "
                               f"config hash {run.config_hash}; command: {shown}; log: {log_path}")


# --- child side: every process of the launch -------------------------------------------------------------------------
def run_spec(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    cfg = compose(spec["overrides"])
    run_dir = Path(spec["run_dir"])
    run = stage_run(cfg, spec["stage"], spec["index"], Path(spec["parent"]) if spec["parent"] else None, run_dir,
                    spec["run_name"], {k: Path(v) for k, v in spec["inputs"].items()})
    if run.config_hash != spec["config_hash"]:
        raise RecipeError(f"{spec_path}: the stage's config hash composed here ({run.config_hash}) differs from the "
                          f"parent's ({spec['config_hash']}); the recipe tree or a parent artifact changed meanwhile")
    execute_stage(cfg, run, run_dir)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="[posttrain %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if len(argv) != 1:
        print("usage: python -m posttrain.launch <launch.json> (written by posttrain run)", file=sys.stderr)
        return 2
    try:
        run_spec(Path(argv[0]))
    except (RecipeError, ArtifactError, DataError, MaskError, FileNotFoundError) as err:  # as posttrain.cli
        print(f"posttrain: error (rank {os.environ.get('RANK', '0')}): {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
