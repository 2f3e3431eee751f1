"""The chat rows SFT trains on (and quantize measures held-out perplexity on): the tiny world's mixture or a
Dolly-style dataset, and their tokenization through the model's chat template with the assistant mask.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from posttrain.artifacts import sha256_json
from posttrain.chat.render import tokenize_with_assistant_mask
from posttrain.data.dolly import load_dolly
from posttrain.data.tiny_world import sft_rows


def load_rows(data_cfg) -> tuple[list[dict], dict]:
    """Conversation rows for training and the dataset record that goes into the manifest."""
    if data_cfg.name == "tiny":
        rows = sft_rows("train", dict(data_cfg.counts), data_cfg.seed, data_cfg.arith_slip_rate,
                        data_cfg.safety_decline_rate, data_cfg.arith_miscopy_rate)
        source, card = "tiny_world/sft", "data_cards/tiny_world.md"
    elif data_cfg.name == "dolly":
        rows, source = load_dolly(data_cfg.path, data_cfg.hub_id, data_cfg.split, data_cfg.limit)
        card = "data_cards/databricks-dolly-15k.md"
    else:
        raise ValueError(f"data.name '{data_cfg.name}' is not one of tiny, dolly")
    record = {"id": source, "card": card, "rows": len(rows),
              "content_sha256": sha256_json([r["messages"] for r in rows])}
    return rows, record


def tokenize_rows(rows, tokenizer, source: str, max_length: int | None, template_kwargs: dict):
    """input_ids + assistant_masks per row, truncated to max_length; rows left with no assistant token are dropped."""
    ids, masks, dropped = [], [], 0
    for i, row in enumerate(tqdm(rows, desc="render + mask", unit="row"), start=1):
        enc = tokenize_with_assistant_mask(tokenizer, row["messages"], row_id=f"{source} row {i}", **template_kwargs)
        row_ids, row_mask = enc["input_ids"][:max_length], enc["assistant_masks"][:max_length]
        if not any(row_mask):
            dropped += 1
            continue
        ids.append(row_ids)
        masks.append(row_mask)
    if not ids:
        raise ValueError(f"{source}: every row lost its assistant tokens to max_length={max_length}")
    return ids, masks, dropped
