"""Quantization formats: round trips against plain float64 references written here, code ranges, error ordering,
storage size, and the errors raised for bad input."""

from __future__ import annotations

import pytest
import torch

from posttrain.quant.formats import (
    FP8_E4M3_MAX,
    QuantizedWeight,
    bytes_per_param,
    choose_scale_zero,
    dequantize_weight,
    quantize_codes,
    quantize_weight,
    weight_error,
)

INT_CASES = [  # (fmt, group_size, symmetric)
    ("int8", None, True),
    ("int4", 32, True),
    ("int4", 64, True),
    ("int4", 128, True),
    ("int4", 32, False),
    ("int4", 64, False),
    ("int4", 128, False),
]


def gaussian_weight(out_features=24, in_features=256, seed=0, shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.02 + shift


def reference_int_round_trip(w: torch.Tensor, fmt: str, group_size: int | None, symmetric: bool):
    """Plain float64 RTN, one row and one group at a time -> (codes, dequantized), both float64."""
    w = w.double()
    out_features, in_features = w.shape
    group = group_size or in_features
    codes = torch.empty_like(w)
    deq = torch.empty_like(w)
    for row in range(out_features):
        for start in range(0, in_features, group):
            values = w[row, start:start + group]
            if symmetric:
                top = 127.0 if fmt == "int8" else 7.0
                bottom = -127.0 if fmt == "int8" else -8.0
                scale = values.abs().max().item() / top or 1.0
                zero_point = 0
            else:
                low, high = min(values.min().item(), 0.0), max(values.max().item(), 0.0)
                scale = (high - low) / 15.0 or 1.0
                zero_point = min(max(round(-low / scale), 0), 15)
                bottom, top = 0.0, 15.0
            group_codes = torch.clamp(torch.round(values / scale) + zero_point, bottom, top)
            codes[row, start:start + group] = group_codes
            deq[row, start:start + group] = (group_codes - zero_point) * scale
    return codes, deq


def all_e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from the 256 bit patterns."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    return torch.unique(values[torch.isfinite(values)])


@pytest.mark.parametrize("fmt, group_size, symmetric", INT_CASES)
def test_int_round_trip_matches_float64_reference(fmt, group_size, symmetric):
    w = gaussian_weight(seed=1, shift=0.01 if not symmetric else 0.0)
    q = quantize_weight(w, fmt, group_size, symmetric)
    ref_codes, ref_deq = reference_int_round_trip(w, fmt, group_size, symmetric)
    # Float32 scales may flip an exact rounding tie; allow a handful of codes to differ by one.
    same = (q.qweight.double() == ref_codes).double().mean().item()
    assert same >= 0.999, f"only {same:.4f} of codes match the float64 reference"
    assert (q.qweight.double() - ref_codes).abs().max().item() <= 1
    deq = dequantize_weight(q, torch.float64)
    ref_error = (w.double() - ref_deq).norm().item()
    assert abs((w.double() - deq).norm().item() - ref_error) <= 1e-3 * ref_error
    errors = weight_error(w, q)
    assert errors["rel_error"] == pytest.approx(ref_error / w.double().norm().item(), rel=1e-3)


@pytest.mark.parametrize("fmt, group_size, symmetric", INT_CASES)
def test_int_codes_in_range_and_shapes(fmt, group_size, symmetric):
    w = gaussian_weight(seed=2, shift=0.03)
    q = quantize_weight(w, fmt, group_size, symmetric)
    low, high = {("int8", True): (-127, 127), ("int4", True): (-8, 7), ("int4", False): (0, 15)}[(fmt, symmetric)]
    assert q.qweight.dtype == torch.int8 and tuple(q.qweight.shape) == tuple(w.shape) == q.shape
    assert low <= q.qweight.min().item() and q.qweight.max().item() <= high
    # The extreme codes are used: the scale maps the largest weight to the top of the range.
    assert q.qweight.max().item() == high
    n_groups = 1 if group_size is None else w.shape[1] // group_size
    assert q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == ((w.shape[0],) if fmt == "int8" else (w.shape[0], n_groups))
    if symmetric:
        assert q.zero is None
    else:
        assert q.zero.dtype == torch.int8 and tuple(q.zero.shape) == (w.shape[0], n_groups)
        assert 0 <= q.zero.min().item() and q.zero.max().item() <= 15


def test_fp8_values_representable_and_match_nearest_reference():
    w = gaussian_weight(seed=3)
    q = quantize_weight(w, "fp8")
    assert q.qweight.dtype == torch.float8_e4m3fn and q.zero is None and q.group_size is None
    table = all_e4m3_values()  # sorted finite values
    stored = q.qweight.double()
    assert torch.isin(stored, table).all()
    assert stored.abs().max().item() == FP8_E4M3_MAX  # each row's absmax lands on 448
    # Reference: scale = absmax / 448 in float64, then the nearest table entry.
    ref_scale = w.double().abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX
    scaled = w.double() / ref_scale
    nearest = table[(scaled.unsqueeze(-1) - table).abs().argmin(dim=-1)]
    same = (nearest == stored).double().mean().item()
    assert same >= 0.999, f"only {same:.4f} of fp8 values are the nearest representable value"
    ref_error = (w.double() - nearest * ref_scale).norm().item()
    assert (w.double() - dequantize_weight(q, torch.float64)).norm().item() == pytest.approx(ref_error, rel=1e-3)


@pytest.mark.parametrize("group_size", [None, 32, 64, 128])
def test_nf4_round_trip_matches_blockwise_reference(group_size):
    w = gaussian_weight(seed=5)
    q = quantize_weight(w, "nf4", group_size)
    block = group_size or 64
    assert q.group_size == block and q.qweight.dtype == torch.uint8 and q.qweight.numel() == w.numel() // 2
    # Reference: per block of `block` consecutive row elements, absmax-normalise and take the nearest NF4 level.
    levels = q.quant_state.code.double()
    assert levels.numel() == 16 and levels.min().item() == -1.0 and levels.max().item() == 1.0
    blocks = w.double().reshape(-1, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    nearest = levels[(((blocks / absmax).unsqueeze(-1) - levels).abs()).argmin(dim=-1)]
    ref_deq = (nearest * absmax).reshape(w.shape)
    deq = dequantize_weight(q, torch.float64)
    same = (torch.isclose(deq, ref_deq, rtol=1e-5, atol=1e-8)).double().mean().item()
    assert same >= 0.99, f"only {same:.4f} of nf4 values match the blockwise reference"
    assert weight_error(w, q)["rel_error"] == pytest.approx((w.double() - ref_deq).norm().item() / w.norm().item(),
                                                             rel=2e-2)


@pytest.mark.parametrize("fmt, symmetric", [("int4", True), ("int4", False), ("nf4", True)])
def test_error_decreases_with_smaller_groups(fmt, symmetric):
    w = gaussian_weight(32, 512, seed=6)
    spreads = [weight_error(w, quantize_weight(w, fmt, g, symmetric))["of_spread"] for g in (32, 64, 128, 256)]
    assert spreads == sorted(spreads) and spreads[0] < 0.95 * spreads[-1], spreads


def test_asymmetric_beats_symmetric_on_shifted_weights():
    w = gaussian_weight(seed=7, shift=0.05)  # mean 0.05, std 0.02: every group is mostly positive
    sym = weight_error(w, quantize_weight(w, "int4", 64, True))["of_spread"]
    asym = weight_error(w, quantize_weight(w, "int4", 64, False))["of_spread"]
    assert asym < 0.7 * sym, (asym, sym)


def test_asymmetric_all_positive_groups_stay_within_half_a_step():
    # Every weight > 0: the zero point must still be representable, so every weight rounds to within scale / 2.
    w = gaussian_weight(seed=13).abs() + 0.05
    q = quantize_weight(w, "int4", 32, False)
    half_step = q.scale.repeat_interleave(32, dim=1) / 2  # [out, in]
    assert ((w - dequantize_weight(q)).abs() <= half_step * (1 + 1e-5)).all()
    ref_codes, _ = reference_int_round_trip(w, "int4", 32, False)
    assert (q.qweight.double() == ref_codes).double().mean().item() >= 0.999


def test_weight_error_definitions():
    w = gaussian_weight(seed=8, shift=0.01)
    q = quantize_weight(w, "int4", 32, False)
    diff = w.double() - dequantize_weight(q, torch.float64)
    errors = weight_error(w, q)
    assert errors["rel_error"] == pytest.approx((diff.pow(2).sum() / w.double().pow(2).sum()).sqrt().item(), rel=1e-9)
    assert errors["of_spread"] == pytest.approx((diff.pow(2).mean().sqrt() / w.double().std()).item(), rel=1e-9)
    assert errors["max_abs"] == pytest.approx(diff.abs().max().item(), rel=1e-9)


def test_quantize_codes_column_by_column_matches_whole_weight():
    # GPTQ rounds one column at a time with its group's scale fixed: that must give the RTN codes.
    w = gaussian_weight(seed=9, shift=0.01)
    for symmetric in (True, False):
        q = quantize_weight(w, "int4", 32, symmetric)
        for column in (0, 31, 32, 200):
            group = column // 32
            zero = None if symmetric else q.zero[:, group]
            codes = quantize_codes(w[:, column:column + 1], q.scale[:, group], zero, "int4")
            assert torch.equal(codes[:, 0], q.qweight[:, column])
    scale, zero = choose_scale_zero(w, "int8")
    assert zero is None and torch.equal(quantize_codes(w, scale, None, "int8"), quantize_weight(w, "int8").qweight)


def test_bf16_weight_and_zero_rows():
    w = gaussian_weight(seed=10)
    w[3] = 0.0
    q = quantize_weight(w.bfloat16(), "int4", 32, False)
    deq = dequantize_weight(q)
    assert torch.isfinite(deq).all() and torch.equal(deq[3], torch.zeros(w.shape[1]))
    assert dequantize_weight(q, torch.bfloat16).dtype == torch.bfloat16


def test_bytes_per_param():
    w = gaussian_weight(16, 256, seed=11)
    n = w.numel()
    assert bytes_per_param(quantize_weight(w, "int8")) == pytest.approx(1 + 16 * 2 / n)
    assert bytes_per_param(quantize_weight(w, "fp8"), scale_bytes=4) == pytest.approx(1 + 16 * 4 / n)
    assert bytes_per_param(quantize_weight(w, "int4", 128)) == pytest.approx(0.5 + 16 * 2 * 2 / n)
    assert bytes_per_param(quantize_weight(w, "int4", 32, False)) == pytest.approx(0.5 + 16 * 8 * (2 + 0.5) / n)
    assert bytes_per_param(quantize_weight(w, "nf4", 64)) == pytest.approx(0.5 + (n // 64) * 4 / n)


@pytest.mark.parametrize(
    "shape, fmt, group_size, symmetric, message",
    [
        ((8, 64), "int3", None, True, "unknown quantization format 'int3'"),
        ((8, 64), "int4", 48, True, "group_size 48 .* in_features 64"),
        ((8, 64), "nf4", 48, True, "group_size 48 .* in_features 64"),
        ((8, 4, 16), "int4", 16, True, r"2-D \[out, in\], got shape \(8, 4, 16\)"),
        ((8, 64), "int8", 32, True, "int8 is per output channel: group_size must be None, got 32"),
        ((8, 64), "fp8", 64, True, "fp8 is per output channel"),
        ((8, 64), "int8", None, False, "int8 is symmetric only"),
        ((8, 64), "nf4", 64, False, "nf4 is symmetric only"),
    ],
)
def test_bad_inputs_raise(shape, fmt, group_size, symmetric, message):
    with pytest.raises(ValueError, match=message):
        quantize_weight(torch.randn(*shape), fmt, group_size, symmetric)


def test_dequantize_and_error_reject_mismatches():
    w = gaussian_weight(8, 64, seed=12)
    q = quantize_weight(w, "int8")
    with pytest.raises(ValueError, match=r"weight shape \(8, 32\) does not match the quantized shape \(8, 64\)"):
        weight_error(w[:, :32], q)
    with pytest.raises(ValueError, match="unknown quantization format 'int2'"):
        dequantize_weight(QuantizedWeight("int2", q.qweight, q.scale, shape=q.shape))
