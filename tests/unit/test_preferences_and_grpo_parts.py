"""Preference pairs (tiny world, PKU-SafeRLHF), GRPO's prompt loading and reward table, the scorecard's columns."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from posttrain.data.dolly import DataError
from posttrain.data.preferences import pku_pairs
from posttrain.data.tiny_world import preference_pairs
from posttrain.evaluation.scorecard import render_markdown
from posttrain.evaluation.suites import Suite
from posttrain.data.prompts import load_prompts
from posttrain.stages.grpo import RewardTable, build_rewards, check_prompts_fill_a_step
from rewards import REWARDS
from tests.conftest import shared_path


# --- preference pairs ----------------------------------------------------------------------------------------------
def test_tiny_pairs_are_deterministic_held_out_and_differ():
    train, test = preference_pairs("train", 300, 0), preference_pairs("test", 100, 0)
    assert train == preference_pairs("train", 300, 0)
    prompt = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert not prompt(train) & prompt(test)
    assert {r["family"] for r in train} == {"echo", "arith", "qa"}
    for r in train + test:
        assert r["chosen"] != r["rejected"]
        assert r["prompt"][0]["role"] == "user" and r["chosen"][0]["role"] == "assistant"


def test_pku_rows_choose_by_safer_or_better():
    rows = [json.loads(line) for line in shared_path("data", "pku_saferlhf",
                                                     "pku_saferlhf_test_sample_transcribed.jsonl").open()]
    safer, better = pku_pairs(rows, "pku", "safer")[0], pku_pairs(rows, "pku", "better")[0]
    assert len(safer) == len(rows) == 9
    for row, s, b in zip(rows, safer, better):
        assert s["chosen"][0]["content"] == row[f"response_{row['safer_response_id']}"]
        assert s["rejected"][0]["content"] == row[f"response_{1 - row['safer_response_id']}"]
        assert b["chosen"][0]["content"] == row[f"response_{row['better_response_id']}"]
    # In these 9 rows the two labels agree; where they differ, the option decides.
    row = {**rows[0], "safer_response_id": 0, "better_response_id": 1}
    assert pku_pairs([row], "pku", "safer")[0][0]["chosen"][0]["content"] == row["response_0"]
    assert pku_pairs([row], "pku", "better")[0][0]["chosen"][0]["content"] == row["response_1"]


@pytest.mark.parametrize("change, message", [
    ({"safer_response_id": 2}, r"row 2: field 'safer_response_id' must be 0 or 1, got 2"),
    ({"safer_response_id": None}, r"row 2: field 'safer_response_id' must be 0 or 1"),
    ({"response_1": ""}, r"row 2: field 'response_1' is missing"),
])
def test_bad_pku_row_names_row_and_field(change, message):
    good = {"prompt": "p", "response_0": "a", "response_1": "b", "safer_response_id": 0, "better_response_id": 1}
    with pytest.raises(DataError, match=message):
        pku_pairs([good, {**good, **change}], "pku.jsonl")


# --- GRPO prompts and rewards --------------------------------------------------------------------------------------
def test_gsm8k_prompts_are_conversations_with_answers():
    path = shared_path("data", "gsm8k", "train.jsonl")
    rows, record = load_prompts(SimpleNamespace(source="gsm8k", path=str(path), n=5), 0)
    assert len(rows) == 5 and record["rows"] == 5
    assert rows[0]["prompt"][0]["role"] == "user" and "####" in rows[0]["answer"]


def test_bad_gsm8k_row_names_file_row_and_field(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"g\.jsonl: row 2: field 'answer'"):
        load_prompts(SimpleNamespace(source="gsm8k", path=str(path), n=None), 0)


def test_unknown_reward_name_lists_the_valid_ones():
    cfg = SimpleNamespace(grpo=SimpleNamespace(rewards={"math_verifer": 1.0}, reward_model=None))
    with pytest.raises(ValueError, match="unknown reward 'math_verifer'.*math_verifier"):
        build_rewards(cfg, SimpleNamespace(inputs={}))
    cfg.grpo.rewards = {"reward_model": 1.0}
    with pytest.raises(ValueError, match="no reward_model stage"):
        build_rewards(cfg, SimpleNamespace(inputs={}))


def test_reward_table_weights_records_and_logs(tmp_path):
    funcs = {"math_verifier": (REWARDS["math_verifier"], 1.0), "think_format": (REWARDS["think_format"], 0.5)}
    table = RewardTable(funcs, group_size=4, scale="none", path=tmp_path / "c.jsonl")
    right, wrong = "<think>\n2 + 2 = 4\n</think>\n\nThe answer is 4.", "The answer is 5."
    completions = [right, wrong, right, wrong, wrong, wrong, wrong, wrong]
    prompts = [[{"role": "user", "content": "What is 2 plus 2?"}]] * 8
    logged = {}
    kwargs = {"answer": ["4"] * 8, "trainer_state": SimpleNamespace(global_step=3),
              "log_metric": lambda name, value: logged.setdefault(name, value)}
    outputs = [fn(prompts=prompts, completions=completions, **kwargs) for fn in table.wrapped()]
    assert [fn.__name__ for fn in table.wrapped()] == ["math_verifier", "think_format"]
    assert outputs[0] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and rows[0]["step"] == 3 and rows[0]["prompt"] == "What is 2 plus 2?"
    assert [r["reward"] for r in rows[:4]] == [1.5, 0.0, 1.5, 0.0]
    assert [r["advantage"] for r in rows[:4]] == [0.75, -0.75, 0.75, -0.75]
    assert logged["equal_reward_groups"] == 0.5  # the second group is all wrong: it teaches nothing
    assert logged["advantages/max"] == 0.75 and logged["advantages/min"] == -0.75
    assert table.history == [{"step": 3, "reward": 0.375, "equal_reward_groups": 0.5}]


# --- eval: sampled pass@1 and the scorecard ------------------------------------------------------------------------
def test_pass_at_1_is_the_mean_over_samples_per_prompt():
    suite = Suite("arith", [{"messages": [], "answer": "4"}, {"messages": [], "answer": "6"}],
                  REWARDS["math_verifier"], ("answer",), samples=4)
    samples = [["4", "4", "5", "4"], ["1", "2", "3", "6"]]
    assert suite.score_samples(samples) == [0.75, 0.25]


def test_scorecard_markdown_has_greedy_and_pass_at_1_columns():
    row = {"checkpoint": "sft", "echo": 0.9, "echo_n": 100, "arith": 0.5, "arith_n": 200, "arith_pass@1": 0.4,
           "arith_samples": 4, "arith_temperature": 1.0, "size_mb": 14.0}
    text = render_markdown({"run": "r", "suites": ["echo", "arith"], "rows": [row]})
    assert ("| checkpoint | echo (n) | arith greedy (n) | arith pass@1 (k=4, T=1.0) | size MB | TTFT ms | decode tok/s |"
            in text)
    assert "| sft | 0.900 (100) | 0.500 (200) | 0.400 | 14.0 | n/a | n/a |" in text
    row["latency"] = {"ttft_ms": 12.34, "decode_tok_s": 101.6, "requests": 8, "max_tokens": 32}
    text = render_markdown({"run": "r", "suites": ["echo", "arith"], "rows": [row]})
    assert "| sft | 0.900 (100) | 0.500 (200) | 0.400 | 14.0 | 12.3 | 102 |" in text
    assert "medians over 8 streamed greedy requests of 32 tokens" in text


def test_gsm8k_prompts_keep_the_problems_with_few_calculations(tmp_path):
    from omegaconf import OmegaConf

    rows = [{"question": "q0", "answer": "no steps\n#### 1"}, {"question": "q1", "answer": "<<1+1=2>>2\n#### 2"},
            {"question": "q2", "answer": "<<1+1=2>>2 <<2*3=6>>6\n#### 6"},
            {"question": "q3", "answer": "<<1+1=2>> <<2+1=3>> <<3+1=4>>\n#### 4"}]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OmegaConf.create({"source": "gsm8k", "path": str(path), "hub_id": None, "n": None, "max_calculations": 2})
    kept, record = load_prompts(cfg, 0)
    assert [r["prompt"][0]["content"] for r in kept] == ["q1", "q2"] and record["max_calculations"] == 2
    with pytest.raises(ValueError, match="max_calculations filters GSM8K"):
        load_prompts(OmegaConf.merge(cfg, {"source": "openr1_math"}), 0)


@pytest.mark.parametrize("n_prompts,batch,accumulation,world,generations,fills", [
    (2, 8, 4, 1, 4, False),   # SmolLM2's smoke run: a step samples 32 completions, 8 prompts' worth
    (2, 8, 1, 1, 4, True),
    (8, 8, 4, 1, 4, True),
    (3, 8, 1, 2, 4, False),   # two processes sample 16 completions a step: 4 prompts
    (3, 6, 1, 1, 4, True),    # 6 completions of 4 per prompt: 2 prompts, rounded up
])
def test_grpo_refuses_prompts_that_cannot_fill_one_optimizer_step(n_prompts, batch, accumulation, world,
                                                                  generations, fills):
    args = SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                           num_generations=generations)
    if fills:
        check_prompts_fill_a_step(n_prompts, args, world)
    else:
        with pytest.raises(ValueError, match=rf"grpo: {n_prompts} prompts cannot fill one optimizer step.*"
                                             r"raise grpo.prompts.n"):
            check_prompts_fill_a_step(n_prompts, args, world)
