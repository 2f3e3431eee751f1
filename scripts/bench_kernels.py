"""Weight-read bandwidth of CPU matmul paths at decode shapes of a ~0.5B Qwen3 (hidden 1024), against the ceiling.

Prints tables of GB/s of weight bytes read (codes + scales, as stored by each path) for x [M, K] @ W[N, K]^T, plus the
read-bandwidth ceiling measured in the same run. Asserts nothing. Each call reads its weights from DRAM: a layer's
weights are cycled through enough copies (>= 256 MiB) that the 32 MiB L3 cannot serve them, as in a real decode.
Figures are best-of-N, with paths taking turns: the machine is shared, and a descheduled OpenMP thread stalls a
whole call. The per-token median is printed beside the best.

    .venv/bin/python scripts/bench_kernels.py [--threads 2] [--no-m16] [--rounds 7]

The "per token" column is the time-weighted total for one decode step of a 24-layer model (q, k, v, o, gate, up,
down per layer plus the LM head), i.e. the figure to compare with (read bandwidth / weight bytes per token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from posttrain.quant import cpu_kernels

HIDDEN, Q_DIM, KV_DIM, MLP, VOCAB, LAYERS = 1024, 2048, 1024, 3072, 151936, 24
GROUP = 128
SHAPES = [(Q_DIM, HIDDEN), (HIDDEN, Q_DIM), (MLP, HIDDEN), (HIDDEN, MLP), (KV_DIM, HIDDEN), (VOCAB, HIDDEN)]
# how many times each [N, K] shape occurs in one decode step
PER_TOKEN = {(Q_DIM, HIDDEN): LAYERS, (HIDDEN, Q_DIM): LAYERS, (MLP, HIDDEN): 2 * LAYERS, (HIDDEN, MLP): LAYERS,
             (KV_DIM, HIDDEN): 2 * LAYERS, (VOCAB, HIDDEN): 1}
MIN_BYTES_IN_FLIGHT = 256 << 20


def best_seconds(fn, repeats: int) -> float:
    """Best wall time of fn over `repeats` runs after a warm-up (first touch of pages, thread start)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_ceiling(repeats: int, own: bool) -> dict[str, float]:
    """GB/s of read-only streams over 1 GiB: a sum, torch's fp32 matrix-vector product, and the own fp32 one."""
    big = torch.randn(1 << 28)  # 1 GiB fp32
    x = torch.randn(1, HIDDEN)
    w = big.view(-1, HIDDEN)
    gbs = {
        "sum 1 GiB": big.numel() * 4 / best_seconds(lambda: big.sum(), repeats) / 1e9,
        "fp32 matvec 1 GiB": w.numel() * 4 / best_seconds(lambda: F.linear(x, w), repeats) / 1e9,
    }
    if own:
        del w
        codes = cpu_kernels.pack_dense(big.view(-1, HIDDEN), torch.float32)
        del big
        n_rows = codes.shape[0] * cpu_kernels.ROWS_PER_TILE
        seconds = best_seconds(lambda: cpu_kernels.gemv_dense(x, codes, n_rows), repeats)
        gbs["own fp32 matvec 1 GiB"] = codes.numel() * 4 / seconds / 1e9
    return gbs


# ---- paths: build(n, k) -> tensors holding one weight copy; call(x, tensors, n) -> y; x dtype ----


def _int8_codes(n, k):
    return torch.randint(-127, 128, (n, k), dtype=torch.int8)


def _aten_int4(n, k):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    return packed, torch.rand(k // GROUP, n, 2).to(torch.bfloat16)


def _own_int4(n, k):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    return cpu_kernels.pack_int4(q, torch.rand(n, k // GROUP), None, GROUP)


def _own_int4_q8(n, k):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    return cpu_kernels.pack_int4_q8(q, torch.rand(n, k // GROUP), None, GROUP)


def _own_fp8(n, k):
    return cpu_kernels.pack_fp8((torch.randn(n, k) * 40).to(torch.float8_e4m3fn), torch.rand(n))


PATHS = {
    "fp32 F.linear": (torch.float32, lambda n, k: (torch.randn(n, k),), lambda x, t, n: F.linear(x, t[0])),
    "bf16 F.linear": (torch.bfloat16, lambda n, k: (torch.randn(n, k).bfloat16(),), lambda x, t, n: F.linear(x, t[0])),
    "int8 aten (bf16 x)": (torch.bfloat16, lambda n, k: (_int8_codes(n, k), torch.rand(n).bfloat16()),
                           lambda x, t, n: torch.ops.aten._weight_int8pack_mm(x, t[0], t[1])),
    f"int4 aten g{GROUP} (bf16 x)": (torch.bfloat16, _aten_int4,
                                     lambda x, t, n: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t[0], GROUP, t[1])),
    "fp32 own": (torch.float32, lambda n, k: (cpu_kernels.pack_dense(torch.randn(n, k), torch.float32),),
                 lambda x, t, n: cpu_kernels.gemv_dense(x, t[0], n)),
    "bf16 own": (torch.float32, lambda n, k: (cpu_kernels.pack_dense(torch.randn(n, k), torch.bfloat16),),
                 lambda x, t, n: cpu_kernels.gemv_dense(x, t[0], n)),
    "int8 own": (torch.float32, lambda n, k: cpu_kernels.pack_int8(_int8_codes(n, k), torch.rand(n)),
                 lambda x, t, n: cpu_kernels.gemv_int8(x, t[0], t[1], n)),
    f"int4 own g{GROUP}": (torch.float32, _own_int4, lambda x, t, n: cpu_kernels.gemv_int4(x, t[0], t[1], GROUP, n)),
    f"int4 own-q8 g{GROUP}": (torch.float32, _own_int4_q8,
                              lambda x, t, n: cpu_kernels.gemv_int4_q8(x, t[0], t[1], GROUP, n)),
    "fp8 own": (torch.float32, _own_fp8, lambda x, t, n: cpu_kernels.gemv_fp8(x, t[0], t[1], n)),
}
TARGETS = {"fp32": 0.8, "bf16": 0.7, "int8": 0.6, "int4": 0.5, "fp8": None}  # fraction of the read ceiling


def measure_shape(names: list[str], n: int, k: int, m: int, rounds: int) -> dict[str, tuple[float, float, int]]:
    """{path: (best, median seconds per call, weight bytes per call)} for one [N, K] weight shape.

    Each path cycles over copies of its weight that together exceed the L3 cache. Paths take turns, one pass each
    per round, so that a burst of load from other processes hits all paths alike rather than one.
    """
    # x [16, K] is compute-bound, where the cache hardly matters: fewer copies keep the run short.
    in_flight = MIN_BYTES_IN_FLIGHT if m == 1 else MIN_BYTES_IN_FLIGHT // 4
    passes = {}
    for name in names:
        x_dtype, build, call = PATHS[name]
        first = build(n, k)
        nbytes = sum(t.numel() * t.element_size() for t in first)
        copies = [first] + [tuple(t.clone() for t in first) for _ in range(-(-in_flight // nbytes) - 1)]
        x = torch.randn(m, k).to(x_dtype)
        passes[name] = (lambda call=call, x=x, copies=copies: [call(x, t, n) for t in copies], len(copies), nbytes)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds + 1):  # round 0 warms up (first touch of pages, thread pool start)
        for name, (one_pass, n_copies, _) in passes.items():
            t0 = time.perf_counter()
            one_pass()
            times[name].append((time.perf_counter() - t0) / n_copies)
    return {name: (min(ts[1:]), statistics.median(ts[1:]), passes[name][2]) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-m16", action="store_true", help="skip the x [16, K] table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    own = cpu_kernels.available()
    if not own:
        print(f"own kernels unavailable: {cpu_kernels.unavailable_reason()}")
    names = [name for name in PATHS if own or not name.split()[1].startswith("own")]
    ceilings = read_ceiling(args.rounds, own)

    tables = {}
    with torch.inference_mode():
        for m in (1,) if args.no_m16 else (1, 16):
            tables[m] = {shape: measure_shape(names, *shape, m, args.rounds) for shape in SHAPES}
    for key, value in read_ceiling(args.rounds, own).items():  # again at the end: keep the better of the two
        ceilings[key] = max(ceilings[key], value)
    ceiling = max(ceilings.values())
    print("read ceiling: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in ceilings.items()) + f" -> {ceiling:.1f}")

    for m, by_shape in tables.items():
        header = "".join(f"{f'{n}x{k}':>13}" for n, k in SHAPES)
        print(f"\nx [{m}, K]: GB/s of weight bytes read, best of {args.rounds} (per token: best and median)")
        print(f"{'path':<24}{header}{'per token':>11}{'median':>8}{'fraction':>10}{'target':>8}")
        for name in names:
            results = {shape: by_shape[shape][name] for shape in SHAPES}
            row = "".join(f"{nbytes / best / 1e9:13.1f}" for best, _, nbytes in results.values())
            token_bytes = sum(PER_TOKEN[s] * results[s][2] for s in SHAPES)
            token_best = sum(PER_TOKEN[s] * results[s][0] for s in SHAPES)
            token_median = sum(PER_TOKEN[s] * results[s][1] for s in SHAPES)
            gbs = token_bytes / token_best / 1e9
            target = TARGETS[name.split()[0]]
            print(f"{name:<24}{row}{gbs:11.1f}{token_bytes / token_median / 1e9:8.1f}{gbs / ceiling:10.2f}"
                  f"{'-' if target is None else target:>8}   ({token_best * 1e3:.1f} ms/token)")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (other processes on these 2 cores distort the figures)")


if __name__ == "__main__":
    main()
