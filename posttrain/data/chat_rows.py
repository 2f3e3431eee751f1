"""The chat rows SFT trains on (and quantize measures held-out perplexity on): the tiny world's mixture or a
Dolly-style dataset, and their tokenization through the model's chat template with the assistant mask.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from posttrain.artifacts import sha256_json
from posttrain.chat.render import tokenize_with_assistant_mask
from posttrain.data.dolly import load_dolly
from posttrain.data.gsm8k import solution_rows
from posttrain.data.tiny_world import sft_rows


def load_rows(data_cfg, part: str = "train") -> tuple[list[dict], dict]:
    """Conversation rows of one part, "train" or "held_out", and the dataset record that goes into the manifest.

    The tiny world's held-out part is its test split. A real dataset's is its last `data.held_out` rows, which the
    train part leaves out; with `data.held_out: 0` it has none, and asking for it is an error. With `data.gsm8k.n`
    set, the train part ends with that many GSM8K worked solutions (posttrain.data.gsm8k), recorded under
    `gsm8k_solutions`; they have no held-out part here, the GSM8K test split being the eval suite's.
    """
    if part not in ("train", "held_out"):
        raise ValueError(f"load_rows: part {part!r} is not one of train, held_out")
    gsm8k_cfg = getattr(data_cfg, "gsm8k", None)
    with_gsm8k = gsm8k_cfg is not None and gsm8k_cfg.n > 0
    if with_gsm8k and data_cfg.name == "tiny":
        raise ValueError("data.gsm8k.n adds GSM8K solutions to a real dataset's rows; the tiny world (data=tiny) "
                         "makes its own arithmetic")
    if data_cfg.name == "tiny":
        rows = sft_rows("train" if part == "train" else "test", dict(data_cfg.counts), data_cfg.seed,
                        data_cfg.arith_slip_rate, data_cfg.safety_decline_rate, data_cfg.arith_miscopy_rate)
        source, card = f"tiny_world/sft{'' if part == 'train' else '/test'}", "data_cards/tiny_world.md"
    elif data_cfg.name == "dolly":
        rows, source = load_dolly(data_cfg.path, data_cfg.hub_id, data_cfg.split, data_cfg.limit)
        rows, source = _split_held_out(rows, source, getattr(data_cfg, "held_out", 0), part)
        card = "data_cards/databricks-dolly-15k.md"
    else:
        raise ValueError(f"data.name '{data_cfg.name}' is not one of tiny, dolly")
    record = {"id": source, "card": card, "rows": len(rows),
              "content_sha256": sha256_json([r["messages"] for r in rows])}
    if with_gsm8k and part == "train":
        solutions, _, record["gsm8k_solutions"] = solution_rows(gsm8k_cfg)
        rows = rows + solutions
    return rows, record


def _split_held_out(rows: list[dict], source: str, held_out: int, part: str) -> tuple[list[dict], str]:
    if held_out < 0 or held_out >= len(rows):
        raise ValueError(f"data.held_out={held_out}: {source} has {len(rows)} rows; hold out 0 to {len(rows) - 1} "
                         f"of them")
    if part == "train":
        return rows[: len(rows) - held_out], source
    if held_out == 0:
        raise ValueError(f"{source}: no held-out rows (data.held_out is 0): set data.held_out to the number of last "
                         f"rows no stage trains or calibrates on")
    return rows[len(rows) - held_out :], f"{source} (held out: last {held_out} rows)"


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
