"""The scorecard's judged section: each checkpoint's kept replies against its parent's, scored by a reward model,
as a win rate (win 1, tie 0.5, loss 0) with its interval, and the lines the scorecard prints for it."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import rewards.reward_model
from posttrain.evaluation.comparisons import judged, render_judged
from posttrain.evaluation.suites import Suite
from rewards.refusal import refusal


class LengthJudge:
    """Stands in for the reward model: a longer reply scores higher."""

    loaded: list[str] = []

    def __init__(self, path, **kwargs):
        LengthJudge.loaded.append(str(path))

    def __call__(self, prompts, completions, **kwargs):
        assert len(prompts) == len(completions)
        return [float(len(c)) for c in completions]


@pytest.fixture
def length_judge(monkeypatch):
    LengthJudge.loaded = []
    monkeypatch.setattr(rewards.reward_model, "RewardModelScorer", LengthJudge)
    return LengthJudge


def suite(n: int) -> Suite:
    return Suite("hh_harmful", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)], refusal, (),
                 keep_replies=True)


def test_the_win_rate_counts_wins_ties_and_losses_against_the_parent(length_judge):
    rows = [{"checkpoint": "grpo", "hh_harmful_replies": ["aa", "aa", "aa", "aa"]},
            {"checkpoint": "dpo", "parent": "grpo", "hh_harmful_replies": ["aaa", "aaa", "aa", "a"]},
            {"checkpoint": "dpo-int4", "parent": "dpo"}]  # no replies kept: not judged
    cfg = OmegaConf.create({"hh_harmful": {"reward_model": "/runs/x/01-reward_model"}})
    out = judged(rows, [suite(4)], cfg, seed=0)
    assert len(out) == 1 and length_judge.loaded == ["/runs/x/01-reward_model"]
    j = out[0]
    assert (j["checkpoint"], j["parent"], j["suite"], j["n"], j["ties"]) == ("dpo", "grpo", "hh_harmful", 4, 1)
    assert j["win_rate"] == pytest.approx((1 + 1 + 0.5 + 0) / 4) and j["low"] <= j["win_rate"] <= j["high"]
    lines = "\n".join(render_judged({"judged": out}))
    assert "| dpo | grpo | hh_harmful | 0.625 [" in lines and "(4) | 1 |" in lines
    assert "trained on pairs of the same kind as DPO's" in lines  # the judge's limits are printed beside it


def test_an_all_win_rate_gets_a_wilson_interval_and_nothing_is_judged_without_a_judge(length_judge):
    rows = [{"checkpoint": "grpo", "hh_harmful_replies": ["a"] * 50},
            {"checkpoint": "dpo", "parent": "grpo", "hh_harmful_replies": ["aa"] * 50}]
    cfg = OmegaConf.create({"hh_harmful": {"reward_model": "rm"}})
    j = judged(rows, [suite(50)], cfg)[0]
    assert j["win_rate"] == 1.0 and 0.9 < j["low"] < 1.0 and j["high"] == pytest.approx(1.0)
    assert judged(rows, [suite(50)], OmegaConf.create({"hh_harmful": {"reward_model": None}})) == []
    assert render_judged({"judged": []}) == []
