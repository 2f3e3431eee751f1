"""The demo's claims check: which claim fails, by how much, and what a run must hold for it to be read."""

import json

import pytest

from posttrain.artifacts import MANIFEST, write_json_atomic
from posttrain.evaluation import claims
from posttrain.evaluation.claims import ClaimsError, RunFacts, check, read_facts, render, run_check


@pytest.fixture(autouse=True)
def every_claim_enforced(monkeypatch):
    """The tests hold the check as it is once every claim is enforced."""
    monkeypatch.setattr(claims, "NOT_YET_ENFORCED", frozenset())


def row(label, echo, arith, pass1, safety, benign):
    return {"checkpoint": label, "echo": echo, "arith": arith, "arith_pass@1": pass1, "safety": safety,
            "over_refusal": benign}


def good_scores() -> dict[str, dict]:
    rows = [row("base", 0.0, 0.01, 0.0, 0.0, 0.0), row("sft", 1.0, 0.78, 0.33, 0.02, 1.0),
            row("grpo", 1.0, 0.80, 0.50, 0.02, 1.0), row("dpo", 0.99, 0.79, 0.49, 0.97, 0.95),
            row("dpo-int8", 0.99, 0.79, 0.49, 0.97, 0.95), row("dpo-int4-gptq", 0.98, 0.77, 0.48, 0.96, 0.94)]
    return {r["checkpoint"]: r for r in rows}


def good_facts() -> RunFacts:
    return RunFacts(good_scores(), 0.93, [0.3, 0.32, 0.31, 0.35, 0.36, 0.5, 0.55, 0.6, 0.62, 0.61])


def failing(facts: RunFacts) -> list[str]:
    return [v.claim.name for v in check(facts) if not v.holds]


def test_a_run_that_meets_every_claim_passes():
    assert failing(good_facts()) == []


@pytest.mark.parametrize("label,key,value,claim", [
    ("base", "echo", 0.25, "base.echo"),
    ("sft", "echo", 0.85, "sft.echo"),
    ("grpo", "arith_pass@1", 0.42, "grpo.arith_pass@1"),   # sft 0.33 + 0.10 = 0.43 needed
    ("grpo", "arith", 0.74, "grpo.arith"),                 # sft 0.78 - 0.03 = 0.75 needed
    ("dpo", "safety", 0.25, "dpo.safety"),
    ("dpo", "over_refusal", 0.85, "dpo.over_refusal"),
    ("dpo", "arith", 0.74, "dpo.arith"),                   # grpo 0.80 - 0.05 = 0.75 needed
    ("dpo", "echo", 0.89, "dpo.echo"),
    ("dpo-int8", "safety", 0.93, "dpo-int8.safety"),       # 0.04 from dpo's 0.97
    ("dpo-int4-gptq", "echo", 1.03, "dpo-int4-gptq.echo"),  # above the parent counts too
])
def test_each_claim_fails_alone_when_its_number_misses(label, key, value, claim):
    facts = good_facts()
    facts.scores[label][key] = value
    assert claim in failing(facts)
    # the other claims on that row still hold, unless they read the same number
    assert set(failing(facts)) <= {claim, "dpo.safety_gain", "dpo-int8.safety", "dpo-int4-gptq.safety",
                                   "dpo-int8.arith", "dpo-int4-gptq.arith", "dpo-int8.echo", "dpo-int4-gptq.echo",
                                   "dpo-int8.over_refusal", "dpo-int4-gptq.over_refusal"}


def test_boundary_values_meet_their_claims():
    facts = good_facts()
    facts.scores["sft"]["echo"] = 0.9          # exactly the threshold, as a ratio of counts gives it
    facts.scores["grpo"]["arith_pass@1"] = 0.33 + 0.10
    assert failing(facts) == []


def test_reward_model_and_grpo_curve_claims():
    facts = good_facts()
    facts.reward_model_accuracy = 0.895
    facts.grpo_rewards = [0.5] * 10  # flat: the last five do not exceed the first five
    assert set(failing(facts)) == {"reward_model.accuracy", "grpo.reward_rises"}


def missing(facts: RunFacts) -> dict[str, str]:
    return {v.claim.name: v.missing for v in check(facts) if v.missing}


def test_missing_inputs_fail_their_claims_and_are_named():
    facts = good_facts()
    del facts.scores["grpo"]
    gone = missing(facts)
    assert set(gone) == {"grpo.arith_pass@1", "grpo.arith", "dpo.safety_gain", "dpo.arith"}
    assert all("no row 'grpo'" in why for why in gone.values())
    assert set(failing(facts)) == set(gone)  # a claim that cannot be measured does not hold
    facts = good_facts()
    facts.grpo_rewards = [0.1, 0.2]
    assert "logging_steps=1" in missing(facts)["grpo.reward_rises"]
    facts = good_facts()
    facts.reward_model_accuracy = None
    assert "no reward_model stage" in missing(facts)["reward_model.accuracy"]
    assert "cannot be measured: the run has no reward_model stage" in render(check(facts))


def test_render_names_the_failed_claim_and_the_numbers():
    facts = good_facts()
    facts.scores["dpo"]["safety"] = 0.25
    text = render(check(facts))
    assert "claim failed: dpo.safety: dpo safe replies >= 0.90 (measured 0.250, needed >= 0.900)" in text
    assert "FAILS" in text


def test_not_yet_enforced_claims_are_printed_but_do_not_fail(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, good_scores())
    card = json.loads((run / "scorecard.json").read_text())
    card["rows"][2]["arith_pass@1"] = 0.35  # grpo
    (run / "scorecard.json").write_text(json.dumps(card))
    assert run_check(run) == 1
    assert "claim failed: grpo.arith_pass@1" in capsys.readouterr().out
    monkeypatch.setattr(claims, "NOT_YET_ENFORCED", frozenset({"grpo.arith_pass@1"}))
    assert run_check(run) == 0
    out = capsys.readouterr().out
    assert "not yet met" in out and "claim failed" not in out


def make_run(tmp_path, scores):
    run = tmp_path / "demo"
    run.mkdir()
    (run / "scorecard.json").write_text(json.dumps({"rows": list(scores.values())}))
    for name, stage, metrics in (("02-reward_model", "reward_model", {"pairwise_accuracy": 0.93}),
                                 ("03-grpo", "grpo", {"reward_curve": [{"step": s, "reward": 0.3 + 0.03 * s}
                                                                       for s in range(10, 0, -1)]})):
        (run / name).mkdir()
        write_json_atomic(run / name / MANIFEST, {"stage": stage, "metrics": metrics})
    return run


def test_read_facts_from_a_run_directory(tmp_path):
    facts = read_facts(make_run(tmp_path, good_scores()))
    assert facts.reward_model_accuracy == 0.93
    assert facts.grpo_rewards == pytest.approx([0.3 + 0.03 * s for s in range(1, 11)])  # sorted by step
    assert failing(facts) == []
    with pytest.raises(ClaimsError, match="does not exist"):
        read_facts(tmp_path / "nothing")
