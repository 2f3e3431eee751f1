"""QuantLinear's native CPU kernels on odd shapes: the "aten" backend on the shapes that crash torch's packed kernels
unless padded, and the own AVX2 kernels on row, column and batch counts that do not fill their tiles.

torch 2.13's AVX-512 `_weight_int8pack_mm` segfaults or returns NaN/inf/garbage for K % 16 != 0 (any N, N = 16, 33,
37 included); `_convert_weight_to_int4pack_for_cpu` rejects N % 16 != 0. QuantLinear pads both dims to
`aten_padded_shape`. Each case runs in a child process (tests.native.isolated): should a kernel still crash on some
CPU, that case fails with the signal and the CPU's model and flags instead of killing the test run. The child prints
each shape before computing it, so the failure message shows the one that crashed.
"""

import pytest
import torch

from posttrain.quant import cpu_kernels
from posttrain.quant.linear import ATEN_PAD, QuantLinear, aten_padded_shape
from tests.native import isolated
from tests.unit.test_quant_linear import BF16_REL, FP32_REL, assert_matches, gen, make_qw, reference_weight

ROWS = (16, 17, 33, 37, 72)  # out_features: the rows of the bug report and their neighbours
BATCHES = (1, 3, 16)  # M: at K = 72 the unpadded int8 kernel gave garbage at M = 1 and segfaulted from M = 2
ACT_DTYPES = (torch.float32, torch.bfloat16)


def check_aten_layer(fmt: str, n: int, k: int, m: int, act_dtype: torch.dtype, group_size: int = 64):
    """One QuantLinear on the aten backend against x (rounded to bf16, as aten computes) @ W64^T + bias."""
    print(f"{fmt} out_features={n} in_features={k} batch={m} act_dtype={act_dtype} group={group_size}", flush=True)
    g = gen(n * 1000 + k + m)
    qw = make_qw(fmt, n, k, g, group_size, symmetric=bool(m % 2))
    bias = torch.randn(n, generator=g)
    layer = QuantLinear.from_quantized(qw, bias, act_dtype, backend="aten")
    n_padded, k_padded = aten_padded_shape(n, k)
    if fmt == "int8":
        assert tuple(layer.qweight.shape) == (n_padded, k_padded) and tuple(layer.scale.shape) == (n_padded,)
    else:
        assert layer.scales_and_zeros.shape[1] == n_padded
    x = torch.randn(m, k, generator=g).to(act_dtype)
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == act_dtype and y.shape == (m, n)
    ref = x.bfloat16().double() @ reference_weight(qw).T + bias.to(act_dtype).double()
    assert_matches(y, ref, BF16_REL)


def test_aten_padded_shape_rounds_both_dims_up_to_16():
    assert ATEN_PAD == 16
    assert aten_padded_shape(37, 72) == (48, 80)
    assert aten_padded_shape(16, 64) == (16, 64)
    assert aten_padded_shape(1, 1) == (16, 16)
    assert aten_padded_shape(4099, 4104) == (4112, 4112)


@pytest.mark.parametrize("k", [72, 136, 24, 64])  # K % 16 = 8, 8, 8 (crashed unpadded) and 0 (the control)
@isolated
def test_aten_int8_on_in_features_not_a_multiple_of_16(k):
    for n in ROWS:
        for m in BATCHES:
            for act_dtype in ACT_DTYPES:
                check_aten_layer("int8", n, k, m, act_dtype)


@pytest.mark.parametrize("group_size,k", [(32, 96), (64, 192), (128, 256)])
@isolated
def test_aten_int4_on_out_features_not_a_multiple_of_16(group_size, k):
    for n in ROWS:
        for m in BATCHES:
            for act_dtype in ACT_DTYPES:
                check_aten_layer("int4", n, k, m, act_dtype, group_size)


@isolated
def test_auto_backend_sends_int8_with_odd_in_features_to_padded_aten():
    """K = 72 is no multiple of the own kernels' 16 columns, so auto picks aten: the bug report's crashing case."""
    g = gen(3)
    qw = make_qw("int8", 37, 72, g)
    layer = QuantLinear.from_quantized(qw, None, torch.float32)
    assert layer.backend == "aten"
    x = torch.randn(3, 72, generator=g)
    assert_matches(layer(x), x.bfloat16().double() @ reference_weight(qw).T, BF16_REL)


@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("fp8", None), ("int4", 16), ("int4", 48)])
@isolated
def test_own_kernels_on_rows_columns_and_batches_that_do_not_fill_a_tile(fmt, group_size):
    """Rows not a multiple of the 4-row tile, K from one 16-column chunk up, M = 1 to 17 (fp32: exact arithmetic)."""
    if not cpu_kernels.available():
        pytest.skip(f"own CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    for n in (1, 5, 17, 33, 37):
        for k in ((16, 48, 80) if group_size in (None, 16) else (48, 144)):
            for m in (1, 3, 16, 17):
                print(f"own {fmt} out_features={n} in_features={k} batch={m} group={group_size}", flush=True)
                g = gen(n * 1000 + k + m)
                qw = make_qw(fmt, n, k, g, group_size or 64, symmetric=bool(m % 2))
                layer = QuantLinear.from_quantized(qw, None, torch.float32, backend="own")
                x = torch.randn(m, k, generator=g)
                assert_matches(layer(x), x.double() @ reference_weight(qw).T, FP32_REL)
