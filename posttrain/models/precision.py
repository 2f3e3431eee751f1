"""`bf16: auto` in a trainer block: which precision this machine trains in, decided from what its hardware has."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("posttrain")

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of CPUs with bf16 dot products


def cpu_flags() -> set[str]:
    """The first processor's flags in /proc/cpuinfo; empty where there is no such file (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def resolve_bf16_auto(kwargs: dict) -> None:
    """`bf16: auto` in a trainer block: bf16 autocast where the hardware has bf16 arithmetic (a CUDA GPU that
    supports it; a CPU with AVX-512 BF16 or AMX), float32 elsewhere. On a CPU without them torch emulates bf16, and
    autocast made small models up to 15x slower; on one with them an SFT step of SmolLM2-135M took about 9 s
    against 15.5 s in float32. TRL refuses bf16 off a GPU unless use_cpu is set, so a CPU that gets bf16 gets it."""
    import torch

    on_cpu = bool(kwargs.get("use_cpu")) or not torch.cuda.is_available()
    kwargs["bf16"] = _bf16_here(on_cpu)
    if on_cpu and kwargs["bf16"]:
        kwargs["use_cpu"] = True


@functools.cache  # the preflight check and the stage both build the trainer's config: decide and log it once
def _bf16_here(on_cpu: bool) -> bool:
    import torch

    bf16 = bool(BF16_CPU_FLAGS & cpu_flags()) if on_cpu else torch.cuda.is_bf16_supported()
    log.info("bf16: auto -> %s (%s)", bf16, "CPU" if on_cpu else "GPU")
    return bf16
