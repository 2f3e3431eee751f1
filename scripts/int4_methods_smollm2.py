"""Held-out perplexity of SmolLM2-135M-Instruct after int4 quantization, per method: round to nearest, GPTQ, AWQ.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/int4_methods_smollm2.py [--only rtn-asym-g32 gptq-g64-48] [--json F]

The model is the float32 copy of the Q4_1 GGUF (`model=smollm2-135m`), so its linears are already 4-bit on a
grid of their own: the table says what a second int4 quantization costs. Everything goes through the quantize
stage's own functions: `quantize_model` (damp from the quantize recipe), `calibration_ids` (rendered rows, one
stream, cut into sequences of `quantize.calibration_length` tokens) and `perplexity` (assistant tokens only).

Held-out text: the stage's `held_out_rows` of `data=dolly` on ../shared/data/dolly/dolly15k_sample_transcribed.jsonl
(`data.held_out=48`: the last 48 of its 49 rows, the most a file can hold out), rendered with the chat
template and the assistant mask.
Calibration (GPTQ, AWQ): the 151 Alpaca-format Dolly rows in the same folder, turned back into Dolly rows and
rendered as conversations the same way, minus any whose instruction is also a held-out row's. The stage itself
calibrates on the rows the data does not hold out, which on a 49-row file leaves few.
"256 rows" asks for the stage's default and gets what the file has (149 rows). Prints a table; asserts nothing.
About 80 minutes on one thread: round to nearest takes seconds, GPTQ 4-10 minutes, AWQ ~22 minutes a variant,
each perplexity ~40 s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOLLY_DIR = REPO.parent / "shared" / "data" / "dolly"
HELD_OUT = DOLLY_DIR / "dolly15k_sample_transcribed.jsonl"
CALIBRATION = DOLLY_DIR / "dolly_derived_alpaca_prompt_validation_151.jsonl"

# name: (method, group size, symmetric, calibration rows)
VARIANTS = {
    "rtn-g64": ("rtn", 64, True, 0),
    "rtn-g32": ("rtn", 32, True, 0),
    "rtn-asym-g64": ("rtn", 64, False, 0),
    "rtn-asym-g32": ("rtn", 32, False, 0),
    "gptq-g64-48": ("gptq", 64, True, 48),
    "gptq-g64-256": ("gptq", 64, True, 256),
    "gptq-asym-g32-48": ("gptq", 32, False, 48),
    "gptq-asym-g32-256": ("gptq", 32, False, 256),
    "awq-g64-48": ("awq", 64, True, 48),
    "awq-asym-g32-48": ("awq", 32, False, 48),
}
ALPACA = re.compile(r"### Instruction:\n(?P<instruction>.*?)\n\n(?:### Input:\n(?P<context>.*?)\n\n)?### Response:$",
                    re.S)


def calibration_rows(path: Path, held_out: list[dict]) -> list[dict]:
    """The Alpaca-format rows as Dolly conversations, dropping those whose instruction a held-out row has."""
    from posttrain.data.tiny_world import qa_messages

    seen = {r["instruction"].strip() for r in held_out}
    rows = []
    for line in path.read_text().splitlines():
        item = json.loads(line)
        match = ALPACA.search(item["prompt"])
        if match is None:
            raise ValueError(f"{path}: a prompt without '### Instruction: ... ### Response:': {item['prompt'][:80]!r}")
        row = {"instruction": match["instruction"].strip(), "context": (match["context"] or "").strip(),
               "response": item["answer"].removesuffix("###eos_token###").strip()}
        if row["instruction"] not in seen:
            rows.append(dict(row, messages=qa_messages(row)))
    return rows


def run_variant(name: str, location, held_out_ids, calib_rows, tokenizer, block, seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.quant.calibrate import decoder_layers, quantization_targets, quantize_model
    from posttrain.models.likelihood import perplexity
    from posttrain.stages.quantize import calibration_ids, format_label, layer_errors

    method, group, symmetric, n_rows = VARIANTS[name]
    model = AutoModelForCausalLM.from_pretrained(str(location), dtype=torch.float32).eval()
    calib = calibration_ids(tokenizer, calib_rows[:n_rows], block.calibration_length) if method != "rtn" else None
    originals = {n: w.detach().clone() for i, layer in enumerate(decoder_layers(model))
                 for n, w in quantization_targets(layer, f"model.layers.{i}").items()}
    torch.manual_seed(seed)
    started = time.perf_counter()
    quantized = quantize_model(model, method, "int4", group, symmetric, calib, damp=block.damp)
    quantize_s = time.perf_counter() - started
    started = time.perf_counter()
    ppl = perplexity(model, held_out_ids)
    # AWQ's weights carry folded input scales, so their error against the originals means nothing (as in the stage).
    errors = layer_errors(originals, quantized) if method != "awq" else []
    n_params = sum(e.numel() for e in originals.values())
    return {
        "variant": name, "label": format_label("int4", group, symmetric) + ("" if method == "rtn" else f" {method}"),
        "method": method, "group_size": group, "symmetric": symmetric,
        "calibration_rows": min(n_rows, len(calib_rows)) if calib is not None else 0,
        "calibration_sequences": int(calib.shape[0]) if calib is not None else 0,
        "perplexity": ppl, "weight_rel_error": (sum(e["rel_error"] * originals[e["name"]].numel() for e in errors)
                                                / n_params) if errors else None,
        "quantize_s": quantize_s, "perplexity_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.config import compose
    from posttrain.data.chat_rows import tokenize_rows
    from posttrain.models.loading import load_tokenizer, model_location
    from posttrain.models.likelihood import perplexity
    from posttrain.stages.quantize import held_out_rows

    cfg = compose(["model=smollm2-135m", "data=dolly", f"data.path={HELD_OUT}", "data.held_out=48"])
    block = cfg.quantize
    location = model_location(cfg.model, None)
    tokenizer = load_tokenizer(location)
    held_out = held_out_rows(cfg.data, block.eval_rows)
    ids, masks, _ = tokenize_rows(held_out, tokenizer, "held-out", None, {})
    held_out_ids = list(zip(ids, masks))
    calib_rows = calibration_rows(CALIBRATION, held_out)

    started = time.perf_counter()
    base = perplexity(AutoModelForCausalLM.from_pretrained(str(location), dtype=torch.float32).eval(), held_out_ids)
    base_s = time.perf_counter() - started
    print(f"base: perplexity {base:.4f} on {len(held_out_ids)} held-out rows ({sum(sum(m[1:]) for m in masks)} "
          f"assistant tokens), {base_s:.0f} s; {len(calib_rows)} calibration rows available, "
          f"{block.calibration_length} tokens per sequence, damp {block.damp}, threads {torch.get_num_threads()}",
          flush=True)

    results = []
    for name in args.only:
        result = run_variant(name, location, held_out_ids, calib_rows, tokenizer, block, cfg.seed)
        result["change"] = result["perplexity"] / base - 1
        results.append(result)
        print(f"  {name}: {result['perplexity']:.4f} ({100 * result['change']:+.2f}%), quantize "
              f"{result['quantize_s']:.0f} s", flush=True)

    header = (f"{'variant':<20} {'label':<22} {'calib rows/seqs':>15} {'weight rel err':>14} {'perplexity':>10} "
              f"{'change':>8} {'quantize s':>10} {'ppl s':>6}")
    print("\n" + header + "\n" + "-" * len(header))
    print(f"{'base (Q4_1 copy)':<20} {'float32':<22} {'':>15} {'':>14} {base:>10.4f} {'':>8} {'':>10} {base_s:>6.0f}")
    for r in results:
        calib = f"{r['calibration_rows']}/{r['calibration_sequences']}" if r["method"] != "rtn" else "-"
        error = f"{r['weight_rel_error']:.4f}" if r["weight_rel_error"] is not None else "-"
        print(f"{r['variant']:<20} {r['label']:<22} {calib:>15} {error:>14} {r['perplexity']:>10.4f} "
              f"{100 * r['change']:>+7.2f}% {r['quantize_s']:>10.0f} {r['perplexity_s']:>6.0f}")
    if args.json:
        args.json.write_text(json.dumps({"base_perplexity": base, "base_perplexity_s": base_s,
                                         "held_out_rows": len(held_out_ids), "variants": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
