"""Drop-in replacements for nn.Linear that multiply by a quantized weight without materialising it (CPU decode).

`QuantLinear.from_quantized(qw, bias, act_dtype)` picks a backend once, at construction:
- "own": the AVX2 kernels in `cpu_kernels` (int8, int4, fp8): weights stream from memory and widen to fp32 in
  registers, exact fp32 arithmetic whatever act_dtype is.
- "own_q8" (int4 only): the int4 kernel that rounds the activations to int8 per 32 columns and multiplies in
  integers; ~1.3-2x the "own" int4 throughput (widening int4 to fp32 is compute-bound on 2 AVX2 cores), at an output
  error of ~0.5 % of |y| (bf16 activations give ~0.2 %; int4 weight rounding itself ~10 %).
- "aten": torch's packed kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, what torchao uses). They
  are fast only with bf16 activations (fp32 ones are 5-30x slower on AVX2), so this path computes in bf16 and casts
  the result back to act_dtype. Weights are zero-padded to `aten_padded_shape` (the AVX-512 int8 kernel crashes or
  returns garbage for K % 16 != 0; the int4 packer needs N % 16 == 0).
- "chunked": dequantize blocks of output rows (at most ~4 MiB of act_dtype at a time), F.linear each block: the
  fallback for fp8 and for int4 group sizes aten rejects. `torch._scaled_mm` runs on CPU but needs *both* operands
  in fp8, i.e. it would quantize the activations too, so it is not a weight-only fp8 matmul and is not used.
- "bnb": nf4 through bitsandbytes `matmul_4bit` (slow on CPU but correct).
"auto" takes "own" when it fits (weight-only: the activations are not rounded), then "aten", then "chunked"; nf4
is always "bnb". "own_q8" changes the arithmetic (W4A8), so it is only used when asked for by name.

Fused CPU kernels exist for int8, int4 and fp8 (E4M3) only. The floating-point formats fp16, fp8_e5m2, fp4, mxfp4
and nvfp4 always take "chunked", the reference path: blocks of rows decoded by `formats.dequantize_weight` (exact in
fp32), then F.linear. It keeps the canonical tensors, FP4 codes one a byte, so it holds twice the packed bytes.

`swap_linears(model, quantized, act_dtype)` swaps named nn.Linear modules in place. `DenseLinear` / `BF16Linear`
(with `swap_dense_linears`) are the unquantized fp32/bf16 counterparts: torch's fp32 and bf16 matrix-vector products
stay below the read bandwidth on this AVX2 CPU (bf16 is compute-bound), the own kernels stream.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.quant import cpu_kernels
from posttrain.quant.formats import FLOAT_FORMATS, QuantizedWeight, dequantize_weight

BACKENDS = ("auto", "own", "own_q8", "aten", "chunked", "bnb")
ATEN_INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
ATEN_PAD = 16  # both dims of every weight handed to the aten packed kernels: see aten_padded_shape
CHUNK_BYTES = 4 << 20  # bound on the dequantized block the "chunked" path holds at once


def aten_padded_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """(N, K) rounded up to multiples of ATEN_PAD: the only weight shapes given to torch's packed CPU kernels.

    Both the int8 and the int4 aten paths pad their weights (zero rows / zero columns) to this shape, pad the
    activations' K with zeros and slice the output back to N. Measured with torch 2.13 (bf16 activations, M = 1, 2,
    3, 4, 16, 17 rows, N = 1, 5, 16, 17, 32, 33, 37, 48, 72, 1000, 4099):
    - `_weight_int8pack_mm` on an AMD EPYC Zen 4 (AVX-512 with BF16/VNNI, no AMX; aten CPU capability AVX512)
      dies with SIGSEGV or returns garbage (NaN, inf, 1e33) whenever K % 16 != 0 (K = 8, 24, 40, 56, 65, 72, 88,
      100, 136, 4104), for every N, 16 included: typically M = 1 gives garbage, M >= 2 a segfault (N = 33 and 37
      with K = 72 segfault from M = 2). K a multiple of 16 (16 ... 256, 4112) is correct for every N and M. The
      AVX2 and scalar builds of the same op (ATEN_CPU_CAPABILITY=avx2 / default) are correct on K = 72.
    - `_convert_weight_to_int4pack_for_cpu` raises for N % 16 != 0 ("expect N to be dividable by 16"); with N
      padded, `_weight_int4pack_mm_for_cpu` is correct for every K = multiple of the group size (32 ... 256).
    N is padded as well for int8 (measured harmless, costs at most 15 zero rows) so one rule covers both kernels.
    """
    return out_features + (-out_features % ATEN_PAD), in_features + (-in_features % ATEN_PAD)


def _own_kernel_fits(qw: QuantizedWeight, backend: str) -> bool:
    """Whether the shape suits the own kernel `backend` ("own" or "own_q8"); says nothing of the compiler."""
    in_features, group = qw.shape[1], qw.group_size or 0
    if backend == "own_q8":
        block = cpu_kernels.Q8_BLOCK
        return qw.fmt == "int4" and in_features % (2 * block) == 0 and group > 0 and group % block == 0
    if in_features % cpu_kernels.CHUNK:
        return False
    return qw.fmt != "int4" or (group > 0 and group % cpu_kernels.CHUNK == 0)


def _pick_backend(qw: QuantizedWeight, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} not in {BACKENDS}")
    if qw.fmt == "nf4":
        if backend not in ("auto", "bnb"):
            raise ValueError(f"nf4 runs only on the 'bnb' backend, got {backend!r}")
        return "bnb"
    if backend == "bnb":
        raise ValueError(f"the 'bnb' backend serves nf4 only, got fmt {qw.fmt!r}")
    if qw.fmt in FLOAT_FORMATS:
        if backend not in ("auto", "chunked"):
            raise ValueError(f"{qw.fmt} has no fused kernel: it runs only on the 'chunked' (reference) backend, "
                             f"got {backend!r}")
        return "chunked"
    if backend in ("own", "own_q8") and not (cpu_kernels.available() and _own_kernel_fits(qw, backend)):
        raise RuntimeError(
            f"own kernel unusable for {qw.fmt} {qw.shape} (group_size {qw.group_size}) on backend {backend!r}: "
            f"extension: {cpu_kernels.unavailable_reason()}; shapes: in_features a multiple of {cpu_kernels.CHUNK} "
            f"(own) or {2 * cpu_kernels.Q8_BLOCK} with group_size a multiple of {cpu_kernels.Q8_BLOCK} (own_q8, int4)"
        )
    if backend == "aten" and qw.fmt == "fp8":
        raise ValueError("fp8 has no aten weight-only kernel on CPU: use 'own' or 'chunked'")
    if backend == "aten" and qw.fmt == "int4" and qw.group_size not in ATEN_INT4_GROUP_SIZES:
        raise ValueError(f"aten int4 needs group_size in {ATEN_INT4_GROUP_SIZES}, got {qw.group_size}")
    if backend != "auto":
        return backend
    if _own_kernel_fits(qw, "own") and cpu_kernels.available():
        return "own"
    if qw.fmt == "int8" or (qw.fmt == "int4" and qw.group_size in ATEN_INT4_GROUP_SIZES):
        return "aten"
    return "chunked"


def _aten_int4_pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int4 -> (aten int4pack weight, bf16 scales_and_zeros [K/g, N_padded, 2]).

    The aten CPU kernel takes unsigned codes u in [0, 15] and dequantizes w = (u - 8) * scale + zero (checked in the
    tests). Canonical w = (q - z) * s, so: symmetric u = q + 8, zero = 0; asymmetric u = q, zero = (8 - z) * s.
    N is padded with zero rows to aten_padded_shape; forward slices them off. K is a multiple of the group size
    (>= 32), so it never needs padding.
    """
    n_out, k_in = qw.shape
    n_padded, k_padded = aten_padded_shape(n_out, k_in)
    if k_padded != k_in:
        raise ValueError(f"aten int4 needs in_features a multiple of {ATEN_PAD}, got {k_in}")
    scale = qw.scale.float()  # [N, G]
    if qw.symmetric:
        codes = qw.qweight.to(torch.int32) + 8
        zero = torch.zeros_like(scale)
    else:
        codes = qw.qweight.to(torch.int32)
        zero = (8.0 - qw.zero.float()) * scale
    n_pad = n_padded - n_out
    codes = F.pad(codes, (0, 0, 0, n_pad), value=8)  # u = 8 with scale 0 decodes to 0
    scale, zero = F.pad(scale, (0, 0, 0, n_pad)), F.pad(zero, (0, 0, 0, n_pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def _dequantize_rows(qw_tensors: dict[str, torch.Tensor], fmt: str, group_size: int | None, rows: slice, dtype):
    """Rows `rows` of the float weight, [rows, K] in dtype, from the canonical tensors (for the chunked path)."""
    if fmt in FLOAT_FORMATS:  # the rows as a QuantizedWeight of their own: scales are per row or per row's block
        codes, scale = qw_tensors["qweight"][rows], qw_tensors.get("scale")
        part = QuantizedWeight(fmt, codes, None if scale is None else scale[rows], group_size=group_size,
                               shape=tuple(codes.shape), tensor_scale=qw_tensors.get("tensor_scale"))
        return dequantize_weight(part, dtype)
    q = qw_tensors["qweight"][rows].float()
    scale = qw_tensors["scale"][rows].float()
    if fmt in ("int8", "fp8"):
        return (q * scale[:, None]).to(dtype)
    zero = qw_tensors.get("zero")
    q = q if zero is None else q - zero[rows].float().repeat_interleave(group_size, dim=1)
    return (q * scale.repeat_interleave(group_size, dim=1)).to(dtype)


def _backend_tensors(qw: QuantizedWeight, backend: str) -> dict[str, torch.Tensor]:
    """The buffers a QuantLinear on `backend` keeps: qw's fields packed the way that backend reads them."""
    zero = None if qw.symmetric else qw.zero
    if backend == "own_q8":
        codes, scale_offset = cpu_kernels.pack_int4_q8(qw.qweight, qw.scale, zero, qw.group_size)
        return {"codes": codes, "scale_offset": scale_offset}
    if backend == "own" and qw.fmt == "int4":
        codes, scale_offset = cpu_kernels.pack_int4(qw.qweight, qw.scale, zero, qw.group_size)
        return {"codes": codes, "scale_offset": scale_offset}
    if backend == "own":
        pack = cpu_kernels.pack_int8 if qw.fmt == "int8" else cpu_kernels.pack_fp8
        codes, scale = pack(qw.qweight, qw.scale)
        return {"codes": codes, "scale": scale}
    if backend == "aten" and qw.fmt == "int8":  # zero rows and columns up to aten_padded_shape
        (n_out, k_in), (n_padded, k_padded) = qw.shape, aten_padded_shape(*qw.shape)
        qweight = F.pad(qw.qweight, (0, k_padded - k_in, 0, n_padded - n_out))
        return {"qweight": qweight.contiguous(), "scale": F.pad(qw.scale.to(torch.bfloat16), (0, n_padded - n_out))}
    if backend == "aten":
        packed, scales_and_zeros = _aten_int4_pack(qw)
        return {"packed": packed, "scales_and_zeros": scales_and_zeros}
    if backend == "chunked" and qw.fmt in FLOAT_FORMATS:
        optional = {"scale": qw.scale, "tensor_scale": qw.tensor_scale}
        return {"qweight": qw.qweight} | {name: t for name, t in optional.items() if t is not None}
    if backend == "chunked":
        return {"qweight": qw.qweight, "scale": qw.scale} | ({} if zero is None else {"zero": zero})
    return {"qweight": qw.qweight}  # bnb: the packed nf4 bytes; the rest is in quant_state


class QuantLinear(nn.Module):
    """y = x @ dequant(W)^T + bias for x [..., in_features] -> [..., out_features] in act_dtype."""

    def __init__(self, fmt: str, backend: str, shape: tuple[int, int], act_dtype: torch.dtype,
                 group_size: int | None, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 quant_state: object | None = None):
        super().__init__()
        self.fmt, self.backend, self.act_dtype, self.group_size = fmt, backend, act_dtype, group_size
        self.out_features, self.in_features = shape
        self.aten_in_features = aten_padded_shape(*shape)[1]  # K the aten kernels see (activations zero-padded)
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        self.quant_state = quant_state

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype,
                       backend: str = "auto") -> "QuantLinear":
        n_out, k_in = qw.shape
        if tuple(qw.qweight.shape) != (n_out, k_in) and qw.fmt != "nf4":
            raise ValueError(f"{qw.fmt} qweight has shape {tuple(qw.qweight.shape)}, expected {(n_out, k_in)}")
        if bias is not None and tuple(bias.shape) != (n_out,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n_out},)")
        chosen = _pick_backend(qw, backend)
        if bias is not None:  # the own kernels add an fp32 bias; the other paths add it in act_dtype
            bias = bias.detach().to(torch.float32 if chosen in ("own", "own_q8") else act_dtype).contiguous()
        tensors = _backend_tensors(qw, chosen)
        return cls(qw.fmt, chosen, qw.shape, act_dtype, qw.group_size, tensors, bias, qw.quant_state)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"{self.in_features}->{self.out_features}, fmt={self.fmt}{group}, backend={self.backend}, "
                f"act_dtype={self.act_dtype}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called hundreds of times per decoded token: every op or nn.Module attribute lookup here costs ~1 us,
        # so buffers are read from self._buffers and the own kernels take x [..., K] as it comes.
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has last dim {x.shape[-1]}, expected in_features={self.in_features}")
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        if self.backend == "own":
            return self._forward_own(x)
        if self.backend == "own_q8":
            b = self._buffers
            return cpu_kernels.gemv_int4_q8(x, b["codes"], b["scale_offset"], self.group_size, self.out_features,
                                            b["bias"])
        y = getattr(self, f"_forward_{self.backend}")(x.reshape(-1, self.in_features))  # [M, N]
        return y.reshape(*x.shape[:-1], self.out_features)

    def _forward_own(self, x: torch.Tensor) -> torch.Tensor:
        b, n_out = self._buffers, self.out_features
        if self.fmt == "int8":
            return cpu_kernels.gemv_int8(x, b["codes"], b["scale"], n_out, b["bias"])
        if self.fmt == "fp8":
            return cpu_kernels.gemv_fp8(x, b["codes"], b["scale"], n_out, b["bias"])
        return cpu_kernels.gemv_int4(x, b["codes"], b["scale_offset"], self.group_size, n_out, b["bias"])

    def _forward_aten(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)  # the packed kernels are slow with fp32 activations
        if self.aten_in_features != self.in_features:  # zero columns matching the weight's (aten_padded_shape)
            xb = F.pad(xb, (0, self.aten_in_features - self.in_features))
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]  # drop the zero rows of aten_padded_shape
        y = y.to(self.act_dtype)
        return y if self.bias is None else y + self.bias

    def _forward_chunked(self, x: torch.Tensor) -> torch.Tensor:
        tensors = {name: self._buffers[name] for name in ("qweight", "scale", "zero", "tensor_scale")
                   if name in self._buffers}
        rows_per_block = max(1, CHUNK_BYTES // (self.in_features * x.element_size()))
        y = x.new_empty(x.shape[0], self.out_features)
        for r0 in range(0, self.out_features, rows_per_block):
            rows = slice(r0, min(r0 + rows_per_block, self.out_features))
            w_rows = _dequantize_rows(tensors, self.fmt, self.group_size, rows, x.dtype)  # [rows, K]
            y[:, rows] = F.linear(x, w_rows)
        return y if self.bias is None else y + self.bias

    def _forward_bnb(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, self.qweight.t(), quant_state=self.quant_state, bias=self.bias)


class DenseLinear(nn.Module):
    """nn.Linear with fp32 or bf16 weights on the own streaming kernel when it builds, else F.linear.

    The own kernel takes x of any float dtype at full fp32 accuracy; the torch fallback computes in weight_dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 weight_dtype: torch.dtype = torch.bfloat16, backend: str = "auto"):
        super().__init__()
        if weight_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"weight_dtype must be torch.float32 or torch.bfloat16, got {weight_dtype}")
        if backend not in ("auto", "own", "torch"):
            raise ValueError(f"DenseLinear backend {backend!r} not in ('auto', 'own', 'torch')")
        self.out_features, self.in_features = weight.shape
        fits = self.in_features % cpu_kernels.CHUNK == 0
        if backend == "own" and not (fits and cpu_kernels.available()):
            raise RuntimeError(f"own dense kernel unusable for {tuple(weight.shape)}: "
                               f"{cpu_kernels.unavailable_reason()}; in_features % {cpu_kernels.CHUNK} must be 0")
        self.backend = "own" if backend != "torch" and fits and cpu_kernels.available() else "torch"
        self.act_dtype, self.weight_dtype = act_dtype, weight_dtype
        weight = weight.detach()
        if self.backend == "own":
            self.register_buffer("codes", cpu_kernels.pack_dense(weight, weight_dtype))  # tiled, see cpu_kernels
        else:
            self.register_buffer("weight", weight.to(weight_dtype).contiguous())
        bias_dtype = torch.float32 if self.backend == "own" else weight_dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(bias_dtype).contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_dtype: torch.dtype, weight_dtype: torch.dtype = torch.bfloat16,
                    backend: str = "auto") -> "DenseLinear":
        return cls(linear.weight, linear.bias, act_dtype, weight_dtype, backend)

    def extra_repr(self) -> str:
        return (f"{self.in_features}->{self.out_features}, weight_dtype={self.weight_dtype}, backend={self.backend}, "
                f"act_dtype={self.act_dtype}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        b = self._buffers
        if self.backend == "own":
            return cpu_kernels.gemv_dense(x, b["codes"], self.out_features, b["bias"])  # checks x [..., K]
        return F.linear(x.to(self.weight_dtype), b["weight"], b["bias"]).to(self.act_dtype)


class BF16Linear(DenseLinear):
    """DenseLinear with bf16 weights (torch's bf16 matrix-vector product is compute-bound on AVX2)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 weight_dtype: torch.dtype = torch.bfloat16, backend: str = "auto"):
        if weight_dtype != torch.bfloat16:
            raise ValueError(f"BF16Linear stores bf16 weights, got weight_dtype={weight_dtype}: use DenseLinear")
        super().__init__(weight, bias, act_dtype, weight_dtype, backend)


def fuse_outputs(modules: list[nn.Module]) -> nn.Module | None:
    """One module whose output is the modules' outputs side by side, [..., sum of out_features], or None when they
    cannot share one: all own-kernel modules of one class, format, group size, backend, activation dtype and input
    width, each out_features but the last a multiple of the kernels' row tile (the packed weights and per-row scales
    then simply concatenate), all with a bias or none.

    A layer's q/k/v (and gate/up) projections read the same input: fused, a batch-1 decode step makes 4 kernel calls
    per layer instead of 7, and each call's fixed cost (dispatch, activation conversion, thread start) was ~8 us of
    a 15-40 us call on SmolLM2-135M int4."""
    first = modules[0]
    same = ("fmt", "group_size", "weight_dtype", "backend", "act_dtype", "in_features")
    if (len(modules) < 2 or not isinstance(first, (QuantLinear, DenseLinear))
            or any(type(m) is not type(first) or any(getattr(m, a, None) != getattr(first, a, None) for a in same)
                   for m in modules)
            or first.backend not in ("own", "own_q8")
            or any(m.out_features % cpu_kernels.ROWS_PER_TILE for m in modules[:-1])
            or len({m._buffers["bias"] is None for m in modules}) > 1):
        return None
    out_features = sum(m.out_features for m in modules)
    tensors = {name: torch.cat([m._buffers[name] for m in modules]) for name in first._buffers if name != "bias"}
    bias = None if first._buffers["bias"] is None else torch.cat([m._buffers["bias"] for m in modules])
    if isinstance(first, QuantLinear):
        return QuantLinear(first.fmt, first.backend, (out_features, first.in_features), first.act_dtype,
                           first.group_size, tensors, bias)
    fused = copy.copy(first)  # DenseLinear packs from a float weight in __init__; here the packed codes exist
    fused._buffers = {**tensors, "bias": bias}
    fused.out_features = out_features
    return fused


def named_linear(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Linear]:
    """(parent module, attribute name, the nn.Linear) for a dotted module name, or an error naming it."""
    try:
        module = model.get_submodule(name)
    except AttributeError as exc:
        raise KeyError(f"model has no module named {name!r}") from exc
    if not isinstance(module, nn.Linear):
        raise TypeError(f"module {name!r} is {type(module).__name__}, expected nn.Linear")
    parent_name, _, attr = name.rpartition(".")
    return model.get_submodule(parent_name), attr, module


def quantized_target(model: nn.Module, name: str, qw: QuantizedWeight) -> tuple[nn.Module, str, nn.Linear]:
    """named_linear, checked against the shape of the quantized weight that will replace it."""
    parent, attr, linear = named_linear(model, name)
    if tuple(qw.shape) != (linear.out_features, linear.in_features):
        raise ValueError(f"quantized weight for {name!r} has shape {tuple(qw.shape)}, the module is "
                         f"{(linear.out_features, linear.in_features)} [out, in]")
    return parent, attr, linear


def swap_linears(model: nn.Module, quantized: dict[str, QuantizedWeight], act_dtype: torch.dtype,
                 backend: str = "auto") -> nn.Module:
    """Replace each named nn.Linear by a QuantLinear of its quantized weight, keeping its bias; in place.

    All names are checked (present, nn.Linear, matching shape) before any module is replaced.
    """
    targets = {name: quantized_target(model, name, qw) for name, qw in quantized.items()}
    for name, (parent, attr, linear) in targets.items():
        setattr(parent, attr, QuantLinear.from_quantized(quantized[name], linear.bias, act_dtype, backend))
    return model


def swap_dense_linears(model: nn.Module, names: Iterable[str], act_dtype: torch.dtype,
                       weight_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> nn.Module:
    """Replace each named nn.Linear by a DenseLinear (fp32 or bf16 weights) of its weight and bias; in place."""
    targets = [named_linear(model, name) for name in names]
    for parent, attr, linear in targets:
        setattr(parent, attr, DenseLinear.from_linear(linear, act_dtype, weight_dtype, backend))
    return model
