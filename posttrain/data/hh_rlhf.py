"""Anthropic HH-RLHF preference rows as conversational pairs, and a held-out split by conversation.

A row is `{"chosen": "...", "rejected": "..."}`: one conversation written out twice as a transcript of alternating
`\\n\\nHuman: ` and `\\n\\nAssistant: ` turns, the two copies identical up to the last assistant turn, which is the
reply the annotator preferred (chosen) or not (rejected). A pair keeps the conversation as chat messages:

- prompt = every message before the last assistant turn (user and assistant turns, alternating, ending on a user
  turn);
- chosen / rejected = `[{"role": "assistant", "content": <last reply>}]`;
- `family` "hh_rlhf", `kind` (the subset: "harmless" for harmless-base), and `conversation`: the sha256 of the
  normalised first user turn (posttrain.data.overlap.normalise). Rows that open with the same request share the
  key, so `split_by_conversation` keeps them on one side of the split.

Every row is checked first. A row is bad when it is not an object (`not_an_object`), `chosen` or `rejected` is
missing or blank (`missing:<field>`), the two transcripts differ before their last assistant turn
(`different_prompts`; compared first, turn by turn), a transcript does not parse (`bad_transcript:<field>`: no
turns, turns that do not alternate, an empty turn, not starting with a Human turn or not ending with an Assistant
turn), or the two last replies are the same (`identical_replies`). As for PKU-SafeRLHF (posttrain.data.preferences),
a bad row either stops the load with a DataError naming the source, the row (from 1) and the reason
(`on_bad_row="error"`) or is counted by reason and dropped with a warning (`on_bad_row="drop"`); it is never passed
on.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter

from posttrain.data.bad_rows import BadRow, BadRows
from posttrain.data.overlap import normalise

HH_FIELDS = ("chosen", "rejected")
SUBSETS = {"harmless-base": "harmless"}  # the hub repository's data_dir -> the pairs' `kind`
ROLES = {"Human": "user", "Assistant": "assistant"}
# A turn marker: a blank line, the speaker and a colon; the space after the colon is absent only when the turn is
# empty at the very end of the text.
TURN = re.compile(r"\n\n(Human|Assistant):(?: |$)")


class TranscriptError(ValueError):
    """A transcript is not an alternating Human / Assistant conversation; the message says what is wrong."""


def _turns(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(text before the first marker, [(speaker, stripped turn text)]), with no check of their order."""
    parts = TURN.split(text)
    return parts[0], [(speaker, content.strip()) for speaker, content in zip(parts[1::2], parts[2::2])]


def _before_last_reply(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The turns before the last Assistant turn (all of them when there is none)."""
    last = max((n for n, (speaker, _) in enumerate(turns) if speaker == "Assistant"), default=len(turns))
    return turns[:last]


def parse_transcript(text: str) -> list[dict]:
    """Chat messages from a `\\n\\nHuman: ... \\n\\nAssistant: ...` transcript; each turn's text is stripped.

    Raises TranscriptError when there are no turns, text comes before the first turn, the first turn is not
    Human's, two turns of one speaker follow each other, a turn is empty, or the last turn is not Assistant's.

    >>> parse_transcript("\\n\\nHuman: Hi there\\n\\nAssistant: Hello!")
    [{'role': 'user', 'content': 'Hi there'}, {'role': 'assistant', 'content': 'Hello!'}]
    >>> parse_transcript("\\n\\nHuman: Hi\\n\\nHuman: Anyone?")
    Traceback (most recent call last):
    ...
    posttrain.data.hh_rlhf.TranscriptError: turns do not alternate: turn 2 is a second Human turn in a row
    """
    before, turns = _turns(text)
    if not turns:
        raise TranscriptError("no turns (expected '\\n\\nHuman: ' and '\\n\\nAssistant: ' markers)")
    if before.strip():
        raise TranscriptError("does not start with a Human turn: text before the first turn marker")
    if turns[0][0] != "Human":
        raise TranscriptError("does not start with a Human turn: the first turn is Assistant's")
    for n, (speaker, content) in enumerate(turns, start=1):
        if n > 1 and speaker == turns[n - 2][0]:
            raise TranscriptError(f"turns do not alternate: turn {n} is a second {speaker} turn in a row")
        if not content:
            raise TranscriptError(f"empty turn: turn {n} ({speaker}) has no text")
    if turns[-1][0] != "Assistant":
        raise TranscriptError(f"does not end with an Assistant turn: the last of {len(turns)} turns is Human's")
    return [{"role": ROLES[speaker], "content": content} for speaker, content in turns]


def conversation_key(prompt: list[dict]) -> str:
    """sha256 (hex) of the normalised first user turn: the same for rows that open with the same request.

    >>> conversation_key([{"role": "user", "content": "Hi, there!"}]) == conversation_key(
    ...     [{"role": "user", "content": "hi there"}])
    True
    """
    first = next(m["content"] for m in prompt if m["role"] == "user")
    return hashlib.sha256(normalise(first).encode()).hexdigest()


def _pair(row: object, kind: str) -> dict:
    """One row as a pair; raises BadRow."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object", f"expected an object with fields {HH_FIELDS}")
    for name in HH_FIELDS:
        if not isinstance(row.get(name), str) or not row[name].strip():
            raise BadRow(f"missing:{name}", f"field '{name}' is missing or not a non-empty string")
    # The two copies must agree before the last reply; compared first, so a copy whose last reply was cut into
    # two Assistant turns is reported as the disagreement it is rather than as a broken transcript.
    turns = {name: _turns(row[name])[1] for name in HH_FIELDS}
    before = {name: _before_last_reply(turns[name]) for name in HH_FIELDS}
    if all(turns.values()) and before["chosen"] != before["rejected"]:
        at = next((n for n, (a, b) in enumerate(zip(before["chosen"], before["rejected"]), start=1) if a != b),
                  min(len(before["chosen"]), len(before["rejected"])) + 1)
        raise BadRow("different_prompts", f"'chosen' and 'rejected' differ before the last Assistant turn (first "
                                           f"at turn {at}; {len(before['chosen'])} and {len(before['rejected'])} "
                                           "turns before it)")
    sides = {}
    for name in HH_FIELDS:
        try:
            sides[name] = parse_transcript(row[name])
        except TranscriptError as err:
            raise BadRow(f"bad_transcript:{name}", f"field '{name}': {err}") from None
    chosen, rejected = sides["chosen"], sides["rejected"]
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise BadRow("identical_replies", "'chosen' and 'rejected' end with the same Assistant reply")
    prompt = chosen[:-1]
    return {"prompt": prompt, "chosen": chosen[-1:], "rejected": rejected[-1:], "family": "hh_rlhf", "kind": kind,
            "conversation": conversation_key(prompt)}


def hh_pairs(rows: list[dict], source: str, on_bad_row: str = "error",
             kind: str = "harmless", quiet: bool = False) -> tuple[list[dict], dict]:
    """(conversational pairs, report) from HH-RLHF rows; rows are numbered from 1 as in the file.

    The report has the shape of posttrain.data.preferences.pku_pairs's: {"rows_read", "pairs", "skipped": {},
    "dropped": {reason: count}, "dropped_rows": [the first 10 dropped row numbers]}. Nothing is skipped: every
    row is a pair or a bad row.

    >>> row = {"chosen": "\\n\\nHuman: Hi\\n\\nAssistant: Hello", "rejected": "\\n\\nHuman: Hi\\n\\nAssistant: Go away"}
    >>> pairs, report = hh_pairs([row, {**row, "rejected": row["chosen"]}], "x", on_bad_row="drop")
    >>> pairs[0]["prompt"], pairs[0]["rejected"], report["dropped"], report["dropped_rows"]
    ([{'role': 'user', 'content': 'Hi'}], [{'role': 'assistant', 'content': 'Go away'}], {'identical_replies': 1}, [2])
    """
    bad_rows = BadRows(source, on_bad_row, quiet)
    pairs = []
    for i, row in enumerate(rows, start=1):
        try:
            pairs.append(_pair(row, kind))
        except BadRow as bad:
            bad_rows.add(i, bad, f"{bad.reason}: {bad}")
    return pairs, {"rows_read": len(rows), "pairs": len(pairs), "skipped": {}, **bad_rows.report(len(rows))}


def split_by_conversation(pairs: list[dict], n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held_out): every pair of one `conversation` key on the same side, each side in input order.

    Whole conversations go to held_out in an order shuffled by `seed` (over the sorted keys, so the split depends on
    the set of pairs and the seed, not on the order they came in) until it has at least `n_eval` pairs; it may hold
    a few more, since a conversation is never cut. Raises ValueError when that would leave no training pair.

    >>> pairs = [{"conversation": c, "n": n} for n, c in enumerate("aabcddde")]
    >>> train, held_out = split_by_conversation(pairs, n_eval=3, seed=0)
    >>> len(held_out) >= 3 and len(train) + len(held_out) == len(pairs)
    True
    >>> {p["conversation"] for p in train} & {p["conversation"] for p in held_out}
    set()
    >>> split_by_conversation(list(reversed(pairs)), 3, 0)[1] == list(reversed(held_out))
    True
    """
    if n_eval < 0:
        raise ValueError(f"n_eval must be 0 or more, got {n_eval}")
    sizes = Counter(p["conversation"] for p in pairs)
    order = sorted(sizes)
    random.Random(f"hh_rlhf_split:{seed}").shuffle(order)
    held, n_held = set(), 0
    for key in order:
        if n_held >= n_eval:
            break
        held.add(key)
        n_held += sizes[key]
    if n_eval > 0 and (n_held < n_eval or n_held == len(pairs)):
        raise ValueError(f"cannot hold out {n_eval} pairs by conversation and still train: {len(pairs)} pairs in "
                         f"{len(sizes)} conversations")
    train = [p for p in pairs if p["conversation"] not in held]
    held_out = [p for p in pairs if p["conversation"] in held]
    return train, held_out
