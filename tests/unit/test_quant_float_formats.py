"""The floating-point formats of quant.formats (fp16, fp8_e5m2, fp4, mxfp4, nvfp4): round trips against float64
references written here from the formats' scale rules, the nvfp4 tensor scale, error ordering, storage size, and the
errors raised for bad input, by quantize_weight and, naming the module, by quantize_model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from posttrain.quant import linear
from posttrain.quant.calibrate import quantize_model
from posttrain.quant.formats import bytes_per_param, dequantize_weight, quantize_weight, weight_error
from posttrain.quant.microscaling import nvfp4_quantize
from tests.unit.test_engine import tiny_hf

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def gaussian_weight(out_features=32, in_features=256, seed=0):
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.02


def nearest_fp4(x: torch.Tensor) -> torch.Tensor:
    """The nearest FP4 E2M1 value of each element of x (float64), saturating at +-6."""
    magnitude = x.abs().clamp(max=6.0)
    return torch.sign(x) * FP4_GRID[(magnitude.unsqueeze(-1) - FP4_GRID).abs().argmin(dim=-1)]


def reference_fp4_family(w: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """Dequantized weight by each format's scale rule, in float64, one block of `group` row elements at a time."""
    blocks = w.double().reshape(w.shape[0], -1, group)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp4":  # exact scale: the block's absmax maps to 6
        scale = torch.where(amax > 0, amax / 6, torch.ones_like(amax))
    elif fmt == "mxfp4":  # a power of two: 2^(floor(log2(amax)) - 2), 2 being FP4's largest exponent
        scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    else:  # nvfp4: an E4M3 block scale times the power of two at or above amax / (6 * 448)
        tensor_scale = 2.0 ** math.ceil(math.log2(w.double().abs().max().item() / (6 * 448)))
        scale = (amax / 6 / tensor_scale).float().to(torch.float8_e4m3fn).double() * tensor_scale
    return (nearest_fp4(blocks / scale) * scale).reshape(w.shape)


@pytest.mark.parametrize("fmt, group_size, block, scale_dtype", [
    ("fp4", None, 32, torch.float32), ("fp4", 16, 16, torch.float32), ("fp4", 64, 64, torch.float32),
    ("mxfp4", None, 32, torch.uint8), ("nvfp4", None, 16, torch.float8_e4m3fn), ("nvfp4", 16, 16, torch.float8_e4m3fn),
])
def test_fp4_family_matches_float64_reference(fmt, group_size, block, scale_dtype):
    w = gaussian_weight(seed=1)
    q = quantize_weight(w, fmt, group_size)
    assert (q.fmt, q.group_size, q.shape) == (fmt, block, tuple(w.shape))
    assert q.qweight.dtype == torch.uint8 and tuple(q.qweight.shape) == tuple(w.shape) and q.qweight.max() <= 15
    assert q.scale.dtype == scale_dtype and tuple(q.scale.shape) == (w.shape[0], w.shape[1] // block)
    assert (q.tensor_scale is not None) == (fmt == "nvfp4")
    reference = reference_fp4_family(w, fmt, block)
    deq = dequantize_weight(q, torch.float64)
    # fp4's scale is fp32 (the reference's float64): equal to its rounding; ties may flip a code or two.
    same = torch.isclose(deq, reference, rtol=1e-6, atol=0).double().mean().item()
    assert same >= 0.999, f"only {same:.4f} of {fmt} values equal the float64 reference"
    assert weight_error(w, q)["max_abs"] <= (w.double() - reference).abs().max().item() * 1.01


def test_nvfp4_tensor_scale_is_the_power_of_two_at_or_above_amax_over_6_times_448():
    for seed in range(5):
        w = gaussian_weight(seed=seed) * (10.0 ** (seed - 2))
        q = quantize_weight(w, "nvfp4")
        target = w.abs().max().item() / (6 * 448)
        mantissa, _ = math.frexp(q.tensor_scale.item())
        assert mantissa == 0.5 and target <= q.tensor_scale.item() < 2 * target
        block_scales = q.scale.float()
        assert block_scales.max().item() <= 448 and block_scales.max().item() > 224  # E4M3's top binade is used
    w = gaussian_weight(seed=7)
    w[0, 0] = 2688 * 2.0 ** -10  # amax / (6 * 448) exactly a power of two: the scale is that power, not twice it
    assert quantize_weight(w, "nvfp4").tensor_scale.item() == 2.0 ** -10
    assert quantize_weight(torch.zeros(4, 32), "nvfp4").tensor_scale.item() == 1.0
    with pytest.raises(ValueError, match="nvfp4 tensor_scale must be one positive value"):
        nvfp4_quantize(w, tensor_scale=torch.tensor(0.0))


def test_fp8_e5m2_and_fp16_codes():
    w = gaussian_weight(seed=2)
    q = quantize_weight(w, "fp8_e5m2")
    assert q.qweight.dtype == torch.float8_e5m2 and q.group_size is None and tuple(q.scale.shape) == (w.shape[0],)
    scale = w.abs().amax(dim=1) / 57344.0
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.qweight.view(torch.uint8), (w / scale[:, None]).to(torch.float8_e5m2).view(torch.uint8))
    assert (q.qweight.float().abs().amax(dim=1) == 57344.0).all()  # each row's absmax lands on the largest value
    assert torch.equal(dequantize_weight(q), q.qweight.float() * scale[:, None])
    half = quantize_weight(w, "fp16")
    assert half.scale is None and half.qweight.dtype == torch.float16 and torch.equal(half.qweight, w.half())
    assert torch.equal(dequantize_weight(half), w.half().float())


def test_rounding_the_scale_costs_and_formats_order_by_error():
    w = gaussian_weight(64, 1024, seed=3)
    spread = {label: weight_error(w, quantize_weight(w, fmt, group))["of_spread"]
              for label, fmt, group in [("fp16", "fp16", None), ("fp8", "fp8", None), ("e5m2", "fp8_e5m2", None),
                                        ("fp4 g16", "fp4", 16), ("nvfp4", "nvfp4", None), ("fp4 g32", "fp4", 32),
                                        ("mxfp4", "mxfp4", None)]}
    assert spread["fp16"] < 1e-3 < spread["fp8"] < spread["e5m2"] < spread["fp4 g16"]
    assert spread["fp4 g16"] < spread["nvfp4"] and spread["fp4 g32"] < spread["mxfp4"]  # E4M3 / E8M0 scale rounding
    assert spread["nvfp4"] < spread["mxfp4"]  # smaller blocks and finer scales
    assert 0.08 < spread["mxfp4"] < 0.14, spread


def test_bytes_per_param_float_formats():
    w = gaussian_weight(16, 256, seed=4)
    n = w.numel()
    assert bytes_per_param(quantize_weight(w, "fp16")) == 2.0
    assert bytes_per_param(quantize_weight(w, "fp8_e5m2"), scale_bytes=4) == pytest.approx(1 + 16 * 4 / n)
    assert bytes_per_param(quantize_weight(w, "fp4", 32), scale_bytes=4) == pytest.approx(0.5 + 4 / 32)
    assert bytes_per_param(quantize_weight(w, "fp4", 32)) == pytest.approx(0.5 + 2 / 32)
    # Fixed-width scales ignore scale_bytes: one E8M0 byte per 32, one E4M3 byte per 16 plus a 4-byte tensor scale.
    assert bytes_per_param(quantize_weight(w, "mxfp4"), scale_bytes=4) == pytest.approx(0.5 + 1 / 32)
    assert bytes_per_param(quantize_weight(w, "nvfp4"), scale_bytes=4) == pytest.approx(0.5 + 1 / 16 + 4 / n)


def poisoned(value: float) -> torch.Tensor:
    w = gaussian_weight(8, 64, seed=5)
    w[2, 5] = value
    return w


@pytest.mark.parametrize("w, fmt, group_size, symmetric, message", [
    (gaussian_weight(8, 64), "fp4", 48, True, "fp4 group_size 48 must be positive and divide .* in_features 64"),
    (gaussian_weight(8, 40), "nvfp4", None, True, "nvfp4 group_size 16 must be positive and divide .* in_features 40"),
    (gaussian_weight(8, 64), "mxfp4", 16, True, "mxfp4 has fixed blocks of 32: group_size must be None or that"),
    (gaussian_weight(8, 64), "fp16", 32, True, "fp16 has no scale: group_size must be None, got 32"),
    (gaussian_weight(8, 64), "fp8_e5m2", 32, True, "fp8_e5m2 is per output channel: group_size must be None"),
    (gaussian_weight(8, 64), "fp4", 32, False, "fp4 is symmetric only"),
    (poisoned(float("nan")), "nvfp4", None, True, r"nvfp4: 1 NaN or infinite value\(s\), first at index \(2, 5\)"),
    (poisoned(float("inf")), "fp16", None, True, r"fp16: 1 NaN or infinite value\(s\), first at index \(2, 5\)"),
    (poisoned(float("nan")), "int8", None, True, r"int8: 1 NaN or infinite value\(s\), first at index \(2, 5\)"),
    (poisoned(70000.0), "fp16", None, True, r"fp16: 1 weight\(s\) beyond \+-65504, first at index \(2, 5\)"),
])
def test_bad_inputs_raise(w, fmt, group_size, symmetric, message):
    with pytest.raises(ValueError, match=message):
        quantize_weight(w, fmt, group_size, symmetric)


def test_quantize_model_names_the_module_and_shape_and_changes_no_weight():
    model = tiny_hf("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj weight \(64, 128\): mxfp4: 1 NaN"):
        quantize_model(model, "rtn", "mxfp4")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj weight \(64, 64\): fp4 group_size 48"):
        quantize_model(model, "rtn", "fp4", 48)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0, equal_nan=True)  # checked before writing
    with pytest.raises(ValueError, match="GPTQ supports fmt in .*'int4'.*got 'nvfp4'"):
        quantize_model(model, "gptq", "nvfp4", calib_ids=torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("fmt, group_size", [("fp16", None), ("fp8_e5m2", None), ("fp4", 32), ("mxfp4", None),
                                             ("nvfp4", None)])
def test_quant_linear_reference_path_over_several_row_blocks(monkeypatch, fmt, group_size):
    """The "chunked" path decodes rows 7 at a time here (block scales, per-row scales and the one nvfp4 tensor scale
    sliced with them): the product equals F.linear on the whole dequantized weight, bias included."""
    monkeypatch.setattr(linear, "CHUNK_BYTES", 7 * 64 * 4)  # 7 fp32 rows of 64 columns per block
    q = quantize_weight(gaussian_weight(30, 64, seed=8), fmt, group_size)
    bias = torch.randn(30, generator=torch.Generator().manual_seed(9))
    module = linear.QuantLinear.from_quantized(q, bias, torch.float32)
    assert (module.backend, module.fmt) == ("chunked", fmt)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(10))
    expected = torch.nn.functional.linear(x, dequantize_weight(q), bias)
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6)  # fp32 sums in another order
    for backend in ("own", "aten", "bnb"):
        with pytest.raises(ValueError, match=f"{fmt} has no fused kernel|'bnb' backend serves nf4 only"):
            linear.QuantLinear.from_quantized(q, bias, torch.float32, backend=backend)
