"""GSM8K worked solutions as SFT rows (`data.gsm8k`): annotations stripped, the '####' line as a sentence, the last
n problems of the filtered train split (GRPO's prompts are its first), bad rows named."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from posttrain.config_schema import DataCfg, Gsm8kSolutionsCfg
from posttrain.data.chat_rows import load_rows
from posttrain.data.dolly import DataError
from posttrain.data.gsm8k import solution_reply, solution_rows
from posttrain.data.prompts import load_prompts
from posttrain.data.startup import sft_jobs
from rewards import REWARDS


def problem(i: int, steps: int) -> dict:
    lines = [f"Step {k}: {i} + {k} = <<{i}+{k}={i + k}>>{i + k}." for k in range(steps)]
    return {"question": f"Problem {i}: what is {i} plus {steps - 1}?",
            "answer": "\n".join(lines + [f"#### {i + steps - 1}"])}


def write_split(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_reply_has_no_calculator_annotations_and_ends_in_a_sentence_the_verifier_reads():
    solution = "He pays 3 * $4 = $<<3*4=12>>12.\nThen 12 + 5 = <<12+5=17>>17 in all.\n#### 17"
    reply = solution_reply(solution)
    assert reply == "He pays 3 * $4 = $12.\nThen 12 + 5 = 17 in all.\nThe answer is 17."
    assert REWARDS["math_verifier"]([reply], answer=[solution]) == [1.0]
    with pytest.raises(ValueError, match="no '#### <answer>' last line"):
        solution_reply("no marker here")


def test_sft_takes_the_last_filtered_problems_and_grpo_the_first(tmp_path):
    rows = [problem(i, 1 + i % 4) for i in range(20)]  # 1, 2, 3, 4 calculations in turn
    path = write_split(tmp_path, rows)
    cfg = OmegaConf.structured(Gsm8kSolutionsCfg(n=4, path=path, max_calculations=2))
    solutions, raw, record = solution_rows(cfg)
    kept = [i for i in range(20) if i % 4 in (0, 1)]  # 10 problems with 1 or 2 calculations
    assert [r["question"] for r in raw] == [rows[i]["question"] for i in kept[-4:]]
    assert [s["messages"][0]["content"] for s in solutions] == [r["question"] for r in raw]
    assert all(s["source"] == "gsm8k" and "<<" not in s["messages"][1]["content"] for s in solutions)
    assert record["rows"] == 4 and record["first_row"] == kept[-4] + 1 and "1 to 2 calculations" in record["id"]
    prompts_cfg = OmegaConf.create({"source": "gsm8k", "path": path, "n": 6, "hub_id": None, "max_calculations": 2})
    grpo_rows, _ = load_prompts(prompts_cfg, seed=0)
    assert not {r["prompt"][0]["content"] for r in grpo_rows} & {r["question"] for r in raw}


def test_asking_for_more_problems_than_pass_the_filter_names_the_file(tmp_path):
    path = write_split(tmp_path, [problem(i, 3) for i in range(5)])
    with pytest.raises(DataError, match=r"train.jsonl: data.gsm8k.n=2 but only 0 problems have 1 to 2"):
        solution_rows(OmegaConf.structured(Gsm8kSolutionsCfg(n=2, path=path, max_calculations=2)))


@pytest.mark.parametrize("bad, match", [
    ({"question": "Q?"}, "row 2: field 'answer' is missing"),
    ({"question": "Q?", "answer": "no marker"}, "row 2: field 'answer': the solution has no '####"),
])
def test_a_bad_row_is_named(tmp_path, bad, match):
    path = write_split(tmp_path, [problem(0, 1), bad])
    with pytest.raises(DataError, match=match):
        solution_rows(OmegaConf.structured(Gsm8kSolutionsCfg(n=2, path=path)))


def test_the_train_part_adds_the_solutions_after_dolly_and_the_held_out_part_does_not(tmp_path):
    dolly = tmp_path / "dolly.jsonl"
    dolly.write_text("".join(json.dumps({"instruction": f"Question {i}?", "context": "", "response": f"Answer {i}.",
                                         "category": "open_qa"}) + "\n" for i in range(6)))
    path = write_split(tmp_path, [problem(i, 1) for i in range(4)])
    cfg = OmegaConf.structured(DataCfg(name="dolly", path=str(dolly), held_out=2,
                                       gsm8k=Gsm8kSolutionsCfg(n=3, path=path, max_calculations=2)))
    train, record = load_rows(cfg)
    held, _ = load_rows(cfg, "held_out")
    assert len(train) == 4 + 3 and [r.get("source") for r in train[4:]] == ["gsm8k"] * 3
    assert record["rows"] == 4 and record["gsm8k_solutions"]["rows"] == 3
    assert len(held) == 2 and not any(r.get("source") == "gsm8k" for r in held)
    jobs = sft_jobs(cfg, train)
    assert [j.spec.card_id for j in jobs] == ["databricks-dolly-15k", "gsm8k"]
    assert len(jobs[0].rows) == 4 and len(jobs[1].rows) == 3 and jobs[1].sample


def test_the_tiny_world_refuses_gsm8k_solutions():
    cfg = OmegaConf.structured(DataCfg(name="tiny", gsm8k=Gsm8kSolutionsCfg(n=3)))
    with pytest.raises(ValueError, match="data.gsm8k.n adds GSM8K solutions to a real dataset"):
        load_rows(cfg)
