"""Decode speed on one GPU: our KV-cached engine against transformers' `generate`, for bf16, int8 and int4 weights,
each against the memory-bandwidth ceiling.

    python scripts/gpu_decode.py [--budget-s 240]       # CUDA: a random ~0.5B Qwen3 (Qwen3-0.6B's shapes, 24 layers)
    python scripts/gpu_decode.py --device cpu --tiny    # smoke test: tiny config, 8 new tokens, bf16 only, no Triton

Sections (a failure in one is printed and recorded, and the others still run): environment; the Triton kernels
against a float64 reference and their timings (`triton_check.check_kernels_against_reference` / `time_kernels`);
the device's copy and read bandwidth; then for every (weights, batch): decode tokens/s of our engine and of
transformers `generate` on the same model, and the ceiling

    ceiling tokens/s = batch * read bandwidth / bytes of weights read per decode step

where the bytes are every linear weight with its scales and zero points, lm_head included, the embedding only when
tied (then it is the lm_head, counted once). KV-cache reads are left out of the ceiling. int8 is RTN per output
channel, int4 RTN group 128 symmetric; the quantized linears are `gpu_linear.TritonQuantLinear` modules, and the same
module instances are swapped into our model and into the transformers model, so both run the same kernels; lm_head
stays bf16. Decode tokens/s counts the tokens after the first (the first comes from the prefill): ours from the
engine's own timing (first token to last, every step ends on a host sync), transformers' as
(batch * (new - 1)) / (time of generate(new) - time of generate(1)). The table is also written as JSON to
$OUT/gpu_decode.json when OUT is set (or to --json), rewritten after every row so a cut run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing the package

from posttrain.bench import measure_bandwidth, synchronize  # noqa: E402
from posttrain.quant.calibrate import decoder_layers, quantization_targets  # noqa: E402
from posttrain.quant.formats import quantize_weight  # noqa: E402
from posttrain.serve.engine import Engine, SamplingParams, model_from_hf  # noqa: E402

# Qwen3-0.6B's config (reference/configs/qwen3-0.6b.config.json) with 24 layers instead of 28: about 0.53B
# parameters, 0.16B of them the tied embedding. Embedded here because ../shared does not travel to the GPU machine.
QWEN3_05B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                 max_position_embeddings=40960, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
TINY = dict(QWEN3_05B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
WEIGHTS = {"bf16": None, "int8": ("int8", None, True), "int4": ("int4", 128, True)}  # fmt, group size, symmetric
PROMPT_TOKENS = 16


class Report:
    """Everything measured, printed as it comes and kept for the JSON file."""

    def __init__(self, json_path: Path | None):
        self.json_path, self.data = json_path, {"rows": [], "errors": {}, "notes": []}

    def error(self, section: str, exc: BaseException) -> None:
        print(f"!! {section} FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=6, file=sys.stdout)
        self.data["errors"][section] = f"{type(exc).__name__}: {exc}"
        self.save()

    def note(self, text: str) -> None:
        print("note:", text)
        self.data["notes"].append(text)

    def save(self) -> None:
        if self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.json_path.write_text(json.dumps(self.data, indent=1, default=str))


def print_table(rows: list[dict], columns: list[str], formats: dict[str, str] | None = None) -> None:
    formats = formats or {}
    cells = [[format(row.get(c), formats.get(c, "")) if row.get(c) is not None else "-" for c in columns]
             for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


# ------------------------------------------------------------------------------------------ the model
def build_hf_model(config_values: dict, device: torch.device, seed: int = 0):
    """A randomly initialised Qwen3 causal LM in bf16 on `device` (initialised there: no host copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**config_values, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def rtn_quantize(hf_model, fmt: str, group_size: int | None, symmetric: bool) -> dict:
    """{module name: QuantizedWeight} for every decoder linear (the targets `quantize_model` uses), RTN, weights left
    unchanged (quantize_model writes the dequantized values back, which would compound int8 then int4)."""
    names = {module: name for name, module in hf_model.named_modules()}
    quantized = {}
    for layer in decoder_layers(hf_model):
        for name, weight in quantization_targets(layer, names[layer]).items():
            quantized[name] = quantize_weight(weight, fmt, group_size, symmetric)
    return quantized


def rtn_quantize_names(hf_model) -> list[str]:
    names = {module: name for name, module in hf_model.named_modules()}
    return [n for layer in decoder_layers(hf_model) for n in quantization_targets(layer, names[layer])]


def bytes_per_decode_step(model: nn.Module) -> int:
    """Bytes of every linear (codes, scales, zero points, bias) read once per decode step; the embedding is read
    only through a tied lm_head, and a tensor shared by two modules counts once."""
    from posttrain.quant.gpu_linear import TritonQuantLinear

    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, TritonQuantLinear):
            tensors = list(module.buffers())
        elif isinstance(module, nn.Linear):
            tensors = [t for t in (module.weight, module.bias) if t is not None]
        else:
            continue
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


# ------------------------------------------------------------------------------------------ decode timings
def ours_decode(model, prompts: list[list[int]], new_tokens: int, repeats: int, device: torch.device) -> dict:
    """Median decode tokens/s of our engine over `repeats` runs, after a short warm-up run of the same batch."""
    engine = Engine(model, None, max_batch=len(prompts), max_len=PROMPT_TOKENS + new_tokens + 8, stop_token_ids=[])
    engine.generate(prompts, SamplingParams(max_tokens=min(new_tokens, 8), ignore_eos=True))  # compile, allocate
    rates, done = [], None
    for _ in range(repeats):
        synchronize(device)
        done = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        synchronize(device)
        decoded = sum(len(c.token_ids) - 1 for c in done)
        rates.append(decoded / max(c.decode_s for c in done))
    return {"tok_s": statistics.median(rates), "ttft_ms": done[0].ttft_s * 1e3, "tokens": done[0].token_ids}


def hf_generate_s(hf_model, input_ids: torch.Tensor, new_tokens: int, device: torch.device) -> tuple[float, list]:
    synchronize(device)
    t0 = time.perf_counter()
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    synchronize(device)
    return time.perf_counter() - t0, out[0, input_ids.shape[1]:].tolist()


@torch.inference_mode()
def hf_decode(hf_model, prompts: list[list[int]], new_tokens: int, repeats: int, device: torch.device) -> dict:
    """Decode tokens/s of transformers generate (dynamic cache, eager): the median time of generate(new) minus the
    median time of generate(1), over batch * (new - 1) tokens."""
    input_ids = torch.tensor(prompts, device=device)
    hf_generate_s(hf_model, input_ids, min(new_tokens, 8), device)  # warm-up
    one = statistics.median(hf_generate_s(hf_model, input_ids, 1, device)[0] for _ in range(repeats))
    runs = [hf_generate_s(hf_model, input_ids, new_tokens, device) for _ in range(repeats)]
    full = statistics.median(s for s, _ in runs)
    if full <= one:  # possible only with very few new tokens on a noisy machine
        raise RuntimeError(f"generate({new_tokens}) took {full:.4f} s, not longer than generate(1) {one:.4f} s: "
                           "too few new tokens to time decode by difference")
    return {"tok_s": len(prompts) * (new_tokens - 1) / (full - one), "tokens": runs[-1][1]}


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy continuations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode_row(weights: str, batch: int, ours, hf_model, args, device, bandwidth: dict | None, report) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, ours.args.vocab_size, (batch, PROMPT_TOKENS), generator=gen).tolist()
    row = {"dtype": weights, "batch": batch, "new_tokens": args.new_tokens}
    row["bytes_per_step"] = bytes_per_decode_step(ours)
    if bandwidth:
        row["ceiling_tok_s"] = batch * bandwidth["read_gb_s"] * 1e9 / row["bytes_per_step"]
    try:
        result = ours_decode(ours, prompts, args.new_tokens, args.repeats, device)
        row["ours_tok_s"], row["ours_ttft_ms"], ours_tokens = result["tok_s"], result["ttft_ms"], result["tokens"]
    except Exception as exc:  # keep the row and the HF half
        report.error(f"ours {weights} batch {batch}", exc)
        ours_tokens = None
    try:
        result = hf_decode(hf_model, prompts, args.new_tokens, max(2, args.repeats - 1), device)
        row["hf_tok_s"] = result["tok_s"]
        if ours_tokens is not None:  # greedy tokens of row 0: the same kernels, another attention implementation
            row["same_leading_tokens"] = leading_agreement(ours_tokens, result["tokens"])
    except Exception as exc:
        report.error(f"hf {weights} batch {batch}", exc)
    if row.get("ours_tok_s") and row.get("hf_tok_s"):
        row["ours_over_hf"] = row["ours_tok_s"] / row["hf_tok_s"]
    if row.get("ours_tok_s") and row.get("ceiling_tok_s"):
        row["ours_over_ceiling"] = row["ours_tok_s"] / row["ceiling_tok_s"]
    return row


# ------------------------------------------------------------------------------------------ sections
def compact_checks(rows: list[dict]) -> list[dict]:
    """One line per (kernel, shape): the relative error of each activation dtype, and whether all passed."""
    lines: dict[tuple, dict] = {}
    for r in rows:
        line = lines.setdefault((r["kernel"], r["shape"]), {"kernel": r["kernel"], "shape": r["shape"], "ok": True})
        line[r["dtype"]] = r["max_rel_err"]
        line["ok"] = line["ok"] and bool(r["ok"])
    return list(lines.values())


def kernel_section(report: Report) -> None:
    from posttrain.quant import triton_check

    t0 = time.perf_counter()
    rows = triton_check.check_kernels_against_reference("cuda")
    report.data["kernel_checks"] = rows
    print(f"== Triton kernels vs float64, max |err| / max |ref| ({time.perf_counter() - t0:.0f} s): "
          f"{sum(r['ok'] for r in rows)}/{len(rows)} ok")
    print_table(compact_checks(rows), ["kernel", "shape", "float32", "float16", "bfloat16", "ok"],
                {d: ".1e" for d in ("float32", "float16", "bfloat16")})
    t0 = time.perf_counter()
    rows = triton_check.time_kernels("cuda")
    report.data["kernel_timings"] = rows
    print(f"== Triton kernel timings, decode shapes, L2 flushed ({time.perf_counter() - t0:.0f} s)")
    print_table(rows, ["kernel", "shape", "dtype", "us_per_call", "gb_per_s"],
                {"us_per_call": ".1f", "gb_per_s": ".0f"})
    report.save()


def decode_section(args, device: torch.device, bandwidth: dict | None, report: Report, time_left) -> None:
    from posttrain.quant.gpu_linear import build_triton_linears, replace_modules

    t0 = time.perf_counter()
    hf_model = build_hf_model(TINY if args.tiny else QWEN3_05B, device)
    ours = model_from_hf(hf_model)  # shares the HF model's tensors
    params = sum(p.numel() for p in hf_model.parameters())
    print(f"== model: random Qwen3, {params / 1e6:.1f}M parameters, bf16 on {device} "
          f"({time.perf_counter() - t0:.1f} s to build)")
    report.data["model"] = {"parameters": params, "config": TINY if args.tiny else QWEN3_05B}
    names = rtn_quantize_names(hf_model)
    originals = {"hf": {n: hf_model.get_submodule(n) for n in names}, "ours": {n: ours.get_submodule(n) for n in names}}
    built: dict[str, dict] = {}  # weights -> {name: TritonQuantLinear}, built once, kept for both batch sizes
    for batch in args.batches:
        for weights in args.weights:
            if time_left() < args.min_row_s:
                report.note(f"skipped {weights} batch {batch}: {time_left():.0f} s of the budget left")
                continue
            t_row = time.perf_counter()
            try:
                if WEIGHTS[weights] is not None:
                    if weights not in built:
                        built[weights] = build_triton_linears(hf_model, rtn_quantize(hf_model, *WEIGHTS[weights]),
                                                              device)
                    replace_modules(hf_model, built[weights])  # the same instances in both models
                    replace_modules(ours, built[weights])
                row = decode_row(weights, batch, ours, hf_model, args, device, bandwidth, report)
            except Exception as exc:
                report.error(f"{weights} batch {batch}", exc)
                row = None
            finally:  # back to the bf16 nn.Linear modules (their weights were never changed)
                replace_modules(hf_model, originals["hf"])
                replace_modules(ours, originals["ours"])
            if row is not None:
                row["seconds"] = time.perf_counter() - t_row
                report.data["rows"].append(row)
                print(f"   {weights} batch {batch}: ours {row.get('ours_tok_s') or 0:.1f} tok/s, "
                      f"HF {row.get('hf_tok_s') or 0:.1f} tok/s ({row['seconds']:.0f} s)")
                report.save()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny config, 8 new tokens (a CPU smoke test)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting new rows after this")
    parser.add_argument("--min-row-s", type=float, default=None, help="time a row needs (default 25 s, tiny 0)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny: 8)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--weights", default=None, help="comma list of bf16,int8,int4 (default all; CPU: bf16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="default $OUT/gpu_decode.json when OUT is set")
    args = parser.parse_args(argv)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 128)
    args.min_row_s = args.min_row_s if args.min_row_s is not None else (0.0 if args.tiny else 25.0)
    args.batches = [int(b) for b in args.batches.split(",")]
    cpu = torch.device(args.device).type == "cpu"
    args.weights = args.weights.split(",") if args.weights else (["bf16"] if cpu else list(WEIGHTS))
    if unknown := [w for w in args.weights if w not in WEIGHTS]:
        parser.error(f"unknown --weights {unknown}; expected some of {list(WEIGHTS)}")
    if cpu and args.weights != ["bf16"]:
        parser.error("on CPU only bf16 runs (the Triton kernels need a GPU or the interpreter)")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode speed is measured after the first token)")
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu_decode.json"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    time_left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    device = torch.device(args.device)
    report = Report(args.json)
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        import triton

        env["triton"] = triton.__version__
    report.data["environment"] = env
    print("== environment:", env)
    if device.type == "cuda":
        try:
            kernel_section(report)
        except Exception as exc:
            report.error("kernels", exc)
    bandwidth = None
    try:
        gib = 0.25 if args.tiny else 2.0
        bandwidth = measure_bandwidth(device, gib, repeats=5 if args.tiny else 10)
        report.data["bandwidth"] = bandwidth
        print(f"== bandwidth over a {bandwidth['tensor_gib']:.2f} GiB fp32 tensor: copy {bandwidth['copy_gb_s']:.0f} "
              f"GB/s (read + written), read {bandwidth['read_gb_s']:.0f} GB/s (sum); the ceiling uses the read figure")
    except Exception as exc:
        report.error("bandwidth", exc)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report.note("ours and HF run the same TritonQuantLinear module instances for int8/int4 (lm_head stays bf16); "
                "HF is transformers generate, eager, dynamic cache; ceiling excludes KV-cache reads")
    try:
        decode_section(args, device, bandwidth, report, time_left)
    except Exception as exc:
        report.error("decode", exc)
    print(f"== decode tokens/s, {args.new_tokens} new tokens after a {PROMPT_TOKENS}-token prompt "
          f"(tok/s = all rows together; {time.perf_counter() - start:.0f} s in all)")
    print_table(report.data["rows"], ["dtype", "batch", "ours_tok_s", "hf_tok_s", "ours_over_hf", "ceiling_tok_s",
                                      "ours_over_ceiling"],
                {"ours_tok_s": ".1f", "hf_tok_s": ".1f", "ours_over_hf": ".2f", "ceiling_tok_s": ".0f",
                 "ours_over_ceiling": ".3f"})
    report.save()
    if args.json is not None:
        print(f"wrote {args.json}")
    return 1 if report.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
