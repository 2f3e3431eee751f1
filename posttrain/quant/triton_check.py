"""The Triton kernels (posttrain.quant.triton_kernels) against a float64 reference, and their timings: what
`scripts/gpu_decode.py` runs on a GPU, and what the tests run on CPU under the Triton interpreter."""

from __future__ import annotations

import time
from functools import partial

import torch

from posttrain.quant import triton_kernels


_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max err / max |reference|


def _random_weights(kind: str, N: int, K: int, group_size: int, device: str, gen: torch.Generator, kernels):
    """Random canonical weights with LLM-like magnitudes (|w| ~ 0.02) and their float64 dequantization."""
    def rand(*shape):
        return torch.rand(*shape, generator=gen).to(device)

    if kind == "w8a16":
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen).to(device)
        scale = (0.02 / 64 * (0.5 + rand(N))).float()
        return (q, scale), q.double() * scale.double()[:, None]
    symmetric = kind == "w4a16_sym"
    low, high = (-8, 8) if symmetric else (0, 16)
    q = torch.randint(low, high, (N, K), dtype=torch.int8, generator=gen).to(device)
    scale = (0.02 / 4 * (0.5 + rand(N, K // group_size))).float()
    zero = None if symmetric else torch.randint(5, 11, (N, K // group_size), dtype=torch.int8, generator=gen).to(device)
    zero_f64 = 0.0 if zero is None else zero.double().repeat_interleave(group_size, dim=1)
    w64 = (q.double() - zero_f64) * scale.double().repeat_interleave(group_size, dim=1)
    return (kernels.pack_int4(q), scale, zero, group_size), w64


def _run_kind(kind: str, x: torch.Tensor, args: tuple, kernels) -> torch.Tensor:
    return kernels.w8a16_matmul(x, *args) if kind == "w8a16" else kernels.w4a16_matmul(x, *args)


def _default_shapes(device: str) -> list[tuple[int, int, int]]:
    if device == "cpu":  # interpreter: tiny, one decode and one prefill shape
        return [(1, 20, 64), (17, 20, 64)]
    return [(1, 4096, 4096), (64, 4096, 4096), (17, 1000, 4224)]


def check_kernels_against_reference(device: str = "cuda", shapes=None, dtypes=None, group_size: int | None = None,
                                    seed: int = 0, kernels=triton_kernels) -> list[dict]:
    """Compare every kernel with a float64 reference; rows: kernel, shape (M, N, K), dtype, errors, ok.

    max_rel_err is max |y - ref| / max |ref| (elementwise ratios blow up where ref is near zero). `kernels`: the
    module whose kernels run (tests pass a copy loaded in interpreter mode)."""
    shapes = shapes or _default_shapes(device)
    dtypes = dtypes or [torch.float32, torch.float16, torch.bfloat16]
    group_size = group_size or (32 if device == "cpu" else 128)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for M, N, K in shapes:
        for kind in ("w8a16", "w4a16_sym", "w4a16_asym"):
            args, w64 = _random_weights(kind, N, K, group_size, device, gen, kernels)
            for dtype in dtypes:
                x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
                ref = x.double() @ w64.T
                err = (_run_kind(kind, x, args, kernels).double() - ref).abs().max().item()
                rel = err / max(ref.abs().max().item(), 1e-30)
                rows.append({"kernel": kind, "shape": (M, N, K), "dtype": str(dtype).removeprefix("torch."),
                             "max_abs_err": err, "max_rel_err": rel, "ok": rel <= _TOLERANCE[dtype]})
    return rows


def _time_us(fn, device: str) -> float:
    if device == "cpu":  # interpreter: one call is slow enough to time directly
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    # do_bench clears the L2 cache before every call, so the weights are read from HBM (not from the 50 MB L2)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # ms -> us


def time_kernels(device: str = "cuda", shapes=None, dtype: torch.dtype = torch.bfloat16, group_size: int = 128,
                 seed: int = 0, kernels=triton_kernels) -> list[dict]:
    """Decode timings: microseconds per call and GB/s of weight bytes (codes + scales + zeros) read per call.

    On CUDA a dense torch matmul of the same shape in `dtype` is timed too ('torch_dense'), as a reference point.
    On CPU (interpreter) it times one tiny fp32 call, only so that tests can run this code path."""
    if device == "cpu":
        shapes, dtype, group_size = shapes or [(1, 16, 64)], torch.float32, min(group_size, 32)
    shapes = shapes or [(1, 4096, 4096), (1, 4096, 14336), (1, 14336, 4096)]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for M, N, K in shapes:
        x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
        for kind in ("w8a16", "w4a16_sym", "w4a16_asym"):
            args, w64 = _random_weights(kind, N, K, group_size, device, gen, kernels)
            weight_bytes = sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
            candidates = [(kind, partial(_run_kind, kind, x, args, kernels), weight_bytes)]
            if device != "cpu" and kind == "w8a16":
                dense_t = w64.to(dtype).T  # [K, N] view of the dense weight
                dense_bytes = dense_t.numel() * dense_t.element_size()
                candidates.append(("torch_dense", partial(torch.matmul, x, dense_t), dense_bytes))
            for name, fn, nbytes in candidates:
                us = _time_us(fn, device)
                rows.append({"kernel": name, "shape": (M, N, K), "dtype": str(dtype).removeprefix("torch."),
                             "us_per_call": us, "weight_bytes": nbytes, "gb_per_s": nbytes / us / 1e3})
    return rows
