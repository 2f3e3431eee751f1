"""Preference pairs (prompt, chosen, rejected) for the reward model and DPO: the tiny world's, or PKU-SafeRLHF rows.

PKU-SafeRLHF rows carry `prompt`, `response_0`, `response_1` and two labels: `safer_response_id` (the default
choice of "chosen" here) and `better_response_id` (helpfulness). Every row is checked first: a missing field or a
label that is not 0 or 1 is an error naming the file, the row and the field.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data.dolly import DataError, read_rows

PKU_FIELDS = ("prompt", "response_0", "response_1")
PREFERENCE_LABELS = {"safer": "safer_response_id", "better": "better_response_id"}


def pku_pairs(rows: list[dict], source: str, preference: str = "safer") -> list[dict]:
    """Conversational pairs from PKU-SafeRLHF-shaped rows; rows are numbered from 1 as in the file.

    >>> pku_pairs([{"prompt": "p", "response_0": "a", "response_1": "b", "safer_response_id": 1,
    ...             "better_response_id": 0}], "x")[0]["chosen"]
    [{'role': 'assistant', 'content': 'b'}]
    """
    if preference not in PREFERENCE_LABELS:
        raise ValueError(f"preference '{preference}' is not one of {sorted(PREFERENCE_LABELS)}")
    label = PREFERENCE_LABELS[preference]
    pairs = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{source}: row {i}: expected an object with fields {(*PKU_FIELDS, label)}")
        for name in PKU_FIELDS:
            if not isinstance(row.get(name), str) or not row[name].strip():
                raise DataError(f"{source}: row {i}: field '{name}' is missing or not a non-empty string")
        choice = row.get(label)
        if choice not in (0, 1) or isinstance(choice, bool):
            raise DataError(f"{source}: row {i}: field '{label}' must be 0 or 1, got {choice!r}")
        chosen, rejected = row[f"response_{choice}"], row[f"response_{1 - choice}"]
        pairs.append({
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
            "family": "pku_saferlhf",
        })
    return pairs


def load_pairs(pairs_cfg, seed: int) -> tuple[list[dict], list[dict], dict]:
    """(train pairs, held-out pairs, dataset record) for the recipe's `pairs` block."""
    if pairs_cfg.source == "tiny":
        from posttrain.data.tiny_world import preference_pairs

        train = preference_pairs("train", pairs_cfg.n_train, seed)
        held_out = preference_pairs("test", pairs_cfg.n_eval, seed)
        return train, held_out, {"id": "tiny_world/preference_pairs", "card": "data_cards/tiny_world.md"}
    if pairs_cfg.source == "pku_saferlhf":
        if pairs_cfg.path:
            source, rows = str(pairs_cfg.path), read_rows(Path(pairs_cfg.path))
        elif pairs_cfg.hub_id:
            from datasets import load_dataset

            source, rows = f"{pairs_cfg.hub_id}:{pairs_cfg.split}", list(load_dataset(pairs_cfg.hub_id, split=pairs_cfg.split))
        else:
            raise DataError("reward_model.pairs.path and .hub_id are both empty: nothing to load")
        pairs = pku_pairs(rows, source, pairs_cfg.preference)
        if pairs_cfg.n_train:
            pairs = pairs[: pairs_cfg.n_train + pairs_cfg.n_eval]
        n_eval = min(pairs_cfg.n_eval, len(pairs) // 2)  # a tiny file still trains on half of it
        if n_eval < 1:
            raise DataError(f"{source}: {len(pairs)} pairs is too few to hold any out for the pairwise accuracy")
        record = {"id": source, "card": "data_cards/pku-saferlhf.md", "preference": pairs_cfg.preference}
        return pairs[n_eval:], pairs[:n_eval], record
    raise ValueError(f"reward_model.pairs.source '{pairs_cfg.source}' is not one of tiny, pku_saferlhf")
