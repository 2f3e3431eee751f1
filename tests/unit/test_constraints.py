"""Instruction-constraint verifiers (rewards/constraints.py: IFEval's checkers) and the constrained prompt set
(posttrain/data/constraints.py): each type passes and fails where it should, what replies that game it get, and a
split that shares no prompt and no constraint parameter between train and held-out rows."""

from __future__ import annotations

import pytest

from posttrain.data.constraints import PARAMETERS, constrained_rows, overlap
from posttrain.data.dolly import DataError
from rewards import REWARDS
from rewards.constraints import (SUPPORTED, check_reply, copied_example, describe, grounded, instruction_grounded,
                                 instruction_loose, instruction_strict)
from tests.conftest import shared_path

# type: (kwargs, a reply that meets it, one that does not, what an empty reply, the constraint's own text restated
# as the reply, and a one-word reply "Four" get under the strict rule). Restating the instruction meets six types,
# since IFEval's wording carries its own example (a <<title>>, the keyword, "* bullet", "*highlighted section*",
# "P.S.", many a's); "Four" meets the limits a short reply cannot break (no commas, under 5 words, no "very").
CASES = {
    "change_case:english_lowercase": ({}, "the answer is four.", "The answer is four.", False, False, False),
    "change_case:english_capital": ({}, "THE ANSWER IS FOUR.", "The answer is four.", False, False, False),
    "punctuation:no_comma": ({}, "Yes it is four.", "Yes, it is four.", False, False, True),
    "detectable_format:json_format": ({}, '{"answer": 4}', "The answer is 4.", False, False, False),
    "detectable_format:title": ({}, "<<Four>>\nThe answer is 4.", "Four\nThe answer is 4.", False, True, False),
    "startend:quotation": ({}, '"The answer is 4."', "The answer is 4.", False, False, False),
    "startend:end_checker": ({"end_phrase": "Hope this helps."}, "The answer is 4. Hope this helps.",
                             "Hope this helps. The answer is 4.", False, False, False),
    "length_constraints:number_words": ({"num_words": 5, "relation": "less than"}, "It is four.",
                                        "The answer to this is four apples.", False, False, True),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "First part.\n***\nSecond part.",
                                             "First part.\nSecond part.", False, False, False),
    "keywords:existence": ({"keywords": ["simple"]}, "A simple answer: 4.", "The answer is 4.", False, True, False),
    "keywords:forbidden_words": ({"forbidden_words": ["very"]}, "It is four.", "It is very much four.", False, False,
                                 True),
    "keywords:frequency": ({"keyword": "step", "frequency": 2, "relation": "at least"},
                           "One step, then another step.", "One step only.", False, False, False),
    "keywords:letter_frequency": ({"letter": "a", "let_frequency": 3, "let_relation": "at least"}, "a banana", "no",
                                  False, True, False),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* one\n* two", "* one\n* two\n* three", False,
                                              True, False),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 1}, "The *answer* is 4.", "The answer is 4.",
                                                      False, True, False),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "It is 4.\nP.S. I checked.", "It is 4.", False,
                                      True, False),
}


def test_every_supported_type_has_a_case():
    assert set(CASES) == set(SUPPORTED) and len(SUPPORTED) >= 12


@pytest.mark.parametrize("cid", sorted(CASES))
def test_each_type_passes_fails_and_scores_gaming_replies_as_ifeval_does(cid):
    kwargs, good, bad, empty, restated, one_word = CASES[cid]
    constraint = [{"id": cid, "kwargs": kwargs}]
    strict = lambda reply: check_reply(reply, constraint)[0]["strict"]  # noqa: E731
    assert (strict(good), strict(bad)) == (True, False)
    assert (strict(""), strict(describe(constraint[0])), strict("Four")) == (empty, restated, one_word)


# IFEval's lowercase and capitals checkers also need langdetect to call the reply English, and on short or
# upper-cased text it often does not (its seed is fixed, so a reply always gets the same verdict): these replies are
# in the right case and still fail. Measured on 400 GSM8K test solutions cut to 15 words: 3.5% of the lowercased and
# 34% of the upper-cased ones fail so (at 40 words 1.0% and 22%), so a correct all-caps reply often scores 0.
LANGDETECT_REJECTS = [("change_case:english_lowercase", "hello"), ("change_case:english_lowercase", "yes"),
                      ("change_case:english_capital", "SHE HAS 12 APPLES LEFT."),
                      ("change_case:english_capital", "HELLO")]


@pytest.mark.parametrize("cid, reply", LANGDETECT_REJECTS)
def test_correct_case_replies_that_langdetect_does_not_call_english_fail(cid, reply):
    assert reply.islower() or reply.isupper()
    assert check_reply(reply, [{"id": cid, "kwargs": {}}]) == [{"id": cid, "strict": False, "loose": False}]


def test_rewards_score_rows_and_skip_rows_without_constraints():
    c = [{"id": "punctuation:no_comma", "kwargs": {}}]
    assert REWARDS["instruction_strict"] is instruction_strict
    assert instruction_strict(["a, b", "a b", "   "], constraints=[c, c, c]) == [0.0, 1.0, 0.0]
    assert instruction_strict(["a b"], constraints=[[]]) == [None]
    assert instruction_strict(["a b", "c"]) == [None, None]  # a row set without the column
    both = c + [{"id": "change_case:english_lowercase", "kwargs": {}}]
    # every constraint must hold (the lowercase checker also needs langdetect to call the reply English)
    assert instruction_strict(["the answer is four", "The answer is four"], constraints=[both, both]) == [1.0, 0.0]
    # loose: a first line such as "Sure!" does not decide it, markdown asterisks neither
    lower = [{"id": "change_case:english_lowercase", "kwargs": {}}]
    replies = ["Sure!\nthe answer to this question is four", "**the** answer to this question is four"]
    assert instruction_loose(replies, constraints=[lower, lower]) == [1.0, 1.0]
    assert instruction_strict(replies[:1], constraints=[lower]) == [0.0]


def test_unknown_ids_and_missing_parameters_are_refused():
    with pytest.raises(ValueError, match="'length_constraints:number_sentences' is not supported"):
        instruction_strict(["x"], constraints=[[{"id": "length_constraints:number_sentences", "kwargs": {}}]])
    with pytest.raises(ValueError, match=r"needs kwargs \['end_phrase'\]"):
        describe({"id": "startend:end_checker", "kwargs": {}})
    # a datasets column holds the union of every type's kwargs, None where absent
    assert describe({"id": "startend:end_checker", "kwargs": {"end_phrase": "Bye.", "num_words": None}}).endswith(
        "Bye.. No other words should follow this phrase.")


@pytest.fixture(scope="module")
def split():
    gsm8k = shared_path("data", "gsm8k", "train.jsonl")
    dolly = shared_path("data", "dolly", "dolly_derived_alpaca_prompt_validation_151.jsonl")
    return (constrained_rows("train", None, 0, str(gsm8k), str(dolly)),
            constrained_rows("held_out", None, 0, str(gsm8k), str(dolly)))


def test_the_split_shares_no_prompt_and_no_parameter(split):
    train, held_out = split
    assert len(held_out) >= 300 and len(train) > 4000
    assert overlap(train, held_out) == {"prompts": [], "parameters": []}
    assert {r["type"] for r in held_out[:300]} == set(SUPPORTED)  # every type is measured
    row = held_out[0]
    assert row["prompt"][0]["content"].endswith(describe(row["constraints"][0]))
    # the check sees a row moved across: its prompt, and its parameters when it has any
    moved = next(r for r in held_out if r["type"] in PARAMETERS)
    found = overlap(train + [moved], held_out)
    assert found["prompts"] == [moved["base_id"]] and found["parameters"]


def test_the_split_depends_on_the_seed_only_and_refuses_too_many_rows(split):
    gsm8k = str(shared_path("data", "gsm8k", "train.jsonl"))
    assert constrained_rows("held_out", 20, 0, gsm8k, None) == constrained_rows("held_out", 20, 0, gsm8k, None)
    assert constrained_rows("held_out", 20, 1, gsm8k, None) != constrained_rows("held_out", 20, 0, gsm8k, None)
    with pytest.raises(DataError, match="the held_out split has 480 constrained prompts; 500 were asked for"):
        constrained_rows("held_out", 500, 0, gsm8k, None)
    with pytest.raises(ValueError, match="not supported"):
        constrained_rows("train", 5, 0, gsm8k, None, types=["language:response_language"])


def test_bad_base_rows_name_the_file_row_and_field(tmp_path):
    bad = tmp_path / "alpaca.jsonl"
    bad.write_text('{"prompt": "no instruction here"}\n')
    with pytest.raises(DataError, match=rf"{bad}: row 1: field 'prompt' is not an Alpaca prompt"):
        constrained_rows("train", 1, 0, None, str(bad))


def test_the_ifeval_suite_scores_strict_and_puts_loose_and_each_type_in_the_scorecard():
    from posttrain.evaluation.scorecard import record_greedy, render_ifeval_types
    from posttrain.evaluation.suites import build_suite

    gsm8k = str(shared_path("data", "gsm8k", "train.jsonl"))
    suite = build_suite("ifeval", 32, 0, split_seed=0, gsm8k_path=gsm8k)
    assert [r["messages"] for r in suite.rows] == [r["prompt"] for r in constrained_rows("held_out", 32, 0, gsm8k,
                                                                                        None)]
    # "Sure!" on a line of its own, then a reply that meets no commas: strict fails where loose passes
    replies = ["Sure!\nit is four" if r["type"] == "change_case:english_lowercase" else "Four" for r in suite.rows]
    row = {"checkpoint": "grpo"}
    record_greedy(row, suite, replies, seed=0)
    types = row["ifeval_types"]
    assert sum(t["n"] for t in types.values()) == 32 and set(types) == set(SUPPORTED)
    assert types["punctuation:no_comma"]["strict"] == 1.0 and types["startend:quotation"]["strict"] == 0.0
    assert row["ifeval"] == sum(row["ifeval_scores"]) / 32 and row["ifeval_loose"] >= row["ifeval"]
    assert len(row["ifeval_replies"]) == 32  # kept, so a later rule can rescore them
    table = "\n".join(render_ifeval_types([row]))
    assert "| grpo | " in table and "punctuation:no_comma (n)" in table


def test_constraints_survive_a_datasets_column_as_grpo_hands_them_to_the_reward():
    # GRPOTrainer passes the `constraints` column of a datasets.Dataset: Arrow gives every row the union of all
    # types' kwargs, None where absent; the reward reads that as the row's own kwargs
    from datasets import Dataset

    gsm8k = str(shared_path("data", "gsm8k", "train.jsonl"))
    rows = constrained_rows("train", 48, 0, gsm8k, None)
    column = Dataset.from_list(rows)["constraints"]
    assert column[0][0]["id"] == rows[0]["constraints"][0]["id"] and None in column[0][0]["kwargs"].values()
    replies = ["Four", "the answer is four.", "<<Four>>\n* one\n* two\nIs there anything else I can help with?"] * 16
    assert instruction_strict(replies, constraints=column) == instruction_strict(
        replies, constraints=[r["constraints"] for r in rows])
    dataset = Dataset.from_list(rows)
    answers = [f"{' '.join(r['base_words'][:3])}." for r in rows]  # three of the prompt's own content words
    scores = instruction_grounded(answers, constraints=dataset["constraints"], base_words=dataset["base_words"])
    assert scores == instruction_grounded(answers, constraints=[r["constraints"] for r in rows],
                                          base_words=[r["base_words"] for r in rows])
    assert 0 < sum(scores) <= sum(instruction_strict(answers, constraints=column))


def test_grpo_prompt_source_constraints_gives_the_train_split_and_refuses_max_calculations():
    from types import SimpleNamespace

    from posttrain.data.prompts import load_prompts

    gsm8k = str(shared_path("data", "gsm8k", "train.jsonl"))
    cfg = SimpleNamespace(source="constraints", path=gsm8k, n=40, dolly_path=None, types=None, max_calculations=None)
    rows, record = load_prompts(cfg, 0)
    assert rows == constrained_rows("train", 40, 0, gsm8k, None) and "constraints" in rows[0]
    assert record["card"] == "data_cards/ifeval-constraints.md" and record["rows"] == 40
    held_out = {r["base_id"] for r in constrained_rows("held_out", None, 0, gsm8k, None)}
    assert not held_out & {r["base_id"] for r in rows}
    with pytest.raises(ValueError, match="max_calculations"):
        load_prompts(SimpleNamespace(**{**vars(cfg), "max_calculations": 2}), 0)


def test_the_loose_score_is_paired_against_the_parent_and_each_type_shows_both_rates():
    from posttrain.evaluation.comparisons import changes
    from posttrain.evaluation.scorecard import render_ifeval_types

    per_type = {"punctuation:no_comma": {"n": 2, "strict": 0.5, "loose": 1.0}}
    base = {"checkpoint": "base", "ifeval": 0.0, "ifeval_scores": [0.0, 0.0], "ifeval_loose": 0.5,
            "ifeval_loose_scores": [0.0, 1.0], "ifeval_loose_ci": (0.1, 0.9), "ifeval_types": per_type}
    grpo = {**base, "checkpoint": "grpo", "parent": "base", "ifeval": 0.5, "ifeval_scores": [1.0, 0.0],
            "ifeval_loose_scores": [1.0, 1.0]}
    found = {c["key"]: c["diff"] for c in changes([base, grpo], ["ifeval"])}
    assert found == {"ifeval": 0.5, "ifeval_loose": 0.5}
    assert "| base | 0.000 | 0.500 [0.100, 0.900] | n/a | 0.50 / 1.00 (2) |" in render_ifeval_types([base, grpo])
    base.update(ifeval_grounded=0.0, ifeval_grounded_scores=[0.0, 0.0], ifeval_grounded_ci=(0.0, 0.0))
    grpo.update(ifeval_grounded=0.5, ifeval_grounded_scores=[0.0, 1.0], ifeval_grounded_ci=(0.0, 1.0))
    assert {c["key"]: c["diff"] for c in changes([base, grpo], ["ifeval"])}["ifeval_grounded"] == 0.5
    assert "| grpo | 0.500 | 0.500 [0.100, 0.900] | 0.500 [0.000, 1.000] |" in "\n".join(render_ifeval_types(
        [base, grpo]))


def test_pipeline_smollm2_ifeval_builds_its_ifeval_suite_from_the_recipe():
    # every eval.ifeval field is an ifeval_suite argument: build_suites passes the section as keyword arguments
    from posttrain.config import compose
    from posttrain.evaluation.scorecard import build_suites

    gsm8k = shared_path("data", "gsm8k", "train.jsonl")
    dolly = shared_path("data", "dolly", "dolly_derived_alpaca_prompt_validation_151.jsonl")
    cfg = compose(["pipeline=smollm2-ifeval", f"grpo.prompts.path={gsm8k}", f"grpo.prompts.dolly_path={dolly}"])
    (suite,) = build_suites(cfg.eval, 0, ["ifeval"])
    assert suite.name == "ifeval" and len(suite.rows) == 300 and suite.max_new_tokens == 128


# the replies SmolLM2-135M-Instruct learned in 24 GRPO steps on instruction_strict alone (held-out evals of runs
# ifv-s0 and ifv-s1 at 94463cf), each credited by IFEval's checker, and each about nothing the prompt asked
GAMED = [
    ("punctuation:no_comma", {}, "I'm ready to help. What's your question?"),
    ("change_case:english_lowercase", {}, "i'm here to help you with that. i can help you with that."),
    ("detectable_format:number_bullet_lists", {"num_bullets": 3}, "* This is point 1.\n* This is point 2.\n"
                                                                 "* This is point 3."),
    ("detectable_format:title", {}, "<<poem of joy>>\n\nThe art of sarcasm is a skill that can be learned."),
    ("keywords:letter_frequency", {"letter": "o", "let_frequency": 8, "let_relation": "at least"},
     "Oi, oi, oi, oi, oi, oi, oi, oi, oi, oi."),
]
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
            "many clips did Natalia sell altogether in April and May?")


@pytest.mark.parametrize("cid, kwargs, reply", GAMED)
def test_gamed_replies_meet_the_checker_but_are_not_grounded(cid, kwargs, reply):
    from posttrain.data.constraints import content_words

    constraint = [{"id": cid, "kwargs": kwargs}]
    base_words = content_words([{"id": "q", "text": QUESTION}] + [{"id": f"o{i}", "text": "x"} for i in range(40)])
    assert instruction_strict([reply], constraints=[constraint]) == [1.0]
    assert instruction_grounded([reply], constraints=[constraint], base_words=[base_words["q"]]) == [0.0]


def test_a_reply_that_answers_is_grounded_and_required_phrases_are_not_copying():
    end = {"id": "startend:end_checker", "kwargs": {"end_phrase": "Is there anything else I can help with?"}}
    answer = "Natalia sold 48 clips in April and 24 in May: 72 clips. Is there anything else I can help with?"
    assert not copied_example(answer, end)  # the end phrase is written out, as the constraint requires
    assert grounded(answer, ["natalia", "clips", "april", "48"], [end])
    assert not grounded("Natalia did.", ["natalia", "clips", "april", "48"], [end])  # one shared word is not enough
    title = {"id": "detectable_format:title", "kwargs": {}}
    assert copied_example("<<poem of joy>> Natalia sold 72 clips.", title)
    with pytest.raises(ValueError, match="base_words"):
        instruction_grounded(["Four"], constraints=[[end]])


def test_content_words_leave_out_what_many_base_prompts_use():
    from posttrain.data.constraints import content_words

    bases = [{"id": f"b{i}", "text": f"How many apples did Tom{chr(97 + i)} buy at 1,200 each?"} for i in range(30)]
    bases.append({"id": "odd", "text": "How many clips did Natalia sell for 1,200 dollars?"})
    found = content_words(bases)
    assert found["odd"] == ["clips", "dollars", "for", "natalia", "sell"]  # how, many, did, 1200: in all of them
    assert found["b0"] == ["toma"]
