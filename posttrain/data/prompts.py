"""GRPO's prompts: the tiny world's arithmetic, or a real prompt set (GSM8K, OpenR1-Math) from a local file, else
the hub. Each row holds a conversational `prompt` (one user turn) and the `answer` column the verifiers read.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.artifacts import sha256_json
from posttrain.data.constraints import constrained_rows
from posttrain.data.dolly import DataError, read_rows
from posttrain.data.gsm8k import calculations
from posttrain.data.tiny_world import make_arith, take_split

# source -> (the column that is the question, the data card); the verifier's gold is the `answer` column
PROMPT_SOURCES = {"gsm8k": ("question", "gsm8k"), "openr1_math": ("problem", "openr1-math-220k")}
HUB_IDS = {"gsm8k": ("openai/gsm8k", "main"), "openr1_math": ("open-r1/OpenR1-Math-220k", "default")}


def prompt_rows(prompts_cfg) -> tuple[str, list[dict]]:
    """(source, raw rows) of a real prompt set: the local file, else the hub's train split (online)."""
    if prompts_cfg.path:
        return str(prompts_cfg.path), read_rows(Path(prompts_cfg.path))
    from datasets import load_dataset

    hub_id, config = (prompts_cfg.hub_id, None) if prompts_cfg.hub_id else HUB_IDS[prompts_cfg.source]
    split = "train" if prompts_cfg.n is None else f"train[:{prompts_cfg.n}]"
    return f"{hub_id}:train", list(load_dataset(hub_id, config, split=split))


def load_prompts(prompts_cfg, seed: int) -> tuple[list[dict], dict]:
    """Rows with a conversational `prompt` and the `answer` column the verifiers read."""
    if prompts_cfg.source == "tiny_arith":
        rows = take_split(make_arith(0.0), prompts_cfg.n or 2000, "train", seed, "arith")
        rows = [{"prompt": r["messages"][:1], "answer": r["answer"]} for r in rows]
        record = {"id": "tiny_world/arith (train split)", "card": "data_cards/tiny_world.md"}
    elif prompts_cfg.source in PROMPT_SOURCES:
        limit = getattr(prompts_cfg, "max_calculations", None)
        if limit is not None and prompts_cfg.source != "gsm8k":
            raise ValueError(f"grpo.prompts.max_calculations filters GSM8K solutions; source is {prompts_cfg.source}")
        question, card = PROMPT_SOURCES[prompts_cfg.source]
        source, raw = prompt_rows(prompts_cfg)
        rows = []
        for i, r in enumerate(raw, start=1):
            for name in (question, "answer"):
                if not isinstance(r.get(name), str) or not r[name].strip():
                    raise DataError(f"{source}: row {i}: field '{name}' is missing or empty")
            rows.append({"prompt": [{"role": "user", "content": r[question]}], "answer": r["answer"]})
        if limit is not None:
            rows = [r for r in rows if 1 <= calculations(r["answer"]) <= limit]
        rows = rows[: prompts_cfg.n] if prompts_cfg.n else rows
        record = {"id": source, "card": f"data_cards/{card}.md",
                  **({"max_calculations": limit} if limit is not None else {})}
    elif prompts_cfg.source == "constraints":
        if prompts_cfg.max_calculations is not None:
            raise ValueError("grpo.prompts.max_calculations filters GSM8K solutions; with source constraints the "
                             "GSM8K questions are those of 3 or more calculations: set it to null")
        types = list(prompts_cfg.types) if prompts_cfg.types else None
        rows = constrained_rows("train", prompts_cfg.n, seed, prompts_cfg.path, prompts_cfg.dolly_path, types)
        record = {"id": "ifeval-constraints (train split)", "card": "data_cards/ifeval-constraints.md",
                  "gsm8k": prompts_cfg.path, "dolly": prompts_cfg.dolly_path, "types": types or "all", "seed": seed}
    else:
        raise ValueError(f"grpo.prompts.source '{prompts_cfg.source}' is not one of tiny_arith, "
                         f"{', '.join(PROMPT_SOURCES)}, constraints")
    return rows, {**record, "rows": len(rows), "content_sha256": sha256_json(rows)}
