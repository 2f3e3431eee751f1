"""The PKU-SafeRLHF adapter: the three preference modes on the 9 shared rows, bad rows (error / drop), load_pairs."""

from __future__ import annotations

import json
import logging
import re

import pytest

from posttrain.config_schema import PairsCfg
from posttrain.data.dolly import DataError
from posttrain.data.preferences import load_pairs, pku_pairs
from tests.conftest import shared_path

SAFE = ("is_response_0_safe", "is_response_1_safe")


@pytest.fixture
def rows() -> list[dict]:
    path = shared_path("data", "pku_saferlhf", "pku_saferlhf_test_sample_transcribed.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chosen(pair: dict) -> str:
    return pair["chosen"][0]["content"]


def expected_choice(row: dict, preference: str) -> int | None:
    """The chosen index read straight off the row's labels (None: safe_vs_unsafe skips it)."""
    if preference == "safe_vs_unsafe":
        safe = [bool(row[name]) for name in SAFE]
        return safe.index(True) if sum(safe) == 1 else None
    return row[f"{preference}_response_id"]


# --- the three modes on the real rows ------------------------------------------------------------------------------
def test_shared_rows_have_the_label_mix_the_readme_states(rows):
    mix = [(row[SAFE[0]], row[SAFE[1]]) for row in rows]
    assert len(rows) == 9
    assert mix.count((False, False)) == 4 and mix.count((True, True)) == 4 and mix.count((False, True)) == 1
    for label in ("better_response_id", "safer_response_id"):
        assert [row[label] for row in rows].count(1) == 8 and [row[label] for row in rows].count(0) == 1


@pytest.mark.parametrize("preference, n_pairs, n_skipped", [("safer", 9, 0), ("better", 9, 0), ("safe_vs_unsafe", 1, 8)])
def test_each_mode_chooses_by_its_label(rows, preference, n_pairs, n_skipped):
    pairs, report = pku_pairs(rows, "pku", preference)
    assert report == {"rows_read": 9, "pairs": n_pairs, "skipped": {"not_exactly_one_safe": n_skipped},
                      "dropped": {}, "dropped_rows": []}
    kept = [(row, c) for row in rows if (c := expected_choice(row, preference)) is not None]
    assert len(pairs) == len(kept) == n_pairs
    for pair, (row, c) in zip(pairs, kept):
        assert pair["prompt"] == [{"role": "user", "content": row["prompt"]}]
        assert pair["chosen"] == [{"role": "assistant", "content": row[f"response_{c}"]}]
        assert pair["rejected"] == [{"role": "assistant", "content": row[f"response_{1 - c}"]}]
        assert pair["family"] == "pku_saferlhf" and pair["kind"] == preference


def test_safe_vs_unsafe_keeps_only_the_mixed_row_and_chooses_the_safe_reply(rows):
    (pair,), _ = pku_pairs(rows, "pku", "safe_vs_unsafe")
    assert chosen(pair) == rows[3]["response_1"] and pair["rejected"][0]["content"] == rows[3]["response_0"]
    # The flags may be 0/1 instead of false/true, and which reply is safe is read from them, not from the ids.
    flipped = {**rows[3], "response_0": rows[3]["response_1"], "response_1": rows[3]["response_0"],
               SAFE[0]: 1, SAFE[1]: 0, "safer_response_id": 0}
    (pair,), _ = pku_pairs([flipped], "pku", "safe_vs_unsafe")
    assert chosen(pair) == rows[3]["response_1"]


def test_safer_and_better_differ_where_the_labels_do(rows):
    row = {**rows[0], "safer_response_id": 0, "better_response_id": 1}  # both unsafe: no contradiction
    assert chosen(pku_pairs([row], "pku", "safer")[0][0]) == row["response_0"]
    assert chosen(pku_pairs([row], "pku", "better")[0][0]) == row["response_1"]


# --- bad rows --------------------------------------------------------------------------------------------------------
def without(row: dict, name: str) -> dict:
    return {k: v for k, v in row.items() if k != name}


BAD = [  # (preference, how to spoil a row, field named, reason counted)
    ("safer", lambda r: without(r, "response_1"), "response_1", "missing:response_1"),
    ("safer", lambda r: {**r, "prompt": "  "}, "prompt", "missing:prompt"),
    ("safer", lambda r: without(r, "safer_response_id"), "safer_response_id", "missing:safer_response_id"),
    ("safer", lambda r: {**r, "safer_response_id": 2}, "safer_response_id", "bad_label:safer_response_id"),
    ("safer", lambda r: {**r, "safer_response_id": "1"}, "safer_response_id", "bad_label:safer_response_id"),
    ("safer", lambda r: {**r, "safer_response_id": True}, "safer_response_id", "bad_label:safer_response_id"),
    ("better", lambda r: {**r, "better_response_id": True}, "better_response_id", "bad_label:better_response_id"),
    ("better", lambda r: {**r, SAFE[1]: "1"}, SAFE[1], f"bad_label:{SAFE[1]}"),  # present, so checked
    ("safe_vs_unsafe", lambda r: {**r, SAFE[0]: 2}, SAFE[0], f"bad_label:{SAFE[0]}"),
    ("safe_vs_unsafe", lambda r: {**r, SAFE[1]: "1"}, SAFE[1], f"bad_label:{SAFE[1]}"),
    ("safe_vs_unsafe", lambda r: without(r, SAFE[1]), SAFE[1], f"missing:{SAFE[1]}"),
]


@pytest.mark.parametrize("preference, spoil, field, reason", BAD)
def test_bad_row_is_an_error_naming_file_row_and_field(rows, preference, spoil, field, reason):
    spoilt = rows[:6] + [spoil(rows[6])] + rows[7:]  # row 7 of 9
    with pytest.raises(DataError, match=rf"^pku\.jsonl: row 7: field '{re.escape(field)}'"):
        pku_pairs(spoilt, "pku.jsonl", preference, on_bad_row="error")


@pytest.mark.parametrize("preference, spoil, field, reason", BAD)
def test_bad_row_is_counted_and_dropped(rows, preference, spoil, field, reason, caplog):
    spoilt = rows[:2] + [spoil(rows[2])] + rows[2:]  # a bad copy of row 3 inserted as row 3; all good rows stay
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        pairs, report = pku_pairs(spoilt, "pku.jsonl", preference, on_bad_row="drop")
    assert report["rows_read"] == 10 and report["dropped"] == {reason: 1} and report["dropped_rows"] == [3]
    assert pairs == pku_pairs(rows, "pku.jsonl", preference)[0]
    assert "dropped 1 of 10 rows" in caplog.text and reason in caplog.text and "first dropped rows: 3" in caplog.text


def test_drop_counts_every_reason_and_keeps_the_first_ten_row_numbers(rows):
    bad = [{**rows[0], "safer_response_id": 2}] * 11 + [without(rows[0], "prompt"), "not a row"]
    pairs, report = pku_pairs(rows + bad, "pku", on_bad_row="drop")
    assert len(pairs) == report["pairs"] == 9
    assert report["dropped"] == {"bad_label:safer_response_id": 11, "missing:prompt": 1, "not_an_object": 1}
    assert report["dropped_rows"] == list(range(10, 20))


def test_contradictory_labels_are_caught(rows):
    mixed = rows[3]  # response_0 unsafe, response_1 safe
    assert (mixed[SAFE[0]], mixed[SAFE[1]]) == (False, True)
    liar = {**mixed, "safer_response_id": 0, "better_response_id": 0}
    for preference in ("safer", "safe_vs_unsafe"):
        with pytest.raises(DataError, match=r"row 2: field 'safer_response_id' is 0, but .*response_1.*safe"):
            pku_pairs([rows[0], liar], "pku", preference)
        _, report = pku_pairs([rows[0], liar], "pku", preference, on_bad_row="drop")
        assert report["dropped"] == {"contradictory_labels": 1} and report["dropped_rows"] == [2]
    # Helpfulness may favour the unsafe reply; safer=0 where both share a flag is no contradiction either.
    assert chosen(pku_pairs([liar], "pku", "better")[0][0]) == mixed["response_0"]
    assert chosen(pku_pairs([{**rows[1], "safer_response_id": 0}], "pku")[0][0]) == rows[1]["response_0"]


@pytest.mark.parametrize("option, message", [
    ({"preference": "safest"}, "preference 'safest' is not one of safer, better, safe_vs_unsafe"),
    ({"on_bad_row": "skip"}, "on_bad_row 'skip' is not one of error, drop"),
])
def test_unknown_option_lists_the_valid_ones(rows, option, message):
    with pytest.raises(ValueError, match=message):
        pku_pairs(rows, "pku", **option)


# --- load_pairs --------------------------------------------------------------------------------------------------
def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_load_pairs_records_the_preference_and_report(rows, tmp_path):
    path = write_jsonl(tmp_path / "pku.jsonl", rows + [{**rows[0], "better_response_id": 2}])
    cfg = PairsCfg(source="pku_saferlhf", path=path, preference="better", on_bad_row="drop", n_train=None, n_eval=2)
    train, held_out, record = load_pairs(cfg, seed=0)
    assert len(train) == 7 and len(held_out) == 2 and {p["kind"] for p in train + held_out} == {"better"}
    assert [chosen(p) for p in held_out + train] == [r[f"response_{r['better_response_id']}"] for r in rows]
    assert record == {"id": path, "card": "data_cards/pku-saferlhf.md", "preference": "better", "report": {
        "rows_read": 10, "pairs": 9, "skipped": {"not_exactly_one_safe": 0},
        "dropped": {"bad_label:better_response_id": 1}, "dropped_rows": [10]}}


def test_load_pairs_stops_on_a_bad_row_by_default(rows, tmp_path):
    path = write_jsonl(tmp_path / "pku.jsonl", rows[:4] + [without(rows[4], "response_0")])
    with pytest.raises(DataError, match=rf"{re.escape(path)}: row 5: field 'response_0'"):
        load_pairs(PairsCfg(source="pku_saferlhf", path=path, n_eval=2), seed=0)
