"""`posttrain eval` on a scored run rescores with the eval config and seed the run recorded."""

import json

from posttrain.config import compose
from posttrain.evaluation.run import recorded_eval
from posttrain.evaluation.scorecard import recordable


def scored_run(tmp_path, overrides):
    cfg = compose(overrides)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "scorecard.json").write_text(json.dumps({"eval_config": recordable(cfg.eval), "seed": cfg.seed}))
    return run_dir


def test_rescoring_uses_the_runs_prompt_counts_and_seed_with_eval_overrides_on_top(tmp_path):
    run_dir = scored_run(tmp_path, ["pipeline=tiny-ci", "seed=2"])
    recorded = compose(["pipeline=tiny-ci", "seed=2"])
    default = compose([])
    assert dict(default.eval.n_prompts) != dict(recorded.eval.n_prompts)  # what the bug scored with

    overrides = ["eval.checkpoints=[dpo]", "eval.latency.requests=2"]
    cfg = recorded_eval(compose(overrides), run_dir, overrides)
    assert dict(cfg.eval.n_prompts) == dict(recorded.eval.n_prompts) and cfg.seed == 2
    assert list(cfg.eval.checkpoints) == ["dpo"] and cfg.eval.latency.requests == 2
    assert cfg.eval.samples == recorded.eval.samples

    cfg = recorded_eval(compose(["seed=5"]), run_dir, ["seed=5"])
    assert cfg.seed == 5 and dict(cfg.eval.n_prompts) == dict(recorded.eval.n_prompts)
    assert list(cfg.eval.checkpoints) == []  # the selection is not part of what the run recorded


def test_a_pipeline_or_eval_group_override_or_an_unrecorded_run_takes_the_composed_config(tmp_path):
    run_dir = scored_run(tmp_path, ["pipeline=tiny-ci"])
    for overrides in (["pipeline=tiny"], ["eval=tiny"]):
        composed = compose(overrides)
        assert recorded_eval(composed, run_dir, overrides) is composed
    (run_dir / "scorecard.json").write_text(json.dumps({"rows": []}))  # scored before the config was recorded
    composed = compose([])
    assert recorded_eval(composed, run_dir, []) is composed
    assert recorded_eval(composed, tmp_path / "never-scored", []) is composed


def test_the_runs_reward_model_judges_whichever_checkpoints_eval_picks(tmp_path, monkeypatch):
    """`posttrain eval 'eval.checkpoints=[grpo,dpo]'` on a run with a reward model: dpo's hh_harmful replies are
    still judged against grpo's by that reward model, though it is not among the checkpoints scored. The judge was
    looked for among the picked checkpoints only, and the win rate silently went missing."""
    from posttrain.evaluation import run

    run_dir = tmp_path / "run"
    stages = {"00-sft": "sft", "01-reward_model": "reward_model", "02-grpo": "grpo", "03-dpo": "dpo"}
    for name in stages:
        (run_dir / name).mkdir(parents=True)
    monkeypatch.setattr(run, "read_manifest", lambda d: {"stage": stages[d.name]} if d.name in stages else None)
    used = {}
    monkeypatch.setattr(run, "write_scorecard", lambda rd, dirs, eval_cfg, serve_cfg, seed: used.update(
        dirs=[d.name for d in dirs], judge=eval_cfg.hh_harmful.reward_model) or {})
    monkeypatch.setattr(run, "write_report", lambda *args: run_dir / "report.html")
    monkeypatch.setattr(run, "render_markdown", lambda card: "")
    cfg = compose(["pipeline=smollm2"])
    picked = run.select(run.stage_dirs_of(run_dir), ["grpo", "dpo"])
    run.evaluate(cfg, run_dir, picked)
    assert used == {"dirs": ["02-grpo", "03-dpo"], "judge": str(run_dir / "01-reward_model")}
