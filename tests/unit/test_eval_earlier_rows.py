"""`posttrain eval` on a subset of a scored run's checkpoints keeps the other rows of the last scorecard when they
are comparable (same eval config and seed, unchanged artifacts), so the claims read one scorecard. Scoring the int4
copy alone used to leave a scorecard with only the int4 row, and every claim about grpo and dpo then failed."""

import json

import pytest
from omegaconf import OmegaConf

from posttrain.artifacts import manifest_sha256
from posttrain.evaluation import scorecard
from posttrain.evaluation.earlier import earlier_rows, with_earlier_rows

SCORES = {"sft": [0.0, 1.0, 0.0, 0.0], "dpo": [1.0, 1.0, 0.0, 0.0]}


def make_run(tmp_path):
    """A run whose sft -> dpo chain has real manifest files (their hashes link parent and child)."""
    run = tmp_path / "run"
    sft, dpo = run / "00-sft", run / "01-dpo"
    sft.mkdir(parents=True)
    (sft / "manifest.json").write_text(json.dumps({"stage": "sft", "parent": None}))
    dpo.mkdir()
    parent = {"manifest_sha256": manifest_sha256(sft)}
    (dpo / "manifest.json").write_text(json.dumps({"stage": "dpo", "parent": parent}))
    return run, sft, dpo


def score(monkeypatch, run, stage_dirs, scores, seed=0, n_prompts=4, base=False):
    served = []

    def fake_score_model(row, model_dir, suites, eval_cfg, serve_cfg, seed):
        served.append(row["checkpoint"])
        values = scores[row["checkpoint"]]
        return dict(row, size_mb=1.0, echo=sum(values) / len(values), echo_n=len(values), echo_ci=(0.0, 1.0),
                    echo_scores=values)

    stages = {d.name: json.loads((d / "manifest.json").read_text())["stage"] for d in stage_dirs}
    monkeypatch.setattr(scorecard, "score_model", fake_score_model)
    monkeypatch.setattr(scorecard, "verify_artifact", lambda d: {"stage": stages[d.name]})
    monkeypatch.setattr(scorecard, "build_suites", lambda cfg, seed: [])
    monkeypatch.setattr(scorecard, "base_model", lambda dirs: {"source": "tiny", "location": None})
    monkeypatch.setattr(scorecard, "render_base_model", lambda info: [])
    eval_cfg = OmegaConf.create({"suites": ["echo"], "base": base, "checkpoints": [], "n_prompts": {"echo": n_prompts},
                                 "latency": {"requests": 0}})
    card = scorecard.write_scorecard(run, stage_dirs, eval_cfg, OmegaConf.create({"backend": "vllm"}), seed)
    return card, served


def test_scoring_one_checkpoint_keeps_the_others_rows_and_pairs_it_with_its_kept_parent(monkeypatch, tmp_path):
    run, sft, dpo = make_run(tmp_path)
    score(monkeypatch, run, [sft, dpo], SCORES)
    card, served = score(monkeypatch, run, [dpo], {"dpo": [1.0, 1.0, 1.0, 0.0]})
    assert served == ["dpo"]
    assert [r["checkpoint"] for r in card["rows"]] == ["sft", "dpo"]
    assert card["rows"][0]["echo_scores"] == SCORES["sft"] and card["rows"][1]["echo"] == pytest.approx(0.75)
    assert card["rows"][1]["parent"] == "sft"
    assert [(c["checkpoint"], c["parent"]) for c in card["changes"]] == [("dpo", "sft")]
    assert card["changes"][0]["diff"] == pytest.approx(0.5)  # the new dpo scores against the kept sft scores
    on_disk = json.loads((run / "scorecard.json").read_text())
    assert [r["checkpoint"] for r in on_disk["rows"]] == ["sft", "dpo"]


@pytest.mark.parametrize("change", ["seed", "n_prompts"])
def test_rows_scored_with_another_eval_config_or_seed_are_replaced(monkeypatch, tmp_path, change):
    run, sft, dpo = make_run(tmp_path)
    score(monkeypatch, run, [sft, dpo], SCORES)
    kwargs = {"seed": 1} if change == "seed" else {"n_prompts": 8}
    card, _ = score(monkeypatch, run, [dpo], SCORES, **kwargs)
    assert [r["checkpoint"] for r in card["rows"]] == ["dpo"] and card["changes"] == []


def test_a_row_whose_artifact_changed_since_it_was_scored_is_dropped(monkeypatch, tmp_path):
    run, sft, dpo = make_run(tmp_path)
    score(monkeypatch, run, [sft, dpo], SCORES)
    (sft / "manifest.json").write_text(json.dumps({"stage": "sft", "parent": None, "retrained": True}))
    card, _ = score(monkeypatch, run, [dpo], SCORES)
    assert [r["checkpoint"] for r in card["rows"]] == ["dpo"]


def test_which_rows_are_picked_does_not_stop_the_merge(tmp_path):
    """`base` and `checkpoints` choose rows, not how they are scored: a scorecard written with eval.base=true is
    still comparable with an eval of one checkpoint and eval.base=false, and its base row is kept."""
    run, sft, _ = make_run(tmp_path)
    config = {"suites": ["echo"], "n_prompts": {"echo": 4}}
    rows = [{"checkpoint": "base", "artifact": "smollm2"},
            {"checkpoint": "sft", "artifact": str(sft), "manifest_sha256": manifest_sha256(sft)}]
    (run / "scorecard.json").write_text(json.dumps({"rows": rows, "seed": 0, "eval_config": dict(config, base=True)}))
    kept = earlier_rows(run, dict(config, base=False), 0)
    assert [r["checkpoint"] for r in kept] == ["base", "sft"]
    merged = with_earlier_rows([{"checkpoint": "dpo", "artifact": str(run / "01-dpo")}], kept)
    assert [r["checkpoint"] for r in merged] == ["base", "sft", "dpo"]
    (run / "scorecard.json").write_text("{not json")
    assert earlier_rows(run, config, 0) == []
