"""FP4 E2M1, E8M0, FP8 E4M3 / E5M2, MXFP4 and NVFP4: every code against a decoder written here from the specs' bit
layouts, rounding ties to even, saturation, the block scale rules, and the errors raised for non-finite weights."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.quant.microscaling import (
    e8m0_decode,
    fp4_decode,
    fp4_encode,
    fp8_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)


def spec_float(code: int, exponent_bits: int, mantissa_bits: int, bias: int) -> float:
    """Value of a sign / exponent / mantissa code with subnormals at exponent 0 (no Inf or NaN rule applied)."""
    sign = -1.0 if code >> (exponent_bits + mantissa_bits) & 1 else 1.0
    e = code >> mantissa_bits & ((1 << exponent_bits) - 1)
    m = code & ((1 << mantissa_bits) - 1)
    if e == 0:
        return sign * math.ldexp(m / (1 << mantissa_bits), 1 - bias)
    return sign * math.ldexp(1 + m / (1 << mantissa_bits), e - bias)


def test_every_fp4_code_decodes_as_the_spec_and_encodes_back():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor([spec_float(c, 2, 1, 1) for c in range(16)])
    decoded = fp4_decode(codes)
    assert decoded.tolist() == expected.tolist()  # 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    assert decoded[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.signbit(decoded[8])  # code 8 is -0
    assert fp4_encode(decoded).tolist() == codes.tolist()


def test_fp4_rounds_to_nearest_ties_to_even_and_saturates():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # each tie goes to the neighbour whose code ends in 0: 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0
    assert fp4_decode(fp4_encode(midpoints)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp4_decode(fp4_encode(-midpoints)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert fp4_decode(fp4_encode(torch.tensor([6.5, 1e30, -7.0]))).tolist() == [6.0, 6.0, -6.0]
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 3
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    distance = (x.double().abs().clamp(max=6)[:, None] - grid).abs()  # brute force: nearest, then the even code
    best = distance.min(dim=1, keepdim=True).values
    candidates = (distance == best).to(torch.int64) * torch.tensor([2, 1, 2, 1, 2, 1, 2, 1])  # even codes first
    nearest = grid[candidates.argmax(dim=1)] * torch.where(x < 0, -1.0, 1.0).double()
    assert torch.equal(fp4_decode(fp4_encode(x)).double(), nearest)


def test_every_e8m0_code_is_a_power_of_two_and_255_is_nan():
    decoded = e8m0_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert decoded[:255].tolist() == [math.ldexp(1.0, e - 127) for e in range(255)]
    assert math.isnan(decoded[255])


@pytest.mark.parametrize("dtype,exponent_bits,bias", [(torch.float8_e4m3fn, 4, 7), (torch.float8_e5m2, 5, 15)])
def test_every_fp8_code_matches_the_spec(dtype, exponent_bits, bias):
    mantissa_bits = 7 - exponent_bits
    decoded = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    for code in range(256):
        e, m = code >> mantissa_bits & ((1 << exponent_bits) - 1), code & ((1 << mantissa_bits) - 1)
        top = e == (1 << exponent_bits) - 1
        if dtype == torch.float8_e4m3fn and top and m == (1 << mantissa_bits) - 1:  # E4M3: S.1111.111 is NaN
            assert math.isnan(decoded[code]), code
        elif dtype == torch.float8_e5m2 and top:  # E5M2: IEEE-style, Inf at mantissa 0, NaN otherwise
            assert math.isinf(decoded[code]) if m == 0 else math.isnan(decoded[code]), code
        else:
            assert decoded[code].item() == spec_float(code, exponent_bits, mantissa_bits, bias), code
    finite = torch.isfinite(decoded)
    assert decoded[finite].abs().max().item() == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    back = decoded[finite].to(dtype).view(torch.uint8)
    assert torch.equal(back, torch.arange(256, dtype=torch.int32).to(torch.uint8)[finite])


def test_mxfp4_shares_a_power_of_two_scale_per_32_values():
    w = torch.zeros(3, 64)
    w[0, :32] = torch.linspace(-5.0, 5.0, 32)  # max 5: floor(log2 5) - 2 = 0, scale 1, values rounded as they are
    w[0, 32:] = 0.1  # floor(log2 0.1) - 2 = -6: 0.1 / 2^-6 = 6.4 saturates to 6, as the spec's rule allows
    w[1] = torch.randn(64, generator=torch.Generator().manual_seed(1))
    codes, scales = mxfp4_quantize(w)
    assert scales[0].tolist() == [127, 121] and scales[2].tolist() == [127, 127]  # all-zero rows: scale 2^0
    assert torch.equal(fp4_decode(codes[0, :32]), fp4_decode(fp4_encode(w[0, :32])))
    assert mxfp4_dequantize(codes, scales)[0, 32:].tolist() == [6 * 2.0**-6] * 32
    assert torch.equal(mxfp4_dequantize(codes, scales)[2], torch.zeros(64))
    back = mxfp4_dequantize(codes, scales)[1]
    block_max = w[1].reshape(2, 32).abs().amax(dim=1).repeat_interleave(32)
    assert ((back - w[1]).abs() <= block_max / 6).all()  # half FP4's widest step (2) at the block's scale, at most


def test_nvfp4_block_and_tensor_scales():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    codes, block_scale, tensor_scale = nvfp4_quantize(w)
    assert codes.shape == w.shape and block_scale.shape == (8, 4) and block_scale.dtype == torch.float8_e4m3fn
    assert tensor_scale.item() == pytest.approx(w.abs().max().item() / (6 * 448))
    assert block_scale.float().max().item() == 448.0  # the block holding the tensor's amax uses the full E4M3 range
    back = nvfp4_dequantize(codes, block_scale, tensor_scale)
    top = w.abs().argmax()
    assert back.flatten()[top].item() == pytest.approx(w.flatten()[top].item(), rel=1e-6)
    rel = ((back - w).norm() / w.norm()).item()
    mx = mxfp4_dequantize(*mxfp4_quantize(w))
    assert 0.01 < rel < ((mx - w).norm() / w.norm()).item()  # finer scales (16 values, E4M3) beat MXFP4's


def test_fp8_e5m2_per_row_scale_and_bad_weights_named():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    codes, scale = fp8_quantize(w, torch.float8_e5m2)
    assert codes.float().abs().amax(dim=1).tolist() == [57344.0] * 4
    assert ((codes.float() * scale[:, None] - w).abs() <= w.abs() * 2**-3 + 1e-12).all()  # 2 mantissa bits
    w[2, 5] = float("nan")
    for fn in (lambda: mxfp4_quantize(w), lambda: nvfp4_quantize(w), lambda: fp8_quantize(w, torch.float8_e5m2)):
        with pytest.raises(ValueError, match=r"1 NaN or infinite value\(s\), first at index \(2, 5\)"):
            fn()
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.ones(2, 48))
