"""Preference pairs (prompt, chosen, rejected) for the reward model and DPO: the tiny world's, PKU-SafeRLHF rows, or
Anthropic HH-RLHF harmless-base rows (posttrain.data.hh_rlhf: multi-turn, held out by conversation).

PKU-SafeRLHF rows carry `prompt`, `response_0`, `response_1`, two ids (`safer_response_id`, `better_response_id`)
and two safety flags (`is_response_0_safe`, `is_response_1_safe`). The `preference` mode says which label picks
"chosen":

- `safer` (default): chosen = response_<safer_response_id>;
- `better`: chosen = response_<better_response_id> (helpfulness, which may favour the less safe reply);
- `safe_vs_unsafe`: only rows where exactly one response is flagged safe; chosen = that one. Rows with both or
  neither safe are skipped and counted (`not_exactly_one_safe`): that is the data, not an error.

Every row is checked first. A bad row (missing or empty text, a label that is not 0/1, labels that contradict each
other) either stops the load with a DataError naming the file, the row and the field (`on_bad_row="error"`) or is
counted by reason and dropped with a warning (`on_bad_row="drop"`); it is never passed on.
"""

from __future__ import annotations

import logging
import random
from numbers import Integral
from pathlib import Path

from posttrain.artifacts import sha256_json
from posttrain.data.bad_rows import BadRow, BadRows
from posttrain.data.dolly import DataError, read_rows
from posttrain.data.hh_rlhf import SUBSETS, hh_pairs, split_by_conversation
from posttrain.data.tiny_safety import safety_pairs
from posttrain.data.tiny_world import preference_pairs

log = logging.getLogger("posttrain")

PKU_FIELDS = ("prompt", "response_0", "response_1")
ID_LABELS = ("safer_response_id", "better_response_id")
SAFE_LABELS = ("is_response_0_safe", "is_response_1_safe")
PREFERENCES = ("safer", "better", "safe_vs_unsafe")
# Labels a mode cannot do without; the others are still checked when a row has them, since a malformed label
# means the row is suspect even if this mode does not read it.
REQUIRED_LABELS = {"safer": ("safer_response_id",), "better": ("better_response_id",), "safe_vs_unsafe": SAFE_LABELS}


def _check_option(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"reward_model.pairs.{name} '{value}' is not one of {', '.join(valid)}")


def _label(row: dict, name: str, required: bool) -> int | None:
    """A label as 0 or 1; None when an optional label is absent. Only the safety flags may be true/false."""
    value = row.get(name)
    if value is None and not required:
        return None
    flag = name in SAFE_LABELS
    if isinstance(value, Integral) and value in (0, 1) and (flag or not isinstance(value, bool)):
        return int(value)
    reason = "missing" if value is None else "bad_label"
    raise BadRow(f"{reason}:{name}", f"field '{name}' must be {'true/false or ' if flag else ''}0 or 1, got {value!r}")


def _choose(row: object, preference: str) -> int | None:
    """Index (0 or 1) of the chosen response; None when `safe_vs_unsafe` skips the row. Raises BadRow."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object", f"expected an object with fields {PKU_FIELDS + REQUIRED_LABELS[preference]}")
    for name in PKU_FIELDS:
        if not isinstance(row.get(name), str) or not row[name].strip():
            raise BadRow(f"missing:{name}", f"field '{name}' is missing or not a non-empty string")
    labels = {name: _label(row, name, name in REQUIRED_LABELS[preference]) for name in ID_LABELS + SAFE_LABELS}
    safe = [labels[name] for name in SAFE_LABELS]
    if preference == "safe_vs_unsafe":
        if safe[0] == safe[1]:
            return None
        choice, safer = safe.index(1), labels["safer_response_id"]
        if safer is not None and safer != choice:
            raise BadRow("contradictory_labels", f"field 'safer_response_id' is {safer}, but response_{safer} is "
                                                  f"flagged unsafe and response_{choice} safe")
        return choice
    choice = labels[f"{preference}_response_id"]
    # Helpfulness may rightly prefer the unsafe reply, so only `safer` is held to the safety flags.
    if preference == "safer" and safe[choice] == 0 and safe[1 - choice] == 1:
        raise BadRow("contradictory_labels", f"field 'safer_response_id' is {choice}, but {SAFE_LABELS[choice]} is "
                                              f"false and {SAFE_LABELS[1 - choice]} is true")
    return choice


def pku_pairs(rows: list[dict], source: str, preference: str = "safer",
              on_bad_row: str = "error", quiet: bool = False) -> tuple[list[dict], dict]:
    """(conversational pairs, report) from PKU-SafeRLHF-shaped rows; rows are numbered from 1 as in the file.

    The report: {"rows_read", "pairs", "skipped": {"not_exactly_one_safe"}, "dropped": {reason: count},
    "dropped_rows": [the first 10 dropped row numbers]}.

    >>> pairs, report = pku_pairs([{"prompt": "p", "response_0": "a", "response_1": "b", "safer_response_id": 1,
    ...                             "better_response_id": 0}], "x")
    >>> pairs[0]["chosen"], pairs[0]["kind"], report["pairs"]
    ([{'role': 'assistant', 'content': 'b'}], 'safer', 1)
    """
    _check_option("preference", preference, PREFERENCES)
    bad_rows = BadRows(source, on_bad_row, quiet)
    pairs, skipped = [], 0
    for i, row in enumerate(rows, start=1):
        try:
            choice = _choose(row, preference)
        except BadRow as bad:
            bad_rows.add(i, bad, str(bad))
            continue
        if choice is None:
            skipped += 1
            continue
        pairs.append({
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row[f"response_{choice}"]}],
            "rejected": [{"role": "assistant", "content": row[f"response_{1 - choice}"]}],
            "family": "pku_saferlhf",
            "kind": preference,
        })
    dropped = bad_rows.report(len(rows))
    if skipped and not quiet:
        log.info("%s: %s skipped %d rows without exactly one safe response", source, preference, skipped)
    return pairs, {"rows_read": len(rows), "pairs": len(pairs), "skipped": {"not_exactly_one_safe": skipped},
                   **dropped}


def load_pair_split(stage: str, pairs_cfg, seed: int) -> tuple[list[dict], list[dict], dict]:
    """`load_pairs` for a training stage: its dataset record also counts the pairs and hashes the training ones'
    text (what the stage trained on, for the manifest), and the split is logged."""
    train, held_out, record = load_pairs(pairs_cfg, seed)
    record = {**record, "rows": len(train), "held_out": len(held_out),
              "content_sha256": sha256_json([[p["prompt"], p["chosen"], p["rejected"]] for p in train])}
    log.info("%s: %d training pairs, %d held out (%s)", stage, len(train), len(held_out), record["id"])
    return train, held_out, record


def load_pairs(pairs_cfg, seed: int) -> tuple[list[dict], list[dict], dict]:
    """(train pairs, held-out pairs, dataset record) for the recipe's `pairs` block."""
    if pairs_cfg.source == "tiny":
        train = preference_pairs("train", pairs_cfg.n_train, seed)
        held_out = preference_pairs("test", pairs_cfg.n_eval, seed)
        return train, held_out, {"id": "tiny_world/preference_pairs", "card": "data_cards/tiny_world.md"}
    if pairs_cfg.source == "tiny_safety":
        # General pairs (echo, arithmetic, QA) mixed in anchor the skills the safety pairs never show; the
        # held-out pairs of the likelihood report stay safety pairs.
        n_anchor = round(pairs_cfg.n_train * pairs_cfg.anchor_fraction)
        train = safety_pairs("train", pairs_cfg.n_train - n_anchor, seed) + preference_pairs("train", n_anchor, seed)
        random.Random(f"anchored:{seed}").shuffle(train)
        held_out = safety_pairs("test", pairs_cfg.n_eval, seed)
        return train, held_out, {"id": "tiny_world/safety_pairs", "card": "data_cards/tiny_world.md",
                                 "anchor_pairs": n_anchor}
    if pairs_cfg.source == "pku_saferlhf":
        if pairs_cfg.path:
            source, rows = str(pairs_cfg.path), read_rows(Path(pairs_cfg.path))
        elif pairs_cfg.hub_id:
            from datasets import load_dataset

            source = f"{pairs_cfg.hub_id}:{pairs_cfg.split}"
            rows = list(load_dataset(pairs_cfg.hub_id, split=pairs_cfg.split))
        else:
            raise DataError("reward_model.pairs.path and .hub_id are both empty: nothing to load")
        pairs, report = pku_pairs(rows, source, pairs_cfg.preference, pairs_cfg.on_bad_row)
        if pairs_cfg.n_train:
            pairs = pairs[: pairs_cfg.n_train + pairs_cfg.n_eval]
        n_eval = min(pairs_cfg.n_eval, len(pairs) // 2)  # a tiny file still trains on half of it
        if n_eval < 1:
            raise DataError(f"{source}: {len(pairs)} pairs is too few to hold any out for the pairwise accuracy "
                            f"(report: {report})")
        record = {"id": source, "card": "data_cards/pku-saferlhf.md", "preference": pairs_cfg.preference,
                  "report": report}
        return pairs[n_eval:], pairs[:n_eval], record
    if pairs_cfg.source == "hh_rlhf":
        return hh_rlhf_pairs(pairs_cfg, seed)
    raise ValueError(f"pairs.source '{pairs_cfg.source}' is not one of tiny, tiny_safety, pku_saferlhf, hh_rlhf")


def hh_rlhf_pairs(pairs_cfg, seed: int, subset: str = "harmless-base") -> tuple[list[dict], list[dict], dict]:
    """HH-RLHF pairs from `pairs_cfg.path` (JSONL, plain or .jsonl.gz), else the hub's `subset` folder of
    `pairs_cfg.hub_id`. Whole conversations are held out (at least n_eval pairs, chosen by the run's seed), so no
    conversation is trained on and scored; n_train then caps the training pairs (null: all the rest)."""
    if pairs_cfg.path:
        source, rows = str(pairs_cfg.path), read_rows(Path(pairs_cfg.path))
    elif pairs_cfg.hub_id:
        from datasets import load_dataset

        source = f"{pairs_cfg.hub_id}:{subset}/{pairs_cfg.split}"
        rows = list(load_dataset(pairs_cfg.hub_id, data_dir=subset, split=pairs_cfg.split))
    else:
        raise DataError("reward_model.pairs.path and .hub_id are both empty: nothing to load")
    pairs, report = hh_pairs(rows, source, pairs_cfg.on_bad_row, kind=SUBSETS[subset])
    if pairs_cfg.n_eval < 1:
        raise DataError(f"{source}: n_eval is {pairs_cfg.n_eval}; the pairwise accuracy needs held-out pairs")
    try:
        train, held_out = split_by_conversation(pairs, pairs_cfg.n_eval, seed)
    except ValueError as err:
        raise DataError(f"{source}: {err} (report: {report})") from None
    if pairs_cfg.n_train:
        train = train[: pairs_cfg.n_train]
    conversations = {"train": len({p["conversation"] for p in train}),
                     "held_out": len({p["conversation"] for p in held_out})}
    record = {"id": source, "card": "data_cards/hh-rlhf.md", "report": report, "conversations": conversations}
    return train, held_out, record
