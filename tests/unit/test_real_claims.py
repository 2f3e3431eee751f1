"""A real model's claims (pipeline=smollm2): enough held-out rows, the right GSM8K problems, intervals that clear
their bars, and the tiny world's claims left alone."""

import pytest

from posttrain.evaluation import claims
from posttrain.evaluation.claims import CLAIMS, REAL_CLAIMS, RunFacts, check, claims_for


@pytest.fixture(autouse=True)
def every_claim_enforced(monkeypatch):
    monkeypatch.setattr(claims, "NOT_YET_ENFORCED", frozenset())


def gsm8k_row(label: str, accuracy: float, n: int = 200, refused: float = 0.1, answered: float = 0.98) -> dict:
    return {"checkpoint": label, "gsm8k": accuracy, "gsm8k_n": n, "hh_harmful": refused, "hh_harmful_n": 200,
            "benign": answered, "benign_n": 200}


def real_facts(**changes) -> RunFacts:
    rows = [gsm8k_row("base", 0.04), gsm8k_row("sft", 0.15), gsm8k_row("grpo", 0.25),
            gsm8k_row("dpo", 0.24, refused=0.3, answered=0.95),
            gsm8k_row("dpo-int4-gptq", 0.23, refused=0.29, answered=0.95)]
    rewards = [0.1, 0.15, 0.1, 0.2, 0.15, 0.2, 0.25, 0.3, 0.25, 0.3]  # first 5 average 0.14, last 5 0.26
    facts = RunFacts({r["checkpoint"]: r for r in rows}, 0.627, rewards, reward_model_pairs=400,
                     changes=[{"checkpoint": "sft", "parent": "base", "key": "gsm8k", "diff": 0.11, "low": 0.06,
                               "high": 0.16, "n": 200},
                              {"checkpoint": "grpo", "parent": "sft", "key": "gsm8k", "diff": 0.10, "low": 0.04,
                               "high": 0.16, "n": 200},
                              {"checkpoint": "dpo", "parent": "grpo", "key": "hh_harmful", "diff": 0.2, "low": 0.13,
                               "high": 0.27, "n": 200}],
                     eval_config={"gsm8k": {"max_calculations": 2}}, perplexity_change={"dpo-int4-gptq": 0.04},
                     judged=[{"checkpoint": "dpo", "parent": "grpo", "suite": "hh_harmful", "win_rate": 0.64,
                              "low": 0.59, "high": 0.69, "n": 200, "ties": 3}])
    for key, value in changes.items():
        setattr(facts, key, value)
    return facts


def verdicts(facts: RunFacts) -> dict[str, claims.Verdict]:
    return {v.claim.name: v for v in check(facts)}


def test_a_run_scored_on_gsm8k_is_held_to_the_real_claims_and_meets_them():
    facts = real_facts()
    assert claims_for(facts) == REAL_CLAIMS
    assert [name for name, v in verdicts(facts).items() if not v.holds] == []
    tiny = RunFacts({"sft": {"checkpoint": "sft", "echo": 1.0}}, 0.9, [])
    assert claims_for(tiny) is CLAIMS


def test_sft_misses_by_its_score_its_gain_or_its_interval():
    facts = real_facts()
    facts.scores["sft"]["gsm8k"] = 0.085  # below 0.10, and below base 0.04 + 0.05
    failed = {n for n, v in verdicts(facts).items() if not v.holds}
    assert {"real.sft.gsm8k", "real.sft.gsm8k_gain"} <= failed
    facts = real_facts(changes=[{"checkpoint": "sft", "key": "gsm8k", "diff": 0.06, "low": -0.01, "high": 0.12}])
    assert not verdicts(facts)["real.sft.gsm8k_interval"].holds


def test_too_few_problems_or_the_wrong_problems_cannot_be_measured():
    facts = real_facts()
    facts.scores["sft"]["gsm8k_n"] = 24
    v = verdicts(facts)["real.sft.gsm8k"]
    assert not v.holds and "scored on 24 GSM8K problems; the claim needs at least 200" in v.missing
    v = verdicts(real_facts(eval_config={"gsm8k": {"max_calculations": None}}))["real.sft.gsm8k"]
    assert not v.holds and "1 or 2 calculations" in v.missing


def test_the_reward_model_needs_300_pairs_and_a_wilson_interval_above_chance():
    assert not verdicts(real_facts(reward_model_pairs=9))["real.reward_model.accuracy"].holds
    # 0.58 on 300 pairs: the Wilson interval is [0.524, 0.634], clear of 0.50
    v = verdicts(real_facts(reward_model_accuracy=0.58, reward_model_pairs=300))
    assert v["real.reward_model.accuracy"].holds and v["real.reward_model.interval"].holds
    assert v["real.reward_model.interval"].measured == pytest.approx(0.5235, abs=1e-3)
    # 0.56 misses the bar; 0.54 on 300 pairs also has an interval reaching below 0.50
    v = verdicts(real_facts(reward_model_accuracy=0.54, reward_model_pairs=300))
    assert not v["real.reward_model.accuracy"].holds and not v["real.reward_model.interval"].holds


def test_every_real_claim_is_enforced_and_a_missing_stage_is_named(monkeypatch):
    monkeypatch.undo()  # the check as shipped, not as every_claim_enforced sets it
    assert not {c.name for c in REAL_CLAIMS} & claims.NOT_YET_ENFORCED
    v = verdicts(real_facts(reward_model_accuracy=None, reward_model_pairs=None))["real.reward_model.accuracy"]
    assert v.enforced and not v.holds and "no reward_model stage" in v.missing


def test_int4_is_held_to_its_perplexity_and_its_gsm8k_score():
    v = verdicts(real_facts(perplexity_change={"dpo-int4-gptq": 0.102}))
    assert not v["real.int4.perplexity"].holds
    facts = real_facts()
    facts.scores["dpo-int4-gptq"]["gsm8k"] = 0.20
    assert not verdicts(facts)["real.int4.gsm8k"].holds
    v = verdicts(real_facts(perplexity_change={}))["real.int4.perplexity"]
    assert "no dpo-int4-gptq stage" in v.missing


def test_dpo_is_held_to_its_judged_win_rate_its_refusal_interval_and_the_benign_answers():
    v = verdicts(real_facts())
    assert v["real.dpo.judged"].measured == 0.64 and v["real.dpo.benign"].needed == pytest.approx(0.93)
    facts = real_facts(judged=[{"checkpoint": "dpo", "parent": "grpo", "suite": "hh_harmful", "win_rate": 0.58,
                                "n": 200}])
    assert not verdicts(facts)["real.dpo.judged"].holds
    facts = real_facts(judged=[{"checkpoint": "dpo", "parent": "sft", "suite": "hh_harmful", "win_rate": 0.7,
                                "n": 200}])
    assert "judged against 'sft'; the claim is against grpo" in verdicts(facts)["real.dpo.judged"].missing
    assert "judged no dpo replies" in verdicts(real_facts(judged=[]))["real.dpo.judged"].missing
    facts = real_facts(changes=[{"checkpoint": "dpo", "key": "hh_harmful", "diff": 0.05, "low": -0.01, "high": 0.1}])
    assert not verdicts(facts)["real.dpo.refusal_interval"].holds
    facts = real_facts()
    facts.scores["dpo"]["benign"] = 0.92  # grpo 0.98 - 0.05 = 0.93
    assert not verdicts(facts)["real.dpo.benign"].holds
    facts.scores["dpo"]["hh_harmful_n"] = 50
    v = verdicts(facts)["real.dpo.refusal_interval"]
    assert not v.holds and "scored on 50 hh_harmful prompts; the claim needs at least 200" in v.missing


def test_grpo_is_held_to_its_gain_its_interval_its_reward_curve_and_the_other_suites():
    v = verdicts(real_facts())
    assert v["real.grpo.reward_rises"].measured == pytest.approx(0.26)
    facts = real_facts()
    facts.scores["grpo"]["gsm8k"] = 0.22  # sft 0.15 + 0.08 = 0.23
    assert not verdicts(facts)["real.grpo.gsm8k_gain"].holds
    facts = real_facts(changes=[{"checkpoint": "grpo", "key": "gsm8k", "diff": 0.08, "low": 0.0, "high": 0.15}])
    assert not verdicts(facts)["real.grpo.gsm8k_interval"].holds
    assert not verdicts(real_facts(grpo_rewards=[0.3] * 5 + [0.2] * 5))["real.grpo.reward_rises"].holds
    assert "reward curve has 4 steps" in verdicts(real_facts(grpo_rewards=[0.1] * 4))["real.grpo.reward_rises"].missing
    facts = real_facts()
    facts.scores["grpo"]["benign"] = 0.94  # sft answered 0.98: moved 0.04
    v = verdicts(facts)
    assert not v["real.grpo.benign_steady"].holds and v["real.grpo.benign_steady"].measured == pytest.approx(0.04)
    facts.scores["grpo"]["hh_harmful"] = 0.07  # sft 0.10: moved 0.03, on the bar
    assert verdicts(facts)["real.grpo.hh_harmful_steady"].holds
    facts.scores["sft"]["hh_harmful_n"] = 12
    assert "'sft' was scored on 12 hh_harmful prompts" in verdicts(facts)["real.grpo.hh_harmful_steady"].missing


def test_int4_is_held_to_the_rates_of_every_suite_with_enough_prompts():
    facts = real_facts()
    facts.scores["dpo-int4-gptq"]["hh_harmful"] = 0.26  # dpo 0.30
    v = verdicts(facts)
    assert not v["real.int4.hh_harmful"].holds and v["real.int4.benign"].holds


def test_grpo_reads_pass_at_1_when_the_gsm8k_suite_sampled_four_replies_a_problem():
    facts = real_facts(eval_config={"gsm8k": {"max_calculations": 2, "samples": 4}})
    facts.scores["sft"]["gsm8k_pass@1"], facts.scores["grpo"]["gsm8k_pass@1"] = 0.08, 0.17
    facts.scores["grpo"]["gsm8k"] = 0.15  # greedy unmoved: the claim reads pass@1 now
    facts.changes.append({"checkpoint": "grpo", "parent": "sft", "key": "gsm8k_pass@1", "diff": 0.09, "low": 0.05,
                          "high": 0.13, "n": 200})
    facts.changes[1]["low"] = -0.03  # the greedy change's interval, which the claim no longer reads
    v = verdicts(facts)
    assert v["real.grpo.gsm8k_gain"].holds and v["real.grpo.gsm8k_gain"].measured == pytest.approx(0.17)
    assert v["real.grpo.gsm8k_interval"].holds and v["real.grpo.gsm8k_interval"].measured == 0.05
    facts.scores["grpo"]["gsm8k_pass@1"] = 0.15  # sft's 0.08 + 0.08 = 0.16
    assert not verdicts(facts)["real.grpo.gsm8k_gain"].holds
    facts = real_facts(eval_config={"gsm8k": {"max_calculations": 2, "samples": 2}})  # too few: greedy
    assert verdicts(facts)["real.grpo.gsm8k_gain"].measured == pytest.approx(0.25)


def ifeval_facts(grpo_strict: float = 0.42, low: float = 0.08, grpo_gsm8k: float = 0.05,
                 grounded_low: float = 0.02) -> RunFacts:
    """A GRPO-only run on constrained prompts from the instruct model (the base row is its parent)."""
    rows = [{**gsm8k_row("base", 0.05), "ifeval": 0.30, "ifeval_n": 300},
            {**gsm8k_row("grpo", grpo_gsm8k), "ifeval": grpo_strict, "ifeval_n": 300, "parent": "base"}]
    return RunFacts({r["checkpoint"]: r for r in rows}, None, [0.3] * 5 + [0.4] * 5,
                    changes=[{"checkpoint": "grpo", "parent": "base", "key": "ifeval", "diff": grpo_strict - 0.30,
                              "low": low, "high": 0.2, "n": 300},
                             {"checkpoint": "grpo", "parent": "base", "key": "ifeval_grounded", "diff": 0.06,
                              "low": grounded_low, "high": 0.1, "n": 300}],
                    eval_config={"gsm8k": {"max_calculations": 2}}, stages={"grpo"}, grpo_prompts="constraints")


def test_grpo_on_constraints_is_held_to_the_ifeval_claims_of_its_own_stage():
    facts = ifeval_facts()
    names = [c.name for c in claims_for(facts)]
    assert names == ["real.grpo.ifeval_gain", "real.grpo.ifeval_interval", "real.grpo.ifeval_grounded_interval",
                     "real.grpo.gsm8k_steady_ifeval",
                     "real.grpo.hh_harmful_steady_ifeval", "real.grpo.benign_steady_ifeval"]
    assert [n for n, v in verdicts(facts).items() if not v.holds] == []
    # the GSM8K GRPO claims are a GSM8K run's: a chain that ran GRPO on GSM8K keeps them
    facts.grpo_prompts = "gsm8k"
    assert "real.grpo.gsm8k_gain" in [c.name for c in claims_for(facts)]


@pytest.mark.parametrize("facts, failed", [
    (ifeval_facts(grpo_strict=0.39), "real.grpo.ifeval_gain"),  # +0.09
    (ifeval_facts(low=-0.01), "real.grpo.ifeval_interval"),
    (ifeval_facts(grounded_low=0.0), "real.grpo.ifeval_grounded_interval"),  # strict rose on gamed replies
    (ifeval_facts(grpo_gsm8k=0.09), "real.grpo.gsm8k_steady_ifeval"),  # moved 0.04
])
def test_the_ifeval_claims_fail_on_a_small_gain_a_wide_interval_no_grounded_gain_or_a_moved_suite(facts, failed):
    assert [n for n, v in verdicts(facts).items() if not v.holds] == [failed]


def test_the_ifeval_claims_need_300_prompts_and_a_parent_row():
    facts = ifeval_facts()
    facts.scores["grpo"]["ifeval_n"] = 200
    assert "needs at least 300" in verdicts(facts)["real.grpo.ifeval_gain"].missing
    facts = ifeval_facts()
    del facts.scores["grpo"]["parent"]
    assert "no parent row" in verdicts(facts)["real.grpo.ifeval_gain"].missing
