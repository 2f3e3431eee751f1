"""A real dataset's held-out rows (`data.held_out`): the last N rows, which SFT's training rows and quantize's
calibration rows leave out; the tiny world holds out its test split."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from posttrain.config_schema import DataCfg
from posttrain.data.chat_rows import load_rows
from posttrain.stages.quantize import held_out_rows


def dolly_cfg(tmp_path, n_rows: int, held_out: int):
    path = tmp_path / "dolly.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Question {i}?", "context": "", "response": f"Answer {i}.",
                                        "category": "open_qa"}) + "\n" for i in range(n_rows)))
    return OmegaConf.structured(DataCfg(name="dolly", path=str(path), held_out=held_out))


def test_the_last_rows_are_held_out_and_the_training_part_leaves_them_out(tmp_path):
    cfg = dolly_cfg(tmp_path, 12, 3)
    train, train_record = load_rows(cfg)
    held, held_record = load_rows(cfg, "held_out")
    assert [r["instruction"] for r in train] == [f"Question {i}?" for i in range(9)]
    assert [r["instruction"] for r in held] == ["Question 9?", "Question 10?", "Question 11?"]
    assert train_record["rows"] == 9 and held_record["rows"] == 3
    assert held_record["id"].endswith("(held out: last 3 rows)") and train_record["id"] == str(tmp_path / "dolly.jsonl")
    assert train_record["content_sha256"] != held_record["content_sha256"]
    # quantize's perplexity rows: at most eval_rows of the held-out part, never a training row
    assert [r["instruction"] for r in held_out_rows(cfg, 2)] == ["Question 9?", "Question 10?"]
    assert len(held_out_rows(cfg, 200)) == 3


def test_no_held_out_rows_trains_on_every_row_and_asking_for_them_names_the_key(tmp_path):
    cfg = dolly_cfg(tmp_path, 5, 0)
    assert len(load_rows(cfg)[0]) == 5
    with pytest.raises(ValueError, match=r"no held-out rows \(data.held_out is 0\)"):
        held_out_rows(cfg, 8)


@pytest.mark.parametrize("held_out", [5, 9, -1])
def test_holding_out_every_row_or_a_negative_number_is_refused(tmp_path, held_out):
    cfg = dolly_cfg(tmp_path, 5, held_out)
    with pytest.raises(ValueError, match=rf"data.held_out={held_out}: .*dolly.jsonl has 5 rows; hold out 0 to 4"):
        load_rows(cfg)


def test_the_tiny_world_holds_out_its_test_split():
    cfg = OmegaConf.structured(DataCfg(name="tiny", counts={"echo": 20, "arith": 5, "qa": 5}))
    train, train_record = load_rows(cfg)
    held, held_record = load_rows(cfg, "held_out")
    assert train_record["id"] == "tiny_world/sft" and held_record["id"] == "tiny_world/sft/test"
    seen = {json.dumps(r["messages"]) for r in train}
    assert held and not any(json.dumps(r["messages"]) in seen for r in held)


def test_an_unknown_part_is_refused(tmp_path):
    with pytest.raises(ValueError, match="part 'test' is not one of train, held_out"):
        load_rows(dolly_cfg(tmp_path, 5, 1), "test")
