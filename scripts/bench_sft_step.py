"""Seconds per SFT step on SmolLM2-135M-Instruct for the ways of training it, measured side by side in one process.

One step is what TRL's SFTTrainer does per batch: forward with labels on the assistant tokens only, the loss through
TRL's fused LM head, backward, AdamW. The batch is 8 GSM8K worked solutions of median length, rendered through
SmolLM2's chat template, under bf16 autocast (the recipe's setting where the CPU has AVX-512 BF16 or AMX). Each
variant is a fresh copy of the model; they take turns, round after round, so that a slow spell on a shared machine
falls on all of them alike:

- full / trl-head: every weight trains, the loss through TRL's fused head as it runs on CPU (every position);
- full / compact-head: the same, with posttrain.models.lm_head (labelled positions only, one product);
- top-N / trl-head and top-N / compact-head: the bottom layers and the tied embedding / LM head are frozen
  (sft.train_top_layers), so backward stops below the top N layers.

Asserts nothing; prints each variant's median step time and its speed-up over full / trl-head.
Run: make bench-sft, or .venv/bin/python scripts/bench_sft_step.py [--rounds 2 --steps 3 --top 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def batch(tokenizer, n_rows: int):
    """n_rows GSM8K solutions of similar length as (input_ids, attention_mask, labels), right-padded."""
    import torch
    from omegaconf import OmegaConf

    from posttrain.chat.render import tokenize_with_assistant_mask
    from posttrain.data.gsm8k import solution_rows

    cfg = OmegaConf.create({"path": "../shared/data/gsm8k/train.jsonl", "n": 2515, "max_calculations": 2})
    rows, _, _ = solution_rows(cfg)
    encoded = [tokenize_with_assistant_mask(tokenizer, r["messages"], row_id=str(i)) for i, r in enumerate(rows)]
    encoded.sort(key=lambda e: len(e["input_ids"]))
    middle = len(encoded) // 2
    picked = encoded[middle : middle + n_rows]  # rows of median length, as group_by_length batches them
    width = max(len(e["input_ids"]) for e in picked)
    ids = torch.full((n_rows, width), tokenizer.pad_token_id)
    attention = torch.zeros((n_rows, width), dtype=torch.long)
    labels = torch.full((n_rows, width), -100)
    for i, e in enumerate(picked):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        attention[i, :n] = 1
        labels[i, :n] = torch.where(torch.tensor(e["assistant_masks"]).bool(), torch.tensor(e["input_ids"]), -100)
    return ids, attention, labels


def variants(location, model_cfg, top: int):
    """name -> (model, optimizer, trainable parameters), each a fresh copy of the base model with TRL's head."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from posttrain.models.freezing import freeze_below_top_layers
    from posttrain.models.lm_head import add_compact_lm_head
    from posttrain.models.loading import load_model

    out = {}
    for trained in ("full", f"top-{top}"):
        for head in ("trl-head", "compact-head"):
            model = load_model(location, model_cfg)
            if trained != "full":
                freeze_below_top_layers(model, top)
            add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer does
            if head == "compact-head":
                add_compact_lm_head(model)
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            out[f"{trained} / {head}"] = (model, torch.optim.AdamW(params, lr=1e-5), sum(p.numel() for p in params))
    return out


def step(model, optimizer, ids, attention, labels) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--top", type=int, default=15, help="top-N: decoder layers that train")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import torch
    from omegaconf import OmegaConf

    from posttrain.models.loading import load_tokenizer, model_location

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_cfg = OmegaConf.load("recipes/model/smollm2-135m.yaml")
    model_cfg.setdefault("trust_remote_code", False)
    model_cfg.setdefault("revision", None)
    location = model_location(model_cfg, None)
    tokenizer = load_tokenizer(location)
    ids, attention, labels = batch(tokenizer, args.rows)
    print(f"batch: {args.rows} rows x {ids.shape[1]} tokens, {int((labels != -100).sum())} trained on; "
          f"{torch.get_num_threads()} threads, bf16 autocast")
    runs = variants(location, model_cfg, args.top)
    for model, optimizer, _ in runs.values():  # warm-up: first-call allocations, AdamW state
        step(model, optimizer, ids, attention, labels)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, (model, optimizer, _) in runs.items():
            for _ in range(args.steps):
                times[name].append(step(model, optimizer, ids, attention, labels))
            print(f"round {r + 1}: {name:>22} {statistics.median(times[name][-args.steps:]):6.2f} s a step",
                  flush=True)
    base = statistics.median(times["full / trl-head"])
    results = {}
    print(f"\n{'variant':>22} {'trainable':>12} {'median s':>9} {'speed-up':>9}")
    for name, (_, _, trainable) in runs.items():
        median = statistics.median(times[name])
        results[name] = {"trainable_params": trainable, "median_s": median, "speedup_vs_full": base / median,
                         "steps_s": times[name]}
        print(f"{name:>22} {trainable:>12,} {median:9.2f} {base / median:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "tokens": int(ids.shape[1]), "variants": results}, f, indent=2)


if __name__ == "__main__":
    main()
