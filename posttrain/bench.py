"""Timing helpers the benchmarks in scripts/ share: a device-synchronised median time, and the copy and read
bandwidth of the device's memory (the ceiling decode speed is measured against)."""

from __future__ import annotations

import statistics
import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op_s(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call: CUDA events on a GPU, perf_counter on a CPU."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, gib: float, repeats: int) -> dict:
    """Copy bandwidth (bytes read + written) of a large copy, and read-only bandwidth of a sum over fp32 values."""
    numel = int(gib * 2**30) // 4
    src = torch.rand(numel, device=device)  # fp32, `gib` GiB
    dst = torch.empty_like(src)
    copy_s = time_op_s(lambda: dst.copy_(src), device, repeats)
    del dst
    read_s = time_op_s(lambda: src.sum(), device, repeats)
    nbytes = numel * 4
    result = {"tensor_gib": nbytes / 2**30, "copy_gb_s": 2 * nbytes / copy_s / 1e9, "read_gb_s": nbytes / read_s / 1e9,
              "copy_ms": copy_s * 1e3, "read_ms": read_s * 1e3}
    del src
    return result
