"""Experiment tracking: `tracking=wandb` logs each stage as a W&B run grouped by the pipeline run.

Without WANDB_API_KEY (or with mode=offline) W&B runs offline and its files land under the run directory, to be
synced later with `wandb sync`. `tracking=none` logs nothing. The trainers log through transformers' own
WandbCallback, which reads the WANDB_* variables set here.
"""

from __future__ import annotations

import os
from pathlib import Path
from posttrain.artifacts import parent_ref


def report_to(tracking_cfg) -> list[str]:
    if tracking_cfg.backend == "none":
        return []
    if tracking_cfg.backend == "wandb":
        return ["wandb"]
    raise ValueError(f"tracking.backend '{tracking_cfg.backend}' is not one of none, wandb")


def configure(tracking_cfg, run_dir: Path, run_name: str, stage: str, *, cfg=None, parent: Path | None = None,
              inputs: dict | None = None) -> None:
    """Set the W&B environment for one stage; a no-op for tracking=none.

    Everything goes through W&B's own environment variables, so it holds in the process that trains, whether
    that is this one or a process `accelerate launch` starts: the run's group is the pipeline run, its tags the
    recipe (pipeline name), stage and model, and with `cfg` the resolved config, the recipe name and the parent
    artifact are written to a YAML file that the run's notes point at.
    """
    if tracking_cfg.backend != "wandb":
        os.environ["WANDB_DISABLED"] = "true"
        return
    os.environ.pop("WANDB_DISABLED", None)
    mode = tracking_cfg.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    os.environ["WANDB_MODE"] = mode
    os.environ["WANDB_DIR"] = str(Path(run_dir).resolve())
    os.environ["WANDB_PROJECT"] = tracking_cfg.project
    os.environ["WANDB_RUN_GROUP"] = run_name
    os.environ["WANDB_NAME"] = f"{run_name}/{stage}"
    os.environ["WANDB_JOB_TYPE"] = stage
    os.environ.setdefault("WANDB_SILENT", "true")
    if tracking_cfg.entity:
        os.environ["WANDB_ENTITY"] = tracking_cfg.entity
    if cfg is not None:
        recipe = cfg.pipeline.name if not cfg.stage else f"stage={cfg.stage}"
        os.environ["WANDB_TAGS"] = ",".join(dict.fromkeys([recipe, stage.replace(":", "-"), cfg.model.name]))
        os.environ["WANDB_NOTES"] = f"parent: {parent}" if parent else "no parent artifact"
        path = Path(run_dir) / "wandb" / f"{stage.replace(':', '-')}.config.yaml"
        if int(os.environ.get("RANK", "0")) == 0:  # only rank 0 logs to W&B; the file is written once
            write_stage_config(path, cfg, recipe, stage, parent, inputs)
        # wandb 0.31 rejects WANDB_CONFIG_PATHS from the environment (a str, not a list): the file stays beside
        # the offline runs, and the run notes point at it
        os.environ["WANDB_NOTES"] += f"; resolved config: {path}"


def write_stage_config(path: Path, cfg, recipe: str, stage: str, parent: Path | None, inputs: dict | None) -> None:
    """The YAML wandb.init loads into the run config: the resolved recipe, its name, and the parent artifact."""
    import yaml
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    content = {
        "posttrain": OmegaConf.to_container(cfg, resolve=True),
        "recipe": recipe,
        "stage": stage,
        "parent_artifact": parent_ref(parent),
        "input_artifacts": {k: parent_ref(Path(v)) for k, v in (inputs or {}).items()},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(content, sort_keys=False))
    tmp.replace(path)


def read_offline_run(run_dir: Path) -> dict:
    """What an offline W&B run recorded, read back from its `run-<id>.wandb` file: the run's group, name, tags
    and notes, its config, every logged history row and the summary.

    Written by hand because W&B (>= 0.20) moved its reader of this transaction log into its Go core and ships no
    Python reader; the format is a 7-byte header (":W&B", magic, version) then LevelDB-log records (32 KiB blocks,
    each record: crc32 (4), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last)) whose payloads
    are `wandb_internal_pb2.Record` protobufs.
    """
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    files = list(Path(run_dir).glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one run-*.wandb file, found {len(files)}")
    data = files[0].read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{files[0]}: not a W&B transaction log (header {data[:4]!r})")
    out: dict = {"config": {}, "history": [], "summary": {}}
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break  # zero padding: the end of what was written
        pending = payload if kind in (1, 2) else pending + payload
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        which = record.WhichOneof("record_type")
        if which == "run":
            run = record.run
            out.update(group=run.run_group, name=run.display_name, job_type=run.job_type, tags=list(run.tags),
                       notes=run.notes)
            out["config"].update({u.key: json.loads(u.value_json) for u in run.config.update})
        elif which == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif which == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
        elif which == "summary":
            out["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                   for u in record.summary.update})
    return out
