"""Real prompts with one verifiable instruction constraint appended (IFEval's kind), split before any training.

Base prompts: GSM8K train questions whose reference solution takes 3 or more <<...>> calculations (the SmolLM2 SFT
and GSM8K GRPO recipes use only the 1-2 calculation problems, and the gsm8k eval suite the test split), then the
Dolly instructions rendered as Alpaca prompts (no stage trains on that file). Each gets one constraint, worded by
IFEval's own checker (`rewards.constraints.describe`), its type dealt round-robin in a seeded order.

The split, from `seed`, is disjoint twice over: the base prompts are split into train and held-out rows, and every
parameterised type's values are split too (keywords, forbidden words, end phrases, letters, postscript markers and
every count), so no held-out row shares a prompt or a constraint parameter with a train row. The parameter-free
types (lowercase, capitals, no commas, JSON, quotation, title) have nothing to split. `overlap` measures both.

Each row also carries its base prompt's content words (`base_words`, for `rewards.constraints.instruction_grounded`):
its numbers and its words of 3 or more letters that fewer than COMMON_SHARE of all base prompts use, so "what",
"many" and "each" are left out and names, objects and quantities stay.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from posttrain.data.dolly import DataError, read_rows
from posttrain.data.gsm8k import calculations
from rewards.constraints import SUPPORTED, describe, words

HELD_OUT_BASES = 480  # base prompts held out (the ifeval suite reads the first n_prompts of them)
MIN_CALCULATIONS = 3  # GSM8K questions the SmolLM2 recipes never train on
ALPACA = re.compile(r"### Instruction:\n(?P<instruction>.*?)\n\n(?:### Input:\n(?P<input>.*?)\n\n)?### Response:", re.S)

# type -> (train values, held-out values) of its parameters; each value is the kwargs of one constraint
PARAMETERS: dict[str, tuple[list[dict], list[dict]]] = {
    "startend:end_checker": (
        [{"end_phrase": p} for p in ("Is there anything else I can help with?", "Hope this helps.",
                                     "Let me know if you have more questions.", "That is my answer.")],
        [{"end_phrase": p} for p in ("Any other questions?", "Thank you for asking.", "I hope that is clear.")]),
    "length_constraints:number_words": (
        [{"num_words": n, "relation": "less than"} for n in (30, 40, 60, 80)],
        [{"num_words": n, "relation": "less than"} for n in (35, 50, 70)]),
    "length_constraints:number_paragraphs": ([{"num_paragraphs": n} for n in (2, 4)], [{"num_paragraphs": 3}]),
    "keywords:existence": (
        [{"keywords": [w]} for w in ("simple", "answer", "important", "example", "result", "number", "people")],
        [{"keywords": [w]} for w in ("easy", "total", "idea", "final", "reason", "time")]),
    "keywords:forbidden_words": (
        [{"forbidden_words": [w]} for w in ("very", "really", "just", "also")],
        [{"forbidden_words": [w]} for w in ("so", "actually", "many")]),
    "keywords:frequency": (
        [{"keyword": w, "frequency": f, "relation": "at least"} for w in ("step", "first") for f in (2, 4)],
        [{"keyword": w, "frequency": 3, "relation": "at least"} for w in ("then", "value")]),
    "keywords:letter_frequency": (
        [{"letter": c, "let_frequency": f, "let_relation": "at least"} for c in ("a", "e") for f in (5, 10)],
        [{"letter": c, "let_frequency": 8, "let_relation": "at least"} for c in ("o", "i")]),
    "detectable_format:number_bullet_lists": ([{"num_bullets": n} for n in (2, 4)], [{"num_bullets": 3}]),
    "detectable_format:number_highlighted_sections": ([{"num_highlights": n} for n in (1, 3)],
                                                      [{"num_highlights": 2}]),
    "detectable_content:postscript": ([{"postscript_marker": "P.S."}], [{"postscript_marker": "P.P.S"}]),
}
COMMON_SHARE = 0.05  # a word in this share of the base prompts or more is not a content word
SPLITS = ("train", "held_out")
RELATIONS = ("relation", "let_relation")


def base_prompts(gsm8k_path: str | None, dolly_path: str | None) -> list[dict]:
    """{"id", "text"} for each base prompt: the GSM8K questions with 3+ calculations, then the Dolly instructions."""
    out = []
    if gsm8k_path:
        for i, row in enumerate(read_rows(Path(gsm8k_path)), start=1):
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise DataError(f"{gsm8k_path}: row {i}: field '{key}' is missing or empty")
            if calculations(row["answer"]) >= MIN_CALCULATIONS:
                out.append({"id": f"gsm8k-train-{i}", "text": row["question"].strip()})
    if dolly_path:
        for i, row in enumerate(read_rows(Path(dolly_path)), start=1):
            match = ALPACA.search(row.get("prompt") or "") if isinstance(row.get("prompt"), str) else None
            if match is None:
                raise DataError(f"{dolly_path}: row {i}: field 'prompt' is not an Alpaca prompt (### Instruction: "
                                f"... ### Response:)")
            text = match["instruction"].strip() + (f"\n\n{match['input'].strip()}" if match["input"] else "")
            out.append({"id": f"dolly-alpaca-{i}", "text": text})
    if not out:
        raise DataError("constrained prompts need grpo.prompts.path (GSM8K train) or a Dolly Alpaca file")
    return out


def content_words(bases: list[dict]) -> dict[str, list[str]]:
    """base id -> the sorted content words of that base prompt (the module docstring says which)."""
    per_base = {b["id"]: words(b["text"]) for b in bases}
    counts: dict[str, int] = {}
    for ws in per_base.values():
        for w in ws:
            counts[w] = counts.get(w, 0) + 1
    common = {w for w, c in counts.items() if c >= COMMON_SHARE * len(bases)}
    return {bid: sorted(w for w in ws if w not in common and (len(w) >= 3 or w[0].isdigit())) for bid, ws in per_base.items()}


def constraint_pool(cid: str, split: str) -> list[dict]:
    """The kwargs a constraint of type `cid` may take in `split` ([{}] for a parameter-free type)."""
    if cid not in PARAMETERS:
        return [{}]
    return PARAMETERS[cid][SPLITS.index(split)]


def constrained_rows(split: str, n: int | None, seed: int, gsm8k_path: str | None, dolly_path: str | None,
                     types: list[str] | None = None) -> list[dict]:
    """The first `n` rows (all when None) of a split: each {"prompt": [one user turn], "constraints": [{"id",
    "kwargs"}], "base_id", "type", "base_words"}. The base-prompt split depends on `seed` only, not on `types` or `n`."""
    if split not in SPLITS:
        raise ValueError(f"split '{split}' is not one of {SPLITS}")
    types = list(types or SUPPORTED)
    if unknown := [t for t in types if t not in SUPPORTED]:
        raise ValueError(f"constraint types {unknown} are not supported; supported: {', '.join(SUPPORTED)}")
    bases = base_prompts(gsm8k_path, dolly_path)
    content = content_words(bases)
    random.Random(seed).shuffle(bases)
    if len(bases) <= 2 * HELD_OUT_BASES:
        raise DataError(f"{len(bases)} base prompts cannot give {HELD_OUT_BASES} held-out ones and as many to train")
    chosen = bases[:HELD_OUT_BASES] if split == "held_out" else bases[HELD_OUT_BASES:]
    if n is not None and n > len(chosen):
        raise DataError(f"the {split} split has {len(chosen)} constrained prompts; {n} were asked for")
    rng = random.Random(f"{seed}-{split}")
    order = list(types)
    rng.shuffle(order)
    rows = []
    for k, base in enumerate(chosen[:n] if n is not None else chosen):
        cid = order[k % len(order)]
        constraint = {"id": cid, "kwargs": rng.choice(constraint_pool(cid, split))}
        text = f"{base['text']}\n\n{describe(constraint)}"
        rows.append({"prompt": [{"role": "user", "content": text}], "constraints": [constraint],
                     "base_id": base["id"], "type": cid, "base_words": content[base["id"]]})
    return rows


def overlap(train: list[dict], held_out: list[dict]) -> dict[str, list]:
    """What a held-out set shares with a train set: base prompts, and parameter values of the same constraint type
    (each kwarg value, so a keyword shared inside two different lists still counts)."""
    def values(rows):  # the comparison ("less than", "at least") is the same for every row of a type: not a value
        return {(c["id"], key, str(v)) for r in rows for c in r["constraints"]
                for key, value in c["kwargs"].items() if key not in RELATIONS
                for v in (value if isinstance(value, list) else [value])}

    prompts = sorted({r["base_id"] for r in train} & {r["base_id"] for r in held_out})
    return {"prompts": prompts, "parameters": sorted(values(train) & values(held_out))}
