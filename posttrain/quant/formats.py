"""Quantization formats as pure functions: quantize a float weight, dequantize it back, measure the error.

The canonical form (`QuantizedWeight`) keeps integer codes unpacked so that every consumer can pack them its
own way. A weight `w` of shape [out, in] is approximated as:

- int8 (per output channel, symmetric): w ~ q * scale[:, None]; q int8 in [-127, 127], scale fp32 [out]
- int4 (group-wise along `in`): w ~ (q - zero) * scale, expanded per group of `group_size` input columns;
  q int8 holding 4-bit codes, symmetric: q in [-8, 7] and zero is None; asymmetric: q in [0, 15] and
  zero int8 [out, in // group_size] in [0, 15]; scale fp32 [out, in // group_size]
- fp8 (E4M3, per output channel): w ~ q.float() * scale[:, None]; q torch.float8_e4m3fn, scale fp32 [out]
- nf4 (bitsandbytes, block-wise absmax): q is the bitsandbytes packed uint8 tensor, quant_state its QuantState
- fp16: w ~ q.float(); q float16 [out, in], no scale (a cast: round to nearest even; |w| above 65504 raises)
- fp8_e5m2 (per output channel): w ~ q.float() * scale[:, None]; q torch.float8_e5m2, scale fp32 [out], the row's
  largest |w| mapped to 57344
- fp4 (E2M1, group-wise along `in`, default groups of 32): w ~ fp4(q) * scale, q uint8 FP4 codes [out, in] (one
  code a byte, sign in bit 3), scale fp32 [out, in // group_size] = the group's absmax / 6. The same element format
  as mxfp4 and nvfp4 with an exact scale, so that the table of format errors tells the element format's cost from
  the scale's. 32 because it is MXFP4's block: fp4 g32 and mxfp4 differ only in the scale's rounding.
- mxfp4 (OCP MX, blocks of 32): q uint8 FP4 codes [out, in], scale uint8 E8M0 codes [out, in // 32]
- nvfp4 (blocks of 16): q uint8 FP4 codes [out, in], scale float8_e4m3fn block scales [out, in // 16], tensor_scale
  fp32 [] for the whole weight. The tensor scale is the power of two at or above amax / (6 * 448) rather than that
  value itself (NVIDIA's recipe): its reciprocal, the global scale compressed-tensors stores, is then exact, and
  compressed-tensors' dequantization (dividing by the global scale) gives the same bits as multiplying by it here.
  Block scales are then at most 2x smaller than with amax / (6 * 448): the same 3-bit relative precision, with at
  most one binade less room above E4M3's subnormals.
The FP4, E8M0 and FP8 E5M2 encoders are `microscaling`'s. Every format raises on a NaN or infinite weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.quant import microscaling

FORMATS = ("int8", "int4", "fp8", "nf4", "fp16", "fp8_e5m2", "fp4", "mxfp4", "nvfp4")
FLOAT_FORMATS = ("fp16", "fp8_e5m2", "fp4", "mxfp4", "nvfp4")  # round to nearest only; no GPTQ / AWQ codes
PER_CHANNEL_FORMATS = ("int8", "fp8", "fp8_e5m2")  # one scale per output row: group_size must be None
GROUPED_FORMATS = ("int4", "nf4", "fp4")  # the group size is a choice (default below)
FIXED_BLOCK = {"mxfp4": microscaling.MXFP4_BLOCK, "nvfp4": microscaling.NVFP4_BLOCK}  # group_size None or this


@dataclass
class QuantizedWeight:
    fmt: str  # one of FORMATS
    qweight: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None = None
    group_size: int | None = None
    symmetric: bool = True
    shape: tuple[int, int] = (0, 0)  # [out, in] of the float weight
    quant_state: object | None = None  # nf4 only: the bitsandbytes QuantState
    tensor_scale: torch.Tensor | None = None  # nvfp4 only: the fp32 scale [] of the whole weight

INT4_DEFAULT_GROUP_SIZE = 128  # int4 with group_size=None uses this (the usual GPTQ/AWQ default)
NF4_DEFAULT_BLOCKSIZE = 64  # bitsandbytes' usual NF4 block size
FP4_DEFAULT_GROUP_SIZE = 32  # MXFP4's block, so that fp4 g32 and mxfp4 differ only in how the scale is rounded
DEFAULT_GROUP_SIZE = {"int4": INT4_DEFAULT_GROUP_SIZE, "nf4": NF4_DEFAULT_BLOCKSIZE, "fp4": FP4_DEFAULT_GROUP_SIZE}
FP16_MAX = 65504.0  # largest finite float16 value
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value

# Integer code ranges (inclusive) per format and symmetry.
CODE_RANGE = {("int8", True): (-127, 127), ("int4", True): (-8, 7), ("int4", False): (0, 15)}
# Symmetric scale = absmax / this, so that the largest weight maps to the largest positive code.
_SYM_DIVISOR = {"int8": 127.0, "int4": 7.0, "fp8": FP8_E4M3_MAX}


def resolve_group_size(fmt: str, group_size: int | None, in_features: int) -> int | None:
    """The group size a format will use for a weight with `in_features` columns; raises on a bad combination.

    int8, fp8 and fp8_e5m2 are per output channel and fp16 has no scale (group_size must be None); int4 defaults
    to 128, nf4 to 64, fp4 to 32; mxfp4 and nvfp4 have fixed blocks of 32 and 16 (group_size None or that). A group
    must divide `in_features` so that groups never straddle rows (for nf4 this keeps bitsandbytes' flat blocks
    aligned with rows, so each block is a group of one row's input columns).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")
    if fmt in PER_CHANNEL_FORMATS or fmt == "fp16":
        if group_size is not None:
            kind = "has no scale" if fmt == "fp16" else "is per output channel"
            raise ValueError(f"{fmt} {kind}: group_size must be None, got {group_size}")
        return None
    if fmt in FIXED_BLOCK and group_size not in (None, FIXED_BLOCK[fmt]):
        raise ValueError(f"{fmt} has fixed blocks of {FIXED_BLOCK[fmt]}: group_size must be None or that, "
                         f"got {group_size}")
    if group_size is None:
        group_size = FIXED_BLOCK.get(fmt) or DEFAULT_GROUP_SIZE[fmt]
    if group_size <= 0 or in_features % group_size != 0:
        raise ValueError(
            f"{fmt} group_size {group_size} must be positive and divide the weight's in_features {in_features}"
        )
    return group_size


def _check_symmetry(fmt: str, symmetric: bool) -> None:
    if not symmetric and fmt != "int4":
        raise ValueError(f"{fmt} is symmetric only in this contract; asymmetric (symmetric=False) is int4 only")


def choose_scale_zero(w: torch.Tensor, fmt: str, symmetric: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) for each row of `w` [..., k], reducing over the last dim -> scale [...] fp32.

    Symmetric: scale = absmax / (largest positive code), zero None. Asymmetric int4: the range [min, max] is
    widened to include 0 (so the integer zero point lands in [0, 15] and a weight of 0 is exact), scale =
    (max - min) / 15, zero = round(-min / scale). An all-zero row gets scale 1 so that its codes are 0.
    """
    _check_symmetry(fmt, symmetric)
    w = w.float()
    if symmetric:
        scale = w.abs().amax(dim=-1) / _SYM_DIVISOR[fmt]
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    w_min = w.amin(dim=-1).clamp(max=0.0)
    w_max = w.amax(dim=-1).clamp(min=0.0)
    scale = (w_max - w_min) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-w_min / scale).clamp(0, 15).to(torch.int8)
    return scale, zero


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """Round `w` [..., k] to codes with a fixed scale [...] (and zero [...] for asymmetric int4).

    Returns int8 codes for int8/int4, float8_e4m3fn for fp8. GPTQ calls this one column at a time with the
    group's scale fixed when the group started.
    """
    scaled = w.float() / scale.unsqueeze(-1)
    if fmt == "fp8":
        # Clamp first: a ratio a hair above 448 from float rounding must not depend on the cast's overflow rule.
        return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    symmetric = zero is None
    if (fmt, symmetric) not in CODE_RANGE:
        raise ValueError(f"quantize_codes: no integer code range for fmt={fmt!r}, symmetric={symmetric}")
    low, high = CODE_RANGE[(fmt, symmetric)]
    if not symmetric:
        scaled = scaled + zero.unsqueeze(-1).float()
    return torch.round(scaled).clamp(low, high).to(torch.int8)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """(codes - zero) * scale for codes [..., k] and scale/zero [...] -> fp32 [..., k]."""
    values = codes.float()
    if zero is not None:
        values = values - zero.unsqueeze(-1).float()
    return values * scale.unsqueeze(-1)


def quantize_weight(
    w: torch.Tensor, fmt: str, group_size: int | None = None, symmetric: bool = True
) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight `w` [out, in] into the canonical `QuantizedWeight`."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    out_features, in_features = w.shape
    group_size = resolve_group_size(fmt, group_size, in_features)
    _check_symmetry(fmt, symmetric)
    microscaling.check_finite(w.detach(), fmt)
    w = w.detach().float()
    shape = (out_features, in_features)
    if fmt in FLOAT_FORMATS:
        return _quantize_float(w, fmt, group_size)
    if fmt == "nf4":
        return _quantize_nf4(w, group_size)
    if fmt in ("int8", "fp8"):
        scale, _ = choose_scale_zero(w, fmt)  # [out]
        return QuantizedWeight(fmt, quantize_codes(w, scale, None, fmt), scale, shape=shape)
    # int4: view as [out, n_groups, group_size] and reduce each group.
    grouped = w.reshape(out_features, in_features // group_size, group_size)
    scale, zero = choose_scale_zero(grouped, fmt, symmetric)  # [out, n_groups]
    codes = quantize_codes(grouped, scale, zero, fmt).reshape(out_features, in_features)
    return QuantizedWeight(fmt, codes, scale, zero, group_size, symmetric, shape)


def _quantize_float(w: torch.Tensor, fmt: str, group_size: int | None) -> QuantizedWeight:
    """fp16, fp8_e5m2, fp4, mxfp4, nvfp4 of a finite float32 weight [out, in] (group_size already resolved)."""
    shape = tuple(w.shape)
    if fmt == "fp16":
        too_big = w.abs() > FP16_MAX
        if too_big.any():
            first = tuple(int(i) for i in too_big.nonzero()[0])
            raise ValueError(f"fp16: {int(too_big.sum())} weight(s) beyond +-{FP16_MAX:g}, first at index {first}")
        return QuantizedWeight("fp16", w.to(torch.float16), None, shape=shape)
    if fmt == "fp8_e5m2":
        codes, scale = microscaling.fp8_quantize(w, torch.float8_e5m2)
        return QuantizedWeight(fmt, codes, scale, shape=shape)
    if fmt == "mxfp4":
        codes, scale_codes = microscaling.mxfp4_quantize(w)
        return QuantizedWeight(fmt, codes, scale_codes, group_size=group_size, shape=shape)
    if fmt == "nvfp4":
        codes, block_scale, tensor_scale = microscaling.nvfp4_quantize(w, tensor_scale=nvfp4_tensor_scale(w))
        return QuantizedWeight(fmt, codes, block_scale, group_size=group_size, shape=shape, tensor_scale=tensor_scale)
    grouped = w.reshape(shape[0], shape[1] // group_size, group_size)  # fp4: an fp32 scale per group
    scale = grouped.abs().amax(dim=-1) / microscaling.FP4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = microscaling.fp4_encode(grouped / scale[..., None]).reshape(shape)
    return QuantizedWeight("fp4", codes, scale, group_size=group_size, shape=shape)


def nvfp4_tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """The power of two at or above amax(|w|) / (6 * 448), fp32 [] (1 for an all-zero weight); see the module doc."""
    target = w.float().abs().amax() / (microscaling.FP4_MAX * microscaling.FP8_E4M3_MAX)
    mantissa, exponent = torch.frexp(target)  # target = mantissa * 2^exponent, mantissa in [0.5, 1): exact
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.where(target > 0, torch.ldexp(torch.ones(()), exponent), torch.ones(()))


def _quantize_nf4(w: torch.Tensor, blocksize: int) -> QuantizedWeight:
    # Imported here: bitsandbytes is an optional dependency (the `gpu` extra) and slow to import.
    import bitsandbytes.functional as bnb_functional

    packed, quant_state = bnb_functional.quantize_4bit(w.contiguous(), blocksize=blocksize, quant_type="nf4")
    # scale stays None: the block absmax lives in quant_state (one source of truth for the bitsandbytes state).
    return QuantizedWeight("nf4", packed, None, None, blocksize, True, tuple(w.shape), quant_state)


def dequantize_weight(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference dequantization of `q` -> a dense [out, in] tensor of `dtype` (materialised in full)."""
    if q.fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {q.fmt!r}; expected one of {FORMATS}")
    if q.fmt in FLOAT_FORMATS:
        return _dequantize_float(q).to(dtype)
    if q.fmt == "nf4":
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(q.qweight, q.quant_state).reshape(q.shape).to(dtype)
    if q.fmt in ("int8", "fp8"):
        return dequantize_codes(q.qweight, q.scale, None).to(dtype)
    out_features, in_features = q.shape
    grouped = q.qweight.reshape(out_features, in_features // q.group_size, q.group_size)
    return dequantize_codes(grouped, q.scale, q.zero).reshape(out_features, in_features).to(dtype)


def _dequantize_float(q: QuantizedWeight) -> torch.Tensor:
    """fp32 [out, in] of a float-format QuantizedWeight, through microscaling's decoders (exact in fp32)."""
    if q.fmt == "fp16":
        return q.qweight.float()
    if q.fmt == "fp8_e5m2":
        return dequantize_codes(q.qweight, q.scale, None)
    if q.fmt == "mxfp4":
        return microscaling.mxfp4_dequantize(q.qweight, q.scale)
    if q.fmt == "nvfp4":
        return microscaling.nvfp4_dequantize(q.qweight, q.scale, q.tensor_scale)
    out_features, in_features = q.shape  # fp4
    values = microscaling.fp4_decode(q.qweight).reshape(out_features, in_features // q.group_size, q.group_size)
    return (values * q.scale.float()[..., None]).reshape(out_features, in_features)


def weight_error(w: torch.Tensor, q: QuantizedWeight) -> dict[str, float]:
    """How far dequantize(q) is from `w` [out, in], in float64.

    rel_error: ||w - deq||_F / ||w||_F. of_spread: rms(w - deq) / std(w), the error as a fraction of the
    weights' spread (int4 g128 on Gaussian weights is about 0.1). max_abs: the largest absolute error.
    """
    if tuple(w.shape) != tuple(q.shape):
        raise ValueError(f"weight shape {tuple(w.shape)} does not match the quantized shape {tuple(q.shape)}")
    w64 = w.detach().double()
    diff = w64 - dequantize_weight(q, torch.float64)
    return {
        "rel_error": (diff.norm() / w64.norm()).item(),
        "of_spread": (diff.pow(2).mean().sqrt() / w64.std()).item(),
        "max_abs": diff.abs().max().item(),
    }


def bytes_per_param(q: QuantizedWeight, scale_bytes: int = 2) -> float:
    """Storage per weight element as an export would lay it out, codes at their real packed width.

    Codes: fp16 2 bytes, int8, fp8 and fp8_e5m2 1 byte, int4, nf4, fp4, mxfp4 and nvfp4 0.5 byte (two codes per
    byte). Scales: `scale_bytes` each (int8, int4, fp8, fp8_e5m2, fp4), default 2 because the compressed-tensors
    export stores scales in the model dtype (bf16/fp16). int4 zero points: 4 bits each (compressed-tensors packs
    them like the codes). Formats whose scale has a fixed width are counted at it, ignoring `scale_bytes`: nf4
    bitsandbytes' absmax (fp32, 4 bytes per block, no double quantization), mxfp4 one E8M0 byte per 32, nvfp4 one
    E4M3 byte per 16 plus its 4-byte tensor scale.
    """
    out_features, in_features = q.shape
    n_params = out_features * in_features
    if q.fmt == "nf4":
        absmax = q.quant_state.absmax
        return 0.5 + absmax.numel() * absmax.element_size() / n_params
    if q.fmt == "fp16":
        return 2.0
    if q.fmt in FIXED_BLOCK:
        tensor_scale_bytes = 4 if q.fmt == "nvfp4" else 0
        return 0.5 + (q.scale.numel() * q.scale.element_size() + tensor_scale_bytes) / n_params
    code_bytes = {"int8": 1.0, "fp8": 1.0, "fp8_e5m2": 1.0, "int4": 0.5, "fp4": 0.5}[q.fmt]
    scale_total = q.scale.numel() * scale_bytes
    zero_total = q.zero.numel() * 0.5 if q.zero is not None else 0.0
    return code_bytes + (scale_total + zero_total) / n_params
