"""The HH-RLHF adapter: transcripts to messages, bad rows (error / drop), the split by conversation, load_pairs from
a .jsonl.gz file, the card's mapping in `posttrain data check`, and the shared harmless-base test file when present.

Rows here are made up; the real file is only counted, never quoted."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import replace

import pytest

from posttrain.config_schema import PairsCfg
from posttrain.data.cards import load_card
from posttrain.data.check import check_rows
from posttrain.data.dolly import DataError, read_rows
from posttrain.data.hh_rlhf import (TranscriptError, conversation_key, hh_pairs, parse_transcript,
                                    split_by_conversation)
from posttrain.data.preferences import load_pairs
from posttrain.data.startup import pair_jobs
from tests.conftest import shared_path


def transcript(*turns: str) -> str:
    """Alternating Human / Assistant turns, Human first, in the dataset's format."""
    return "".join(f"\n\n{'Human' if n % 2 == 0 else 'Assistant'}: {text}" for n, text in enumerate(turns))


def hh_row(context: tuple[str, ...], chosen: str, rejected: str) -> dict:
    return {"chosen": transcript(*context, chosen), "rejected": transcript(*context, rejected)}


GOOD = [
    hh_row(("How do I bake bread?",), "Mix flour, water, yeast and salt.", "Buy some."),
    hh_row(("What is two plus two?", "Four.", "And three plus three?"), "Six.", "Seven."),
    hh_row(("Tell me a joke.",), "Why did the chicken cross the road?", "No."),
]


def chosen_text(pair: dict) -> str:
    return pair["chosen"][0]["content"]


# --- transcripts -------------------------------------------------------------------------------------------------
def test_a_transcript_becomes_alternating_messages_with_stripped_text():
    assert parse_transcript(transcript("Hi ", "Hello. ", "How are you?", "  Fine, thanks.")) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine, thanks."}]


def test_a_speaker_name_inside_a_turn_is_text_not_a_marker():
    messages = parse_transcript(transcript("Say 'Human: hi' please", "Human: hi"))
    assert [m["content"] for m in messages] == ["Say 'Human: hi' please", "Human: hi"]


@pytest.mark.parametrize("text, message", [
    ("just some text", "no turns"),
    ("", "no turns"),
    ("preamble" + transcript("Hi", "Hello"), "does not start with a Human turn: text before"),
    ("\n\nAssistant: Hello\n\nHuman: Hi\n\nAssistant: Bye", "does not start with a Human turn: the first turn is"),
    ("\n\nHuman: Hi\n\nHuman: Again\n\nAssistant: Hello", "turns do not alternate: turn 2 is a second Human turn"),
    ("\n\nHuman: Hi\n\nAssistant: Hello\n\nAssistant: Again", "turn 3 is a second Assistant turn"),
    (transcript("Hi", "Hello", "   ", "Hm"), r"empty turn: turn 3 \(Human\)"),
    (transcript("Hi") + "\n\nAssistant: ", r"empty turn: turn 2 \(Assistant\)"),
    (transcript("Hi") + "\n\nAssistant:", r"empty turn: turn 2 \(Assistant\)"),
    (transcript("Hi", "Hello", "Bye"), "does not end with an Assistant turn: the last of 3 turns is Human's"),
])
def test_a_broken_transcript_says_what_is_wrong(text, message):
    with pytest.raises(TranscriptError, match=message):
        parse_transcript(text)


# --- pairs -------------------------------------------------------------------------------------------------------
def test_the_prompt_is_every_turn_before_the_last_reply():
    pairs, report = hh_pairs(GOOD, "hh.jsonl")
    multi = pairs[1]
    assert multi["prompt"] == [{"role": "user", "content": "What is two plus two?"},
                               {"role": "assistant", "content": "Four."},
                               {"role": "user", "content": "And three plus three?"}]
    assert multi["chosen"] == [{"role": "assistant", "content": "Six."}]
    assert multi["rejected"] == [{"role": "assistant", "content": "Seven."}]
    assert {(p["family"], p["kind"]) for p in pairs} == {("hh_rlhf", "harmless")}
    assert multi["conversation"] == conversation_key(multi["prompt"])
    assert report == {"rows_read": 3, "pairs": 3, "skipped": {}, "dropped": {}, "dropped_rows": []}


def test_the_conversation_key_is_the_normalised_first_user_turn():
    key = conversation_key([{"role": "user", "content": "How do I bake bread?"}])
    assert key == conversation_key([{"role": "user", "content": "  how do I   BAKE bread"},
                                    {"role": "assistant", "content": "Like this."},
                                    {"role": "user", "content": "A different follow-up"}])
    assert key != conversation_key([{"role": "user", "content": "How do I bake cake?"}])
    assert re.fullmatch(r"[0-9a-f]{64}", key)


BAD_ROWS = [  # (the bad row, reason, what the message says)
    ("not a row", "not_an_object", "expected an object"),
    ({"chosen": transcript("Hi", "Hello")}, "missing:rejected", "field 'rejected' is missing"),
    ({"chosen": "  ", "rejected": transcript("Hi", "Hello")}, "missing:chosen", "field 'chosen' is missing"),
    ({"chosen": transcript("Hi", "Hello", "Bye"), "rejected": transcript("Hi", "Hello", "Bye", "Go")},
     "different_prompts", "differ before the last Assistant turn"),
    ({"chosen": transcript("Hi", "Hello"), "rejected": transcript("Hey", "Hello")},
     "different_prompts", "first at turn 1"),
    ({"chosen": transcript("Hi", "Well") + "\n\nAssistant: hello", "rejected": transcript("Hi", "Hello")},
     "different_prompts", "2 and 1 turns before it"),
    ({"chosen": transcript("Hi") + "\n\nAssistant: ", "rejected": transcript("Hi", "Hello")},
     "bad_transcript:chosen", "field 'chosen': empty turn"),
    ({"chosen": transcript("Hi", "Hello"), "rejected": "no markers at all"},
     "bad_transcript:rejected", "field 'rejected': no turns"),
    ({"chosen": "\n\nHuman: Hi\n\nHuman: Hi\n\nAssistant: A", "rejected": "\n\nHuman: Hi\n\nHuman: Hi\n\nAssistant: B"},
     "bad_transcript:chosen", "turns do not alternate"),
    (hh_row(("Hi",), "Hello", " Hello "), "identical_replies", "end with the same Assistant reply"),
]


@pytest.mark.parametrize("bad, reason, message", BAD_ROWS)
def test_a_bad_row_is_an_error_naming_source_row_and_reason(bad, reason, message):
    with pytest.raises(DataError, match=rf"hh\.jsonl: row 2: {re.escape(reason)}: .*{message}"):
        hh_pairs([GOOD[0], bad, GOOD[1]], "hh.jsonl", on_bad_row="error")


@pytest.mark.parametrize("bad, reason, message", BAD_ROWS)
def test_a_bad_row_is_counted_and_dropped(bad, reason, message, caplog):
    with caplog.at_level("WARNING", logger="posttrain"):
        pairs, report = hh_pairs([GOOD[0], bad, GOOD[1]], "hh.jsonl", on_bad_row="drop")
    assert pairs == hh_pairs([GOOD[0], GOOD[1]], "hh.jsonl")[0]
    assert report == {"rows_read": 3, "pairs": 2, "skipped": {}, "dropped": {reason: 1}, "dropped_rows": [2]}
    assert f"dropped 1 of 3 rows as bad ({reason}: 1)" in caplog.text


def test_drop_counts_every_reason_and_keeps_the_first_ten_row_numbers():
    bad = [b for b, _, _ in BAD_ROWS] * 2
    pairs, report = hh_pairs(GOOD + bad, "hh", on_bad_row="drop")
    assert len(pairs) == 3 and report["pairs"] == 3 and report["rows_read"] == 3 + len(bad)
    assert report["dropped"] == dict(Counter(reason for _, reason, _ in BAD_ROWS * 2))
    assert report["dropped_rows"] == list(range(4, 14))


def test_an_unknown_bad_row_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="on_bad_row 'skip' is not one of error, drop"):
        hh_pairs(GOOD, "hh", on_bad_row="skip")


# --- the split by conversation -----------------------------------------------------------------------------------
def many_pairs(n_conversations: int = 60) -> list[dict]:
    """Conversations of 1 to 3 pairs each: follow-ups of one opening request share its conversation key."""
    rows = []
    for c in range(n_conversations):
        for k in range(c % 3 + 1):
            context = (f"Question number {c}?",) + (("An answer.", f"Follow-up {k}?") if k else ())
            rows.append(hh_row(context, f"Reply {c}.{k}", f"Other reply {c}.{k}"))
    pairs, _ = hh_pairs(rows, "made-up")
    return pairs


def keys(pairs: list[dict]) -> set[str]:
    return {p["conversation"] for p in pairs}


@pytest.mark.parametrize("n_eval", [1, 7, 40, 100])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_conversation_is_on_both_sides(n_eval, seed):
    pairs = many_pairs()
    assert len(keys(pairs)) == 60 and len(pairs) == 120
    train, held_out = split_by_conversation(pairs, n_eval, seed)
    assert not keys(train) & keys(held_out)
    assert n_eval <= len(held_out) < n_eval + 3  # whole conversations of at most 3 pairs, stopping once n_eval is met
    assert sorted(map(chosen_text, train + held_out)) == sorted(map(chosen_text, pairs))
    assert train == [p for p in pairs if p in train]  # each side keeps the input order


def test_the_split_is_deterministic_for_a_seed_and_varies_with_it():
    pairs = many_pairs()
    first = split_by_conversation(pairs, 20, seed=0)
    assert split_by_conversation(pairs, 20, seed=0) == first
    reversed_split = split_by_conversation(pairs[::-1], 20, seed=0)
    assert keys(reversed_split[1]) == keys(first[1])  # the order pairs come in does not matter
    assert any(keys(split_by_conversation(pairs, 20, seed)[1]) != keys(first[1]) for seed in range(1, 5))


@pytest.mark.parametrize("n_eval", [120, 200])
def test_a_split_that_leaves_nothing_to_train_on_is_an_error(n_eval):
    with pytest.raises(ValueError, match=f"cannot hold out {n_eval} pairs by conversation and still train: "
                                         "120 pairs in 60 conversations"):
        split_by_conversation(many_pairs(), n_eval, 0)


def test_holding_out_nothing_keeps_every_pair_for_training():
    pairs = many_pairs(5)
    assert split_by_conversation(pairs, 0, 0) == (pairs, [])


# --- loading ------------------------------------------------------------------------------------------------------
def write_gz(path, rows: list, extra_lines: tuple[str, ...] = ()) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return str(path)


def test_read_rows_reads_gzip_jsonl_and_names_a_bad_line(tmp_path):
    path = write_gz(tmp_path / "rows.jsonl.gz", GOOD, ("", "{not json"))
    with pytest.raises(DataError, match=rf"{re.escape(path)}: row 5: not valid JSON"):
        read_rows(path)
    assert read_rows(write_gz(tmp_path / "ok.jsonl.gz", GOOD, ("",))) == GOOD


def test_a_broken_gzip_file_is_a_data_error_naming_it(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(b"this is not gzip")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: not a readable gzip file"):
        read_rows(path)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"chosen": "x"}\n' * 100)[:40])
    with pytest.raises(DataError, match="not a readable gzip file"):
        read_rows(cut)


def test_load_pairs_holds_out_whole_conversations_and_records_them(tmp_path):
    pairs = many_pairs(30)
    rows = [{"chosen": transcript(*[m["content"] for m in p["prompt"]], chosen_text(p)),
             "rejected": transcript(*[m["content"] for m in p["prompt"]], p["rejected"][0]["content"])}
            for p in pairs]
    path = write_gz(tmp_path / "hh.jsonl.gz", rows + [{"chosen": rows[0]["chosen"], "rejected": rows[0]["chosen"]}])
    cfg = PairsCfg(source="hh_rlhf", path=path, on_bad_row="drop", n_train=None, n_eval=10)
    train, held_out, record = load_pairs(cfg, seed=3)
    assert 10 <= len(held_out) < 13 and len(train) + len(held_out) == len(pairs)
    assert not keys(train) & keys(held_out)
    assert record == {"id": path, "card": "data_cards/hh-rlhf.md",
                      "report": {"rows_read": len(rows) + 1, "pairs": len(pairs), "skipped": {},
                                 "dropped": {"identical_replies": 1}, "dropped_rows": [len(rows) + 1]},
                      "conversations": {"train": len(keys(train)), "held_out": len(keys(held_out))}}
    assert record["conversations"]["train"] + record["conversations"]["held_out"] == 30
    assert load_pairs(cfg, seed=3) == (train, held_out, record)

    capped, held_again, _ = load_pairs(PairsCfg(source="hh_rlhf", path=path, on_bad_row="drop", n_train=5,
                                                n_eval=10), seed=3)
    assert capped == train[:5] and held_again == held_out  # n_train caps training pairs, not the held-out ones


def test_load_pairs_stops_on_a_bad_row_by_default_and_on_an_impossible_split(tmp_path):
    path = write_gz(tmp_path / "hh.jsonl.gz", GOOD + [hh_row(("Hi",), "Same", "Same")])
    with pytest.raises(DataError, match=rf"{re.escape(path)}: row 4: identical_replies"):
        load_pairs(PairsCfg(source="hh_rlhf", path=path, n_eval=1), seed=0)
    path = write_gz(tmp_path / "small.jsonl.gz", GOOD)
    with pytest.raises(DataError, match=rf"{re.escape(path)}: cannot hold out 3 pairs by conversation"):
        load_pairs(PairsCfg(source="hh_rlhf", path=path, n_eval=3), seed=0)
    with pytest.raises(DataError, match="n_eval is 0"):
        load_pairs(PairsCfg(source="hh_rlhf", path=path, n_eval=0), seed=0)
    with pytest.raises(ValueError, match="not one of tiny, tiny_safety, pku_saferlhf, hh_rlhf"):
        load_pairs(PairsCfg(source="hh", path=path), seed=0)


# --- the card's mapping in the data check ---------------------------------------------------------------------------
def test_the_data_check_maps_rows_to_pairs_and_reports_bad_ones_as_the_card_says():
    spec = load_card("hh-rlhf").spec
    bad = {"chosen": transcript("Hi", "Hello", "Bye"), "rejected": transcript("Hi", "Hello", "Bye", "Go")}
    report = check_rows(GOOD + [bad], spec, source="made-up", split="test", sample=True)
    assert report.ok and report.stats["examples"] == 3 and report.stats["example_kind"] == "pairs"
    (finding,) = [f for f in report.findings if f.check == "values"]
    assert finding.level == "warning" and "different_prompts" in finding.message and finding.rows == [4]

    strict = replace(spec, mapping={**spec.mapping, "on_bad_row": "error"})
    report = check_rows(GOOD + [bad], strict, source="made-up", split="test", sample=True)
    assert not report.ok and [f.rows for f in report.errors()] == [[4]]


# --- the shared file ----------------------------------------------------------------------------------------------
def test_the_shared_harmless_base_test_file():
    path = shared_path("data", "hh_rlhf", "harmless-base-test.jsonl.gz")
    rows = read_rows(path)
    assert len(rows) == 2312
    pairs, report = hh_pairs(rows, str(path), on_bad_row="drop")
    # 5 rows whose copies disagree before the last reply, 4 whose chosen reply is empty, 4 with two Assistant turns
    # in a row inside the shared context
    assert report["dropped"] == {"different_prompts": 5, "bad_transcript:chosen": 8}
    assert report["pairs"] == len(pairs) == 2312 - 13
    train, held_out, record = load_pairs(PairsCfg(source="hh_rlhf", path=str(path), on_bad_row="drop",
                                                  n_train=None, n_eval=400), seed=0)
    assert len(held_out) >= 400 and len(train) + len(held_out) == len(pairs)
    assert not keys(train) & keys(held_out)
    assert sum(record["conversations"].values()) == len(keys(pairs))


def test_the_stage_start_up_check_holds_hh_pairs_to_their_own_card(tmp_path):
    """reward_model / dpo with source hh_rlhf check their rows against data_cards/hh-rlhf.md (not PKU's, whose
    `prompt` column these rows lack), with the recipe's bad-row policy; the mapped pairs skip the bad row."""
    rows = [hh_row(("hello",), f"reply {i}", f"other {i}") for i in range(4)] + [{"chosen": "no turns", "rejected": "none here"}]
    path = write_gz(tmp_path / "pairs.jsonl.gz", rows)
    for policy in ("drop", "error"):
        (job,) = pair_jobs(PairsCfg(source="hh_rlhf", path=path, on_bad_row=policy, n_eval=1), [])
        assert job.spec.card_id == "hh-rlhf" and job.spec.mapping["on_bad_row"] == policy
        assert "preference" not in job.spec.mapping and len(job.rows) == 5
        report = check_rows(job.rows, job.spec, source=job.source)
        levels = {f.level for f in report.findings if f.check == "values"}
        assert levels == {"warning" if policy == "drop" else "error"}


def test_the_start_up_check_tokenizes_the_training_rows_only_and_reads_every_row(tmp_path, tiny_tokenizer):
    """Tokenizing is the slow part of the stage's data check (2,312 HH-RLHF rows took ~4 s a stage on SmolLM2's
    template), and DPO trains on 64 of them: the check still reads every row of the file (its bad rows keep their
    file row numbers) but takes token lengths over the rows that became training pairs."""
    rows = [hh_row((f"Question number {i}?",), f"Reply {i}.", f"Other {i}.") for i in range(6)]
    rows.append({"chosen": "no turns", "rejected": "none here"})
    cfg = PairsCfg(source="hh_rlhf", path=write_gz(tmp_path / "pairs.jsonl.gz", rows), on_bad_row="drop",
                   n_train=None, n_eval=2)
    train, held_out, _ = load_pairs(cfg, seed=0)
    (job,) = pair_jobs(cfg, train)
    trained = {int(p["chosen"][0]["content"].split()[1].rstrip(".")) + 1 for p in train}
    assert len(held_out) == 2 and job.token_rows == trained and len(job.rows) == 7
    report = check_rows(job.rows, job.spec, source=job.source, tokenizer=tiny_tokenizer, token_rows=job.token_rows)
    assert report.stats["tokens"]["rows"] == 4 and report.stats["examples"] == 6
    assert [f.rows for f in report.findings if f.check == "values"] == [[7]]
    assert "tokens    of the 4 trained, p50" in report.text()
    everything = check_rows(job.rows, job.spec, source=job.source, tokenizer=tiny_tokenizer)
    assert everything.stats["tokens"]["rows"] == 6 and "of the" not in everything.text()
