"""Own AVX2 weight-streaming matmul kernels for CPU decode (csrc/*.cpp): build, packing and calls.

Batch-1 decode reads every weight once per token, so its speed is bytes-of-weights / read bandwidth. torch's fp32 and
bf16 matrix-vector products and the packed aten int8/int4 kernels stay well below that ceiling on this AVX2 CPU;
these kernels widen weights to fp32 in registers and stream them (see the C++ files for the layouts).

The extension is compiled on first use, not at import: `available()` builds it (~20 s, then cached in the
torch_extensions directory under a name keyed by the sources, flags and this CPU's feature set) and returns False,
logging the reason once, when there is no compiler or the CPU lacks AVX2/FMA/F16C. Callers then use the aten/torch
paths in `linear.py`.

Ops (registered as torch.ops.posttrain_quant.*, with fake kernels so torch.compile can trace them); the weights come
from the pack_* functions below, which lay 4 output rows at a time out chunk by chunk (one sequential stream):
  gemv_fp32(x[..., K], codes fp32, out_features, bias fp32[N]?) -> y[..., N]
  gemv_bf16(x, codes bf16, out_features, bias?)
  gemv_int8(x, codes int8, scale fp32[N_padded], out_features, bias?)
  gemv_int4(x, codes uint8, scale_offset fp32[N_padded, K/g, 2], group_size, out_features, bias?)
  gemv_fp8(x, codes uint8 (e4m3 bits), scale fp32[N_padded], out_features, bias?)
  gemv_int4_q8(x, codes uint8, scale_offset, group_size, out_features, bias?): activations rounded to int8 per 32
    columns, integer multiply-adds (csrc/gemv_int4_q8.cpp); 1.3-2x the int4 throughput at ~0.5 % output error
x is fp32, bf16 or fp16 and y has its dtype; K must be a multiple of CHUNK.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading

import torch

log = logging.getLogger(__name__)

CHUNK = 16  # columns the kernels decode per step; K must be a multiple of it
ROWS_PER_TILE = 4  # output rows whose chunks are interleaved in memory (see csrc/gemv_avx2.cpp)
Q8_BLOCK = 32  # gemv_int4_q8: columns per activation scale; its K must be a multiple of 64
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_CSRC, "gemv_avx2.cpp"), os.path.join(_CSRC, "gemv_int4_q8.cpp")]
_HEADERS = [os.path.join(_CSRC, "gemv_common.h")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str once a load was attempted


def _cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (Linux x86); empty elsewhere."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _extension_name(flags: set[str]) -> str:
    """A name per (sources and header contents, compiler flags, CPU features).

    torch re-builds when a listed source changes but does not look at headers, and -march=native binds the binary to
    this CPU: a torch_extensions cache shared with another CPU or an older checkout must not be reused.
    """
    digest = hashlib.sha1(" ".join(sorted(flags) + _CFLAGS).encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"posttrain_quant_gemv_{digest.hexdigest()[:12]}"


def _build() -> tuple[bool, str]:
    flags = _cpu_flags()
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in flags]
    if missing:
        return False, f"CPU lacks {missing} (or is not Linux x86-64)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return False, "no C++ compiler on PATH (set CXX)"
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=_extension_name(flags),
            sources=_SOURCES,
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],  # libgomp.so.1: the loader reuses the copy torch already loaded
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a compiler/ninja failure must not take inference down: fall back instead
        return False, f"build failed: {type(exc).__name__}: {str(exc)[-500:]}"
    _register_fakes()
    return True, "ok"


def available() -> bool:
    """Build/load the extension once per process; False (logged once) when it cannot be used here."""
    with _lock:
        if "ok" not in _state:
            ok, reason = _build()
            _state.update(ok=ok, reason=reason)
            if not ok:
                log.warning("posttrain.quant own CPU kernels unavailable, using aten/torch paths: %s", reason)
        return bool(_state["ok"])


def unavailable_reason() -> str:
    """Why `available()` is False ("ok" when it is True)."""
    available()
    return str(_state["reason"])


def _register_fakes() -> None:
    """Shape-only kernels so torch.compile / meta tracing can see through the ops."""

    def out_like(x, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    torch.library.register_fake("posttrain_quant::gemv_fp32")(lambda x, codes, n, bias: out_like(x, n))
    torch.library.register_fake("posttrain_quant::gemv_bf16")(lambda x, codes, n, bias: out_like(x, n))
    torch.library.register_fake("posttrain_quant::gemv_int8")(lambda x, codes, scale, n, bias: out_like(x, n))
    torch.library.register_fake("posttrain_quant::gemv_fp8")(lambda x, codes, scale, n, bias: out_like(x, n))
    torch.library.register_fake("posttrain_quant::gemv_int4")(lambda x, codes, so, g, n, bias: out_like(x, n))
    torch.library.register_fake("posttrain_quant::gemv_int4_q8")(lambda x, codes, so, g, n, bias: out_like(x, n))


# ---------------------------------------------------------------------------------------------------------------
# Packing: canonical QuantizedWeight fields -> the kernels' tiled layouts (pure functions, no extension needed)
# ---------------------------------------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Append zero rows so that dim 0 is a multiple of ROWS_PER_TILE (padding rows are computed, never stored)."""
    pad = -t.shape[0] % ROWS_PER_TILE
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


def _tile(chunks: torch.Tensor) -> torch.Tensor:
    """[N, K / 16, B] per-row chunks -> [N_padded / 4, K / 16, 4, B]: the 4 rows of a tile interleaved by chunk."""
    chunks = _pad_rows(chunks)
    n_pad, n_chunks, chunk_len = chunks.shape
    tiles = chunks.reshape(n_pad // ROWS_PER_TILE, ROWS_PER_TILE, n_chunks, chunk_len)
    return tiles.permute(0, 2, 1, 3).contiguous()


def _check_k(k_in: int, what: str) -> None:
    if k_in % CHUNK:
        raise ValueError(f"{what} has K = {k_in} columns: the own kernels need a multiple of {CHUNK}")


def pack_dense(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float weight [N, K] -> codes of `dtype` (fp32 or bf16) [N_padded / 4, K / 16, 4, 16]."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dense own kernels store fp32 or bf16 weights, got {dtype}")
    _check_k(w.shape[1], f"{dtype} weight")
    return _tile(w.detach().to(dtype).reshape(w.shape[0], -1, CHUNK))


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K], scale [N] -> (codes int8 [N_padded / 4, K / 16, 4, 16], scale fp32 [N_padded])."""
    _check_k(q.shape[1], "int8 qweight")
    return _tile(q.reshape(q.shape[0], -1, CHUNK)), _pad_rows(scale.float()).contiguous()


def pack_fp8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn [N, K], scale [N] -> (raw bytes uint8 [N_padded / 4, K / 16, 4, 16], scale fp32 [N_padded])."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 qweight must be torch.float8_e4m3fn, got {q.dtype}")
    _check_k(q.shape[1], "fp8 qweight")
    bits = q.contiguous().view(torch.uint8)  # 0x00 pads to +0.0
    return _tile(bits.reshape(q.shape[0], -1, CHUNK)), _pad_rows(scale.float()).contiguous()


def _int4_unsigned(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int, multiple: int):
    """Canonical int4 -> (u uint8 [N, K] in [0, 15], scale_offset fp32 [N_padded, K / g, 2]); w = u * scale + offset.

    Unsigned codes u are q + 8 (symmetric, q in [-8, 7]) or q (asymmetric, q in [0, 15] with zero [N, K/g]), and
    offset = -8 * scale or -zero * scale, so both decode alike. Padding rows get scale 0 and offset 0.
    """
    n_out, k_in = q.shape
    if group_size % multiple or k_in % group_size:
        raise ValueError(f"int4 q has K = {k_in}: need group_size ({group_size}) a multiple of {multiple} dividing it")
    if scale.shape != (n_out, k_in // group_size):
        raise ValueError(f"int4 scale has shape {tuple(scale.shape)}, expected {(n_out, k_in // group_size)}")
    u = (q.to(torch.int16) + (8 if zero is None else 0)).to(torch.uint8)
    if int(u.max()) > 15:
        raise ValueError("int4 codes out of range: expected [-8, 7] (symmetric) or [0, 15] (asymmetric)")
    scale = scale.float()
    zero_f = torch.full_like(scale, 8.0) if zero is None else zero.float()
    return u, _pad_rows(torch.stack([scale, -zero_f * scale], dim=-1)).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int):
    """Canonical int4 -> (codes uint8 [N_padded / 4, K / 16, 4, 8], scale_offset fp32 [N_padded, K / g, 2]) for
    gemv_int4 (fp32 activations). Within each run of 16 columns, byte j holds u[j] (low nibble) and u[j + 8] (high).
    """
    u, scale_offset = _int4_unsigned(q, scale, zero, group_size, CHUNK)
    runs = u.reshape(u.shape[0], -1, 2, CHUNK // 2)  # [N, runs of 16, low/high half, 8]
    return _tile(runs[:, :, 0, :] | (runs[:, :, 1, :] << 4)), scale_offset


def pack_int4_q8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int):
    """Canonical int4 -> (codes uint8 [N_padded / 4, K / 64, 4, 32], scale_offset fp32 [N_padded, K / g, 2]) for
    gemv_int4_q8 (int8 activations). Within each run of 64 columns, byte i holds u[i] (low nibble) and u[i + 32]."""
    u, scale_offset = _int4_unsigned(q, scale, zero, group_size, Q8_BLOCK)
    if u.shape[1] % (2 * Q8_BLOCK):
        raise ValueError(f"int4 q has K = {u.shape[1]}: gemv_int4_q8 needs a multiple of {2 * Q8_BLOCK}")
    runs = u.reshape(u.shape[0], -1, 2, Q8_BLOCK)  # [N, runs of 64, low/high half, 32]
    return _tile(runs[:, :, 0, :] | (runs[:, :, 1, :] << 4)), scale_offset


# ---------------------------------------------------------------------------------------------------------------
# Calls (x [..., K] fp32/bf16/fp16; call available() first). The .default overloads skip overload resolution.
# ---------------------------------------------------------------------------------------------------------------


def gemv_dense(x: torch.Tensor, codes: torch.Tensor, out_features: int, bias: torch.Tensor | None = None):
    """fp32 or bf16 codes from pack_dense (the op follows the codes' dtype)."""
    if codes.dtype == torch.float32:
        return torch.ops.posttrain_quant.gemv_fp32.default(x, codes, out_features, bias)
    return torch.ops.posttrain_quant.gemv_bf16.default(x, codes, out_features, bias)


def gemv_int8(x, codes, scale, out_features: int, bias=None) -> torch.Tensor:
    return torch.ops.posttrain_quant.gemv_int8.default(x, codes, scale, out_features, bias)


def gemv_int4(x, codes, scale_offset, group_size: int, out_features: int, bias=None) -> torch.Tensor:
    return torch.ops.posttrain_quant.gemv_int4.default(x, codes, scale_offset, group_size, out_features, bias)


def gemv_int4_q8(x, codes, scale_offset, group_size: int, out_features: int, bias=None) -> torch.Tensor:
    """int4 weights from pack_int4_q8 times activations rounded to int8 per 32 columns (~0.5 % output error)."""
    return torch.ops.posttrain_quant.gemv_int4_q8.default(x, codes, scale_offset, group_size, out_features, bias)


def gemv_fp8(x, codes, scale, out_features: int, bias=None) -> torch.Tensor:
    return torch.ops.posttrain_quant.gemv_fp8.default(x, codes, scale, out_features, bias)
