"""Low-precision floating-point element formats and block scales, as pure tensor functions (encode / decode).

The element formats:
- FP4 E2M1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit. Magnitudes 0, 0.5 (the one subnormal), 1, 1.5,
  2, 3, 4, 6. There is no Inf or NaN. Codes are uint8 values 0..15, sign in bit 3, so 8 is -0.
- FP8 E4M3 (`torch.float8_e4m3fn`): no Inf. 0x7F / 0xFF are NaN, the largest finite value is 448.
- FP8 E5M2 (`torch.float8_e5m2`): IEEE-style, with Inf (0x7C / 0xFC) and NaN. The largest finite value is 57344.
- E8M0 (the OCP microscaling shared scale): 8 exponent bits, bias 127, no sign, no mantissa. Code e is 2^(e-127);
  255 is NaN.

The block formats built on them:
- MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 FP4 E2M1 values along a row, sharing one E8M0 scale. The
  scale is 2^(floor(log2(max|v|)) - 2), where 2 is the exponent of FP4's largest normal (6 = 1.5 * 2^2). Values
  are then rounded to FP4 and saturate at +-6.
- NVFP4: blocks of 16 FP4 E2M1 values, each block with an FP8 E4M3 scale, and one FP32 scale for the tensor. The
  tensor scale is amax / (6 * 448), so each block's scale, block amax / 6 / tensor scale, fits E4M3.

Rounding is round-to-nearest, ties to even (the code whose last bit is 0), as the OCP spec asks of conversions.
Values beyond the largest finite one saturate. A NaN or infinite weight raises a ValueError naming how many there
are and where the first is: no FP4 code can hold it, and a NaN shared scale would silently zero a whole block.
Written here because no maintained library encodes these formats on CPU. torch has the FP8 dtypes but no FP4 or
E8M0 arithmetic, and the `gguf` package's MXFP4 encoder works on GGUF's own block layout.
"""

from __future__ import annotations

import torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative
FP4_MAX = 6.0
FP4_EMAX = 2  # exponent of FP4's largest normal value: 6 = 1.5 * 2^2
FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
E8M0_BIAS, E8M0_NAN = 127, 255
MXFP4_BLOCK, NVFP4_BLOCK = 32, 16


def check_finite(w: torch.Tensor, what: str) -> None:
    """Raise naming how many values of `w` are NaN or infinite, and where the first one is."""
    bad = ~torch.isfinite(w)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{what}: {int(bad.sum())} NaN or infinite value(s), first at index {first}; no "
                         f"low-precision code can hold them")


# Rounding to FP4 as threshold counts: the code of |x| is how many midpoints between neighbouring grid values it
# passes. At a midpoint the tie goes to the even code: strictly above when the code above is odd (">"), at or above
# when it is even (">="). Seven comparisons, no search or gather: ~10x faster than bucketize on CPU, which matters
# for the quantize stage's table of format errors over every weight of a real model.
_FP4_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (uint8 0..15) of x, rounded to nearest with ties to even, saturating at +-6."""
    check_finite(x, "fp4_encode")
    a = x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for middle, tie_up in _FP4_MIDPOINTS:
        code += (a >= middle) if tie_up else (a > middle)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


# The 16 codes' values, negatives (sign bit 3) after positives: one gather decodes a code. The serving reference
# path decodes every FP4 weight on every forward, and a gather is ~3x faster than a masked lookup plus a sign select.
_FP4_SIGNED_VALUES = torch.tensor(FP4_E2M1_VALUES + tuple(-v for v in FP4_E2M1_VALUES), dtype=torch.float32)


def fp4_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP4 E2M1 codes (uint8 0..15; bits above the fourth are ignored)."""
    return torch.take(_FP4_SIGNED_VALUES.to(code.device), (code & 15).long())


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 2^(code - 127) of E8M0 codes (uint8); 255 is NaN. 2^-127 is an fp32 subnormal, still exact."""
    value = torch.exp2(code.float() - E8M0_BIAS)
    return torch.where(code == E8M0_NAN, torch.full_like(value, float("nan")), value)


def _blocks(w: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"{what} needs a 2-D weight whose columns are a multiple of {block}, got {tuple(w.shape)}")
    check_finite(w, what)
    return w.float().reshape(w.shape[0], w.shape[1] // block, block)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (FP4 codes uint8 [out, in], E8M0 scale codes uint8 [out, in / 32]).

    An all-zero block gets scale code 127 (2^0) and zero codes."""
    blocks = _blocks(w, MXFP4_BLOCK, "mxfp4")
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))) - FP4_EMAX
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale_code = (exponent + E8M0_BIAS).to(torch.uint8)
    codes = fp4_encode(blocks / e8m0_decode(scale_code)[..., None])
    return codes.reshape(w.shape), scale_code


def mxfp4_dequantize(codes: torch.Tensor, scale_code: torch.Tensor) -> torch.Tensor:
    values = fp4_decode(codes).reshape(codes.shape[0], -1, MXFP4_BLOCK)
    return (values * e8m0_decode(scale_code)[..., None]).reshape(codes.shape)


def nvfp4_quantize(w: torch.Tensor, tensor_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (FP4 codes uint8 [out, in], E4M3 block scales [out, in / 16], fp32 tensor scale []).

    tensor_scale: None for amax / (6 * 448); a given one must be positive, and at least that for the block scales
    not to saturate at 448."""
    blocks = _blocks(w, NVFP4_BLOCK, "nvfp4")
    amax = blocks.abs().amax()
    if tensor_scale is None:
        tensor_scale = torch.where(amax > 0, amax / (FP4_MAX * FP8_E4M3_MAX), torch.ones_like(amax))
    elif not (tensor_scale.numel() == 1 and float(tensor_scale) > 0):
        raise ValueError(f"nvfp4 tensor_scale must be one positive value, got {tensor_scale}")
    tensor_scale = tensor_scale.float().reshape(())
    block_scale = (blocks.abs().amax(dim=-1) / FP4_MAX / tensor_scale).clamp(max=FP8_E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    divisor = block_scale.float() * tensor_scale
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))  # an all-zero block (or one rounded to 0)
    codes = fp4_encode(blocks / divisor[..., None])
    return codes.reshape(w.shape), block_scale, tensor_scale


def nvfp4_dequantize(codes: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    values = fp4_decode(codes).reshape(codes.shape[0], -1, NVFP4_BLOCK)
    return (values * (block_scale.float() * tensor_scale)[..., None]).reshape(codes.shape)


def fp8_quantize(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes of `dtype` (float8_e4m3fn or float8_e5m2), fp32 scale per output row [out]).
    The largest |w| of a row maps to the format's largest finite value; the cast rounds to nearest, ties to even."""
    top = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}[dtype]
    check_finite(w, str(dtype))
    scale = w.float().abs().amax(dim=-1) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w.float() / scale[:, None]).clamp(-top, top).to(dtype), scale
