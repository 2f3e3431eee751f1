"""Triton weight-only matmul kernels for serving: W8A16 (int8 per output channel) and W4A16 (int4 group-wise).

    y[M, N] = x[M, K] @ w[N, K]^T, where w is the canonical `formats.QuantizedWeight` dequantized:
      int8: w = q * scale[:, None]               q int8 [N, K], scale fp32 [N]
      int4: w = (q - zero) * scale (per group)   codes packed by `pack_int4`, scale fp32 [N, K // G],
                                                 zero int8 [N, K // G] (asymmetric) or None (symmetric)

Each kernel dequantizes one weight tile at a time in registers; the dequantized matrix never exists in memory.
Two kernels per format, picked by M in the wrappers: a matrix-vector kernel for decode (one program per block
of output rows and per activation row, reducing over K) and a tiled `tl.dot` kernel for prefill.

int4 packing: `pack_int4` stores two codes per uint8 byte along K, packed[n, j] = low nibble k = 2j, high nibble
k = 2j + 1, each nibble the code's low 4 bits (two's complement for symmetric codes, so the kernel sign-extends
when there is no zero point). Kernels walk over byte columns and handle the even and odd K halves separately,
which keeps byte loads contiguous and needs no interleaving.

Precision: accumulation is fp32. For fp16/bf16 activations on a GPU, the dequantized tile is cast to the
activation dtype for `tl.dot` (tensor cores); fp32 activations use an IEEE fp32 dot. Under the Triton
interpreter (TRITON_INTERPRET=1, CPU tensors) every loaded value is cast to fp32 right after `tl.load` and the
dot runs in fp32, because the interpreter's bf16 arithmetic is wrong (NaN, huge dot errors).

Interpreter mode is fixed when `@triton.jit` runs, and that includes triton's own helpers in
`triton.language.standard` (`tl.zeros`, `tl.sum`, `tl.cdiv`, ...), which are jit functions defined when triton is
first imported. If triton was imported before TRITON_INTERPRET=1 was set, those helpers are compiled-mode and an
interpreted kernel that calls them fails ("Cannot call @triton.jit'd outside of the scope of a kernel"). The
kernels below therefore use builtins only: `tl.full` for zeros and `tl.reduce(..., _sum_combine)` for sums (what
`tl.sum` does for fp32; the interpreter recognises that combine function and sums with numpy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine
from triton.runtime.interpreter import InterpretedFunction

GEMV_MAX_M = 4  # M <= this goes to the matrix-vector kernel (decode); larger M to the tiled kernel (prefill)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------- packing
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Canonical int4 codes int8 [N, K] (in [-8, 7] or [0, 15]) -> uint8 [N, K // 2], two codes per byte."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int4: q must be int8 [N, K], got {q.dtype} {tuple(q.shape)}")
    if q.shape[1] % 2:
        raise ValueError(f"pack_int4: K = q.shape[1] = {q.shape[1]} must be even (two codes per byte)")
    if q.numel() and (q.min() < -8 or q.max() > 15):
        raise ValueError(f"pack_int4: codes must lie in [-8, 7] or [0, 15], got [{q.min()}, {q.max()}]")
    nibbles = q.to(torch.int16) & 0xF  # two's complement low 4 bits: -1 -> 15, 7 -> 7
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [N, K // 2] -> int8 [N, K]; signed=True for symmetric codes [-8, 7]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_int4: packed must be uint8 [N, K // 2], got {packed.dtype} {tuple(packed.shape)}")
    as_int = packed.to(torch.int16)
    codes = torch.stack([as_int & 0xF, as_int >> 4], dim=-1).flatten(1)  # [N, K // 2, 2] -> [N, K]
    if signed:
        codes = torch.where(codes >= 8, codes - 16, codes)
    return codes.to(torch.int8)


def interpreter_active() -> bool:
    """True when this module's kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return isinstance(_w8a16_gemv_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------------------------- kernels
# Strides are named s<tensor><dim>: sxm = x.stride(0), sqk = q.stride(1), spj = packed.stride(1) (byte columns),
# ssg = scale.stride(1) (groups). Offsets are int32, so every tensor must hold fewer than 2**31 elements.
@triton.jit
def _w8a16_gemv_kernel(x_ptr, q_ptr, scale_ptr, y_ptr, N, K, sxm, sxk, sqn, sqk, sym, syn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (pid_n, m): y[m, n-block] = sum_k x[m, k] * q[n, k], then * scale[n] (per-channel, so after the sum)
    pid_n, m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)  # reduced once at the end, not every step
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + m * sxm + offs_k * sxk, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
        q = tl.load(q_ptr + offs_n[:, None] * sqn + offs_k[None, :] * sqk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0).to(tl.float32)  # [BN, BK]
        acc += q * x[None, :]
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    y = tl.reduce(acc, 1, _sum_combine) * scale
    tl.store(y_ptr + m * sym + offs_n * syn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GEMM program (pid_m, pid_n)'s output tile: its row and column offsets, and which of them are in bounds."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _store_tile(y_ptr, tile, offs_m, offs_n, m_mask, n_mask, sym, syn):
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn, tile.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w8a16_gemm_kernel(x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, sxm, sxk, sqn, sqk, sym, syn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       LOW_PRECISION_DOT: tl.constexpr):
    offs_m, offs_n, m_mask, n_mask = _output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        q = tl.load(q_ptr + offs_n[None, :] * sqn + offs_k[:, None] * sqk,
                    mask=n_mask[None, :] & k_mask[:, None], other=0)  # [BK, BN]: the transposed weight tile
        if LOW_PRECISION_DOT:  # int8 codes are exact in fp16/bf16; the scale is applied after the loop
            acc = tl.dot(a, q.to(a.dtype), acc)
        else:
            acc = tl.dot(a.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * scale[None, :]
    _store_tile(y_ptr, y, offs_m, offs_n, m_mask, n_mask, sym, syn)


@triton.jit
def _dequant_int4_pair(p_ptr, s_ptr, z_ptr, n_idx, j_idx, mask, spn, spj, ssn, ssg, szn, szg,
                       GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr):
    """Byte column j of rows n (broadcast index tensors) -> fp32 weights (w[n, 2j], w[n, 2j + 1])."""
    byte = tl.load(p_ptr + n_idx * spn + j_idx * spj, mask=mask, other=0).to(tl.int32)
    lo, hi = byte & 0xF, (byte >> 4) & 0xF
    g_even, g_odd = (2 * j_idx) // GROUP_SIZE, (2 * j_idx + 1) // GROUP_SIZE
    s_even = tl.load(s_ptr + n_idx * ssn + g_even * ssg, mask=mask, other=0.0)
    if GROUP_SIZE % 2 == 0:  # both halves of a byte share a group
        s_odd = s_even
    else:
        s_odd = tl.load(s_ptr + n_idx * ssn + g_odd * ssg, mask=mask, other=0.0)
    if HAS_ZERO:
        lo -= tl.load(z_ptr + n_idx * szn + g_even * szg, mask=mask, other=0).to(tl.int32)
        hi -= tl.load(z_ptr + n_idx * szn + g_odd * szg, mask=mask, other=0).to(tl.int32)
    else:  # sign-extend the two's complement nibble: 8..15 -> -8..-1
        lo -= (lo & 8) << 1
        hi -= (hi & 8) << 1
    return lo.to(tl.float32) * s_even, hi.to(tl.float32) * s_odd


@triton.jit
def _w4a16_gemv_kernel(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, N, KP, sxm, sxk, spn, spj, ssn, ssg, szn, szg,
                       sym, syn, GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
    # KP = K // 2 byte columns; each step covers BLOCK_KP bytes = 2 * BLOCK_KP codes of K
    pid_n, m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.full([BLOCK_N, BLOCK_KP], 0.0, tl.float32)
    for j0 in range(0, KP, BLOCK_KP):
        offs_j = j0 + tl.arange(0, BLOCK_KP)
        j_mask = offs_j < KP
        x_row = x_ptr + m * sxm + 2 * offs_j * sxk
        x_even = tl.load(x_row, mask=j_mask, other=0.0).to(tl.float32)  # x[m, 2j]   [BKP]
        x_odd = tl.load(x_row + sxk, mask=j_mask, other=0.0).to(tl.float32)  # x[m, 2j+1] [BKP]
        w_even, w_odd = _dequant_int4_pair(p_ptr, s_ptr, z_ptr, offs_n[:, None], offs_j[None, :],
                                           n_mask[:, None] & j_mask[None, :], spn, spj, ssn, ssg, szn, szg,
                                           GROUP_SIZE, HAS_ZERO)  # [BN, BKP] each
        acc += w_even * x_even[None, :] + w_odd * x_odd[None, :]
    y = tl.reduce(acc, 1, _sum_combine)
    tl.store(y_ptr + m * sym + offs_n * syn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, M, N, KP, sxm, sxk, spn, spj, ssn, ssg, szn, szg,
                       sym, syn, GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr):
    # x @ w^T = x[:, even k] @ w[:, even k]^T + x[:, odd k] @ w[:, odd k]^T: two dots of depth BLOCK_KP per step
    offs_m, offs_n, m_mask, n_mask = _output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for j0 in range(0, KP, BLOCK_KP):
        offs_j = j0 + tl.arange(0, BLOCK_KP)
        j_mask = offs_j < KP
        a_ptrs = x_ptr + offs_m[:, None] * sxm + 2 * offs_j[None, :] * sxk
        a_mask = m_mask[:, None] & j_mask[None, :]
        a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)  # [BM, BKP]
        a_odd = tl.load(a_ptrs + sxk, mask=a_mask, other=0.0)
        w_even, w_odd = _dequant_int4_pair(p_ptr, s_ptr, z_ptr, offs_n[None, :], offs_j[:, None],
                                           n_mask[None, :] & j_mask[:, None], spn, spj, ssn, ssg, szn, szg,
                                           GROUP_SIZE, HAS_ZERO)  # [BKP, BN] each: transposed tiles
        if LOW_PRECISION_DOT:
            acc = tl.dot(a_even, w_even.to(a_even.dtype), acc)
            acc = tl.dot(a_odd, w_odd.to(a_odd.dtype), acc)
        else:
            acc = tl.dot(a_even.to(tl.float32), w_even, acc, input_precision="ieee")
            acc = tl.dot(a_odd.to(tl.float32), w_odd, acc, input_precision="ieee")
    _store_tile(y_ptr, acc, offs_m, offs_n, m_mask, n_mask, sym, syn)


# ----------------------------------------------------------------------------------------------- wrappers
def _check_inputs(x: torch.Tensor, named: dict[str, tuple[torch.Tensor | None, torch.dtype, tuple]], K: int):
    """Validate dtypes, shapes and devices; named maps name -> (tensor, expected dtype, expected shape)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must have shape [..., K={K}] to match the weight, got {tuple(x.shape)}")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; the kernels' int32 offsets allow < 2**31")
    for name, (tensor, dtype, shape) in named.items():
        if tensor is None and name == "zero":  # symmetric int4 has no zero point
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a {dtype} tensor {shape}, got {type(tensor).__name__}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        if tensor.numel() >= 2**31:
            raise ValueError(f"{name} has {tensor.numel()} elements; the kernels' int32 offsets allow < 2**31")
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}: put all tensors on one device")
    if x.device.type == "cpu" and not interpreter_active():
        raise ValueError("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before this module is "
                         "imported (triton.jit reads it when the kernels are defined), or use CUDA tensors")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x is on {x.device}; the kernels run on CUDA (or on CPU under TRITON_INTERPRET=1)")


def _pick_kernel(kernel: str, M: int) -> str:
    if kernel not in ("auto", "gemv", "gemm"):
        raise ValueError(f"kernel must be 'auto', 'gemv' or 'gemm', got {kernel!r}")
    return ("gemv" if M <= GEMV_MAX_M else "gemm") if kernel == "auto" else kernel


def _launch_config(fmt: str, kernel: str, M: int, interpreted: bool) -> dict:
    """Tile sizes and launch options. int4 K tiles count bytes (BLOCK_KP, two codes each).

    Interpreter: few, large tiles, since its cost is per operation and per program, not per element.
    GPU: untuned starting points for Hopper; gemv uses thin row blocks so that ~N/8 programs stream the weights,
    gemm tiles are at least 16 wide because tl.dot needs that, and BLOCK_M follows M to waste less padding."""
    k_name = "BLOCK_K" if fmt == "int8" else "BLOCK_KP"
    if interpreted:
        if kernel == "gemv":
            return {"BLOCK_N": 64, k_name: 128 if fmt == "int8" else 64}
        return {"BLOCK_M": min(32, triton.next_power_of_2(M)), "BLOCK_N": 64, k_name: 128 if fmt == "int8" else 64}
    # fp fusion (FMA) pinned on: triton 3.9 warns that its default turns off in 3.10
    launch = {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": True}
    if kernel == "gemv":
        return {"BLOCK_N": 8, k_name: 256 if fmt == "int8" else 128, **launch}
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    return {"BLOCK_M": block_m, "BLOCK_N": 128, k_name: 64 if fmt == "int8" else 32, **launch}


def _grid(kernel: str, M: int, N: int, config: dict) -> tuple[int, int]:
    if kernel == "gemv":  # one program per block of output rows and per activation row
        return (triton.cdiv(N, config["BLOCK_N"]), M)
    return (triton.cdiv(M, config["BLOCK_M"]), triton.cdiv(N, config["BLOCK_N"]))


def w8a16_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ (q int8 [N, K] * scale fp32 [N, 1])^T -> [..., N] in x's dtype."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError(f"q must be an int8 tensor [N, K], got {getattr(q, 'shape', type(q))}")
    N, K = q.shape
    _check_inputs(x, {"q": (q, torch.int8, (N, K)), "scale": (scale, torch.float32, (N,))}, K)
    x2 = x.reshape(-1, K)  # [M, K]
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    interpreted, kernel = interpreter_active(), _pick_kernel(kernel, M)
    config = _launch_config("int8", kernel, M, interpreted)
    scale = scale.contiguous()  # the kernels index it as scale[n]
    common = (x2.stride(0), x2.stride(1), q.stride(0), q.stride(1), y.stride(0), y.stride(1))
    if kernel == "gemv":
        _w8a16_gemv_kernel[_grid(kernel, M, N, config)](x2, q, scale, y, N, K, *common, **config)
    else:
        low_precision_dot = x.dtype != torch.float32 and not interpreted
        _w8a16_gemm_kernel[_grid(kernel, M, N, config)](x2, q, scale, y, M, N, K, *common,
                                                        LOW_PRECISION_DOT=low_precision_dot, **config)
    return y.reshape(*x.shape[:-1], N)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group_size: int, kernel: str = "auto") -> torch.Tensor:
    """x [..., K] @ dequant(packed uint8 [N, K//2], scale fp32 [N, K//G], zero int8 [N, K//G] or None)^T."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2:
        raise ValueError(f"packed must be a uint8 tensor [N, K // 2] from pack_int4, got "
                         f"{getattr(packed, 'shape', type(packed))}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing K={K}")
    n_groups = K // group_size
    _check_inputs(x, {"packed": (packed, torch.uint8, (N, K // 2)), "scale": (scale, torch.float32, (N, n_groups)),
                      "zero": (zero, torch.int8, (N, n_groups))}, K)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    interpreted, kernel = interpreter_active(), _pick_kernel(kernel, M)
    config = {"GROUP_SIZE": group_size, "HAS_ZERO": zero is not None,
              **_launch_config("int4", kernel, M, interpreted)}
    zero_arg = zero if zero is not None else scale  # a placeholder pointer, never read when HAS_ZERO is False
    common = (x2.stride(0), x2.stride(1), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
              zero_arg.stride(0), zero_arg.stride(1), y.stride(0), y.stride(1))
    grid = _grid(kernel, M, N, config)
    if kernel == "gemv":
        _w4a16_gemv_kernel[grid](x2, packed, scale, zero_arg, y, N, K // 2, *common, **config)
    else:
        low_precision_dot = x.dtype != torch.float32 and not interpreted
        _w4a16_gemm_kernel[grid](x2, packed, scale, zero_arg, y, M, N, K // 2, *common,
                                 LOW_PRECISION_DOT=low_precision_dot, **config)
    return y.reshape(*x.shape[:-1], N)
