"""Evaluate a run: serve each checkpoint, score the suites through the API, write the scorecard and the report.

    posttrain eval                               the latest run under run.root (default runs/)
    posttrain eval run.name=demo                 a named run
    posttrain eval run.name=demo 'eval.checkpoints=[dpo,dpo-int8]' serve=vllm

A run that was scored before is scored again with the eval config and seed it recorded in scorecard.json, with the
command line's `eval.<key>=` and `seed=` overrides on top; `pipeline=` or `eval=` take the composed config instead.

The pipeline calls `evaluate` after its last stage; `posttrain eval` calls it on a finished run without retraining.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import OmegaConf

from posttrain import tracking
from posttrain.artifacts import read_manifest
from posttrain.evaluation.report import write_report
from posttrain.evaluation.scorecard import render_markdown, write_scorecard
from posttrain.registry import checkpoint_label
from posttrain.runs import run_dir_of
from posttrain.serve.server import quiet_http_logs

log = logging.getLogger("posttrain")


def stage_dirs_of(run_dir: Path) -> list[Path]:
    """A run's stage directories with a finished manifest, in pipeline order."""
    return sorted(d for d in Path(run_dir).iterdir() if d.is_dir() and read_manifest(d) is not None)


def latest_run(root: Path) -> Path:
    runs = [d for d in Path(root).iterdir() if d.is_dir() and stage_dirs_of(d)] if Path(root).is_dir() else []
    if not runs:
        raise FileNotFoundError(f"no run with finished stages under {root}; train one with `posttrain run` or name "
                                f"one with run.name=<run> (run.root=<dir>)")
    return max(runs, key=lambda d: max(p.stat().st_mtime for p in d.glob("*/manifest.json")))


def select(stage_dirs: list[Path], wanted: list[str]) -> list[Path]:
    """Keep the checkpoints named by label (dpo-int8), stage (dpo) or directory (04-dpo); empty keeps all."""
    if not wanted:
        return stage_dirs
    names = {}
    for d in stage_dirs:
        manifest = read_manifest(d) or {}
        for name in (manifest.get("label"), checkpoint_label(manifest.get("stage", "")), manifest.get("stage"), d.name):
            if name:
                names.setdefault(name, d)
    missing = [w for w in wanted if w not in names]
    if missing:
        raise FileNotFoundError(f"eval.checkpoints names {missing}, which the run does not have; it has "
                                f"{sorted(n for n in names if not n[:2].isdigit())}")
    chosen = {names[w] for w in wanted}
    return [d for d in stage_dirs if d in chosen]


def quiet_eval_output() -> None:
    """What the eval prints between its start and the scorecard: a line per checkpoint served and one per checkpoint
    scored (with a progress bar on a terminal). The HTTP stack's per-request lines and matplotlib's note that it
    built its font cache (the report's first figure on a new machine) stay out."""
    quiet_http_logs()
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def evaluate(cfg, run_dir: Path, stage_dirs: list[Path]) -> dict:
    quiet_eval_output()
    eval_cfg = cfg.eval
    # the judge is the run's reward model, whichever checkpoints eval.checkpoints picked to score
    judges = [d for d in stage_dirs_of(run_dir) if (read_manifest(d) or {}).get("stage") == "reward_model"]
    for suite in ("pku_saferlhf", "hh_harmful"):
        # the run's own reward model judges the replies: pku_saferlhf's safe / unsafe, hh_harmful's against the parent
        if suite in eval_cfg.suites and not eval_cfg[suite].reward_model and judges:
            eval_cfg = OmegaConf.merge(eval_cfg, {suite: {"reward_model": str(judges[-1])}})
    card = write_scorecard(run_dir, stage_dirs, eval_cfg, cfg.serve, cfg.seed)
    report = write_report(run_dir, card, stage_dirs)
    log_to_tracking(cfg, run_dir, card)
    print("\n" + render_markdown(card))
    print(f"scorecard: {run_dir / 'scorecard.md'} and {run_dir / 'scorecard.json'}")
    print(f"report: {report}")
    return card


def log_to_tracking(cfg, run_dir: Path, card: dict) -> None:
    """With tracking=wandb, the scorecard becomes a W&B table in an `eval` run of the pipeline's group."""
    if cfg.tracking.backend != "wandb":
        return
    tracking.configure(cfg.tracking, run_dir, Path(run_dir).name, "eval")
    import wandb

    columns = ["checkpoint"] + list(card["suites"]) + ["size_mb", "ttft_ms", "decode_tok_s"]
    table = wandb.Table(columns=columns)
    for row in card["rows"]:
        latency = row.get("latency") or {}
        table.add_data(row["checkpoint"], *[row.get(s) for s in card["suites"]], row["size_mb"],
                       latency.get("ttft_ms"), latency.get("decode_tok_s"))
    run = wandb.init()
    run.log({"scorecard": table})
    run.finish()


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def recorded_eval(cfg, run_dir: Path, overrides: list[str]):
    """The config to rescore `run_dir` with: the eval config and seed the run was last scored with (its
    scorecard.json), with this command line's `eval.<key>=` and `seed=` overrides on top. The composed config's
    defaults (eval=tiny: 100 / 200 / 100 / 100 prompts) would otherwise score a `pipeline=tiny-ci` run on other
    prompts than its own scorecard. A `pipeline=` or `eval=` override, or a run scored before the config was
    recorded, takes the composed config as it is."""
    path = Path(run_dir) / "scorecard.json"
    card = json.loads(path.read_text()) if path.is_file() else {}
    if not card.get("eval_config") or any(_key(o) in ("eval", "pipeline") for o in overrides):
        return cfg
    overridden = {key: OmegaConf.select(cfg, key) for key in dict.fromkeys(_key(o) for o in overrides)
                  if key.startswith("eval.")}
    seed = cfg.seed if any(_key(o) == "seed" for o in overrides) else card.get("seed", cfg.seed)
    cfg = cfg.copy()
    OmegaConf.set_readonly(cfg, False)
    for key, value in card["eval_config"].items():
        if key == "checkpoints" or key not in cfg.eval:  # a key this version no longer has is left out
            continue
        node = cfg.eval[key]
        typed = OmegaConf.is_config(node) and OmegaConf.get_type(node) not in (dict, list, None)
        cfg.eval[key] = OmegaConf.merge(node, value) if typed else value  # a typed block takes all its recorded fields
    for key, value in overridden.items():
        OmegaConf.update(cfg, key, value)
    cfg.seed = seed
    OmegaConf.set_readonly(cfg, True)
    log.info("eval: the run's recorded eval config (%s), seed %s", path, seed)
    return cfg


def main(cfg, overrides: list[str] | None = None) -> Path:
    run_dir = run_dir_of(cfg)[0] if cfg.run.name else latest_run(Path(cfg.run.root))
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    cfg = recorded_eval(cfg, run_dir, overrides or [])
    stage_dirs = select(stage_dirs_of(run_dir), list(cfg.eval.checkpoints))
    if not stage_dirs:
        raise FileNotFoundError(f"{run_dir} has no finished stage to evaluate")
    log.info("eval: %s, checkpoints %s", run_dir, [d.name for d in stage_dirs])
    evaluate(cfg, run_dir, stage_dirs)
    return run_dir
