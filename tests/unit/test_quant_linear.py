"""QuantLinear / DenseLinear / own CPU kernels against float64 references computed here from the canonical fields."""

import pytest
import torch
from torch import nn

from posttrain.quant import cpu_kernels
from posttrain.quant.formats import QuantizedWeight
from posttrain.quant.linear import BF16Linear, DenseLinear, QuantLinear, swap_dense_linears, swap_linears
from tests.native import isolated  # a native crash fails the one test (with the CPU named), not the run

N_ODD, K = 37, 256
FP32_REL = 1e-5  # fp32 activations: only accumulation-order rounding
BF16_REL = 1.5e-2  # bf16 output (2^-9) plus, on aten, bf16 scales (2^-9 each)
Q8_REL = 3e-2  # own_q8: activations rounded to int8 per 32 columns (measured up to ~1.1e-2 on these shapes)
TOLERANCE = {"own": FP32_REL, "chunked": FP32_REL, "bnb": FP32_REL, "aten": BF16_REL, "own_q8": Q8_REL}


# ---- canonical weights (random codes and scales) and their float64 dequantization, written independently ----


def make_qw(fmt: str, n: int, k: int, gen: torch.Generator, group_size: int = 64, symmetric: bool = True):
    if fmt == "int8":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedWeight("int8", q, torch.rand(n, generator=gen) * 0.02 + 0.001, shape=(n, k))
    if fmt == "fp8":
        q = (torch.randn(n, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        return QuantizedWeight("fp8", q, torch.rand(n, generator=gen) * 0.01 + 0.001, shape=(n, k))
    groups = k // group_size
    scale = torch.rand(n, groups, generator=gen) * 0.1 + 0.01
    if symmetric:
        q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedWeight("int4", q, scale, None, group_size, True, (n, k))
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
    zero = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.int8)
    return QuantizedWeight("int4", q, scale, zero, group_size, False, (n, k))


def reference_weight(qw: QuantizedWeight) -> torch.Tensor:
    """float64 [N, K] from the formats.py contract."""
    if qw.fmt in ("int8", "fp8"):
        return qw.qweight.to(torch.float64) * qw.scale.double()[:, None]
    q = qw.qweight.double()
    if not qw.symmetric:
        q = q - qw.zero.double().repeat_interleave(qw.group_size, dim=1)
    return q * qw.scale.double().repeat_interleave(qw.group_size, dim=1)


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rel: float):
    assert y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err:.3g} vs max |ref| {ref.abs().max().item():.3g}"


@pytest.fixture(scope="module")
def own_kernels():
    """Build (or load the cached) extension once for the module, outside the per-test time."""
    if not cpu_kernels.available():
        pytest.skip(f"own CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


INT4_CASES = [(g, sym) for g in (32, 64, 128) for sym in (True, False)]
FORMAT_CASES = [("int8", 64, True), ("fp8", 64, True)] + [("int4", g, sym) for g, sym in INT4_CASES]
BACKENDS_FOR = {"int8": ("own", "aten"), "fp8": ("own", "chunked"), "int4": ("own", "own_q8", "aten", "chunked")}
OWN = ("own", "own_q8")
CASES = [(fmt, g, sym, be) for fmt, g, sym in FORMAT_CASES for be in BACKENDS_FOR[fmt]]


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("fmt,group_size,symmetric,backend", CASES)
def test_quant_linear_matches_float64_reference(fmt, group_size, symmetric, backend, m, request):
    if backend in OWN:
        request.getfixturevalue("own_kernels")
    g = gen(m)
    qw = make_qw(fmt, N_ODD, K, g, group_size, symmetric)
    bias = torch.randn(N_ODD, generator=g)
    x = torch.randn(m, K, generator=g)
    layer = QuantLinear.from_quantized(qw, bias, torch.float32, backend=backend)
    assert layer.backend == backend
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == torch.float32
    # aten computes in bf16 whatever act_dtype is (its fp32 path is far slower): compare from bf16-rounded x.
    x_seen = x.bfloat16() if backend == "aten" else x
    ref = x_seen.double() @ reference_weight(qw).T + bias.double()
    assert_matches(y, ref, TOLERANCE[backend])


@pytest.mark.parametrize("fmt,group_size,symmetric,backend", [c for c in CASES if c[3] != "aten"])
def test_bf16_activations_give_bf16_output(fmt, group_size, symmetric, backend, request):
    if backend in OWN:
        request.getfixturevalue("own_kernels")
    g = gen(7)
    qw = make_qw(fmt, N_ODD, K, g, group_size, symmetric)
    x = torch.randn(2, 3, K, generator=g).bfloat16()  # leading dims are kept
    layer = QuantLinear.from_quantized(qw, None, torch.bfloat16, backend=backend)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, N_ODD)
    ref = x.double().reshape(6, K) @ reference_weight(qw).T
    assert_matches(y.reshape(6, N_ODD), ref, max(BF16_REL, TOLERANCE[backend]))


def test_own_int4_group_size_need_not_be_a_power_of_two(own_kernels):
    g = gen(9)
    qw = make_qw("int4", N_ODD, 192, g, group_size=48, symmetric=False)
    x = torch.randn(3, 192, generator=g)
    layer = QuantLinear.from_quantized(qw, None, torch.float32)
    assert layer.backend == "own"
    assert_matches(layer(x), x.double() @ reference_weight(qw).T, FP32_REL)


@pytest.mark.parametrize("fmt,symmetric,backend", [("int8", True, "own"), ("fp8", True, "own"), ("int4", True, "own"),
                                                    ("int4", False, "own"), ("int4", False, "own_q8")])
def test_own_kernels_split_rows_across_threads(fmt, symmetric, backend, own_kernels):
    """Enough rows (N odd, > 64k weights per task) that at::parallel_for splits them between two threads."""
    n, k = 301, 512
    g = gen(10)
    qw = make_qw(fmt, n, k, g, group_size=128, symmetric=symmetric)
    x = torch.randn(2, k, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = QuantLinear.from_quantized(qw, None, torch.float32, backend=backend)(x)
    finally:
        torch.set_num_threads(threads)
    assert_matches(y, x.double() @ reference_weight(qw).T, TOLERANCE[backend])


@pytest.mark.parametrize("op", ["fp32", "bf16", "int8", "int4", "int4_q8", "fp8"])
def test_own_ops_have_consistent_schema_and_fake_kernels(op, own_kernels):
    """torch.library.opcheck: schema, fake (meta) kernel and real kernel agree, so torch.compile can trace them."""
    g = gen(13)
    x, bias = torch.randn(3, 128, generator=g), torch.randn(37, generator=g)
    if op in ("fp32", "bf16"):
        dtype = torch.float32 if op == "fp32" else torch.bfloat16
        args = (cpu_kernels.pack_dense(torch.randn(37, 128, generator=g), dtype),)
    elif op in ("int8", "fp8"):
        qw = make_qw(op, 37, 128, g)
        args = getattr(cpu_kernels, f"pack_{op}")(qw.qweight, qw.scale)
    else:
        qw = make_qw("int4", 37, 128, g, 64, symmetric=False)
        pack = cpu_kernels.pack_int4_q8 if op == "int4_q8" else cpu_kernels.pack_int4
        args = (*pack(qw.qweight, qw.scale, qw.zero, 64), 64)
    torch.library.opcheck(getattr(torch.ops.posttrain_quant, f"gemv_{op}").default, (x, *args, 37, bias))


@pytest.mark.parametrize("backend", ["own", "own_q8"])
def test_own_int4_propagates_non_finite_activations(backend, own_kernels):
    qw = make_qw("int4", N_ODD, K, gen(14), 64)
    x = torch.randn(3, K, generator=gen(15))
    x[1, 5], x[2, 100] = float("nan"), float("inf")
    y = QuantLinear.from_quantized(qw, None, torch.float32, backend=backend)(x)
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()


@isolated
def test_aten_int4_kernel_dequantizes_as_u_minus_8_times_scale_plus_zero():
    """Pins the torch convention _aten_int4_pack relies on: w = (u - 8) * scale + zero, scales_and_zeros [G, N, 2]."""
    g = gen(1)
    n, k, group = 32, 128, 32
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(k // group, n, generator=g) + 0.5, torch.randn(k // group, n, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    x = torch.randn(3, k, generator=g)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, torch.stack([scale, zero], -1))
    w = (u.double() - 8) * scale.double().T.repeat_interleave(group, 1) + zero.double().T.repeat_interleave(group, 1)
    assert_matches(y, x.double() @ w.T, FP32_REL)


def test_fp8_kernel_decodes_every_finite_code(own_kernels):
    # All 254 finite E4M3 codes (subnormals, both signs, up to +-448) in each row, in a different order per row.
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)] + [0, 0x80], dtype=torch.uint8)
    g = gen(2)
    q = torch.stack([codes[torch.randperm(256, generator=g)] for _ in range(5)]).view(torch.float8_e4m3fn)
    qw = QuantizedWeight("fp8", q, torch.rand(5, generator=g) + 0.5, shape=(5, 256))
    x = torch.randn(16, 256, generator=g)
    y = QuantLinear.from_quantized(qw, None, torch.float32, backend="own")(x)
    assert_matches(y, x.double() @ reference_weight(qw).T, FP32_REL)
    # one-hot activations read single weights back exactly
    eye = torch.eye(256)[:16]
    assert torch.equal(QuantLinear.from_quantized(qw, None, torch.float32, backend="own")(eye),
                       (q[:, :16].float() * qw.scale[:, None]).T)


@pytest.mark.parametrize("fmt,k,group_size", [("int8", 72, None), ("fp8", 72, None), ("int4", 96, 24)])
@isolated
def test_auto_backend_handles_shapes_the_own_kernels_reject(fmt, k, group_size):
    g = gen(3)
    if fmt == "int4":  # group 24 is neither a power of two (own) nor an aten group size
        qw = QuantizedWeight("int4", torch.randint(0, 16, (N_ODD, k), generator=g, dtype=torch.int8),
                             torch.rand(N_ODD, k // group_size, generator=g),
                             torch.randint(0, 16, (N_ODD, k // group_size), generator=g, dtype=torch.int8),
                             group_size, False, (N_ODD, k))
    else:
        qw = make_qw(fmt, N_ODD, k, g)
    layer = QuantLinear.from_quantized(qw, None, torch.float32)
    assert layer.backend not in OWN
    x = torch.randn(3, k, generator=g)
    ref = (x.bfloat16() if layer.backend == "aten" else x).double() @ reference_weight(qw).T
    assert_matches(layer(x), ref, TOLERANCE[layer.backend])
    with pytest.raises(RuntimeError, match="own kernel unusable"):
        QuantLinear.from_quantized(qw, None, torch.float32, backend="own")


def test_auto_backend_keeps_the_arithmetic_weight_only(own_kernels):
    """auto never picks own_q8 (it rounds the activations too); it is there by name only."""
    g = gen(12)
    assert QuantLinear.from_quantized(make_qw("int4", 8, 128, g, 32), None, torch.float32).backend == "own"
    assert QuantLinear.from_quantized(make_qw("int4", 8, 128, g, 32), None, torch.float32,
                                      "own_q8").backend == "own_q8"
    assert QuantLinear.from_quantized(make_qw("int4", 8, 96, g, 32), None, torch.float32).backend == "own"
    assert QuantLinear.from_quantized(make_qw("int8", 8, 128, g), None, torch.float32).backend == "own"


def test_auto_backend_falls_back_without_extension(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert QuantLinear.from_quantized(make_qw("int8", 16, 64, gen()), None, torch.float32).backend == "aten"
    assert QuantLinear.from_quantized(make_qw("fp8", 16, 64, gen()), None, torch.float32).backend == "chunked"


def test_build_reports_missing_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    ok, reason = cpu_kernels._build()
    assert not ok and ("compiler" in reason or "CPU lacks" in reason)


def test_unavailable_extension_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_state", {})  # a fresh process as far as the loader knows
    monkeypatch.setattr(cpu_kernels, "_build", lambda: (False, "no C++ compiler on PATH (set CXX)"))
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        assert not cpu_kernels.available() and not cpu_kernels.available()
    assert [r.getMessage().count("no C++ compiler") for r in caplog.records] == [1]
    assert "compiler" in cpu_kernels.unavailable_reason()


def test_chunked_path_bounds_the_dequantized_block(monkeypatch):
    """Many small row blocks must give the same result as one (the block size is a memory bound, not a result)."""
    import posttrain.quant.linear as linear_mod

    monkeypatch.setattr(linear_mod, "CHUNK_BYTES", 5 * K * 4)  # 5 rows per block: 37 rows -> 8 blocks
    qw = make_qw("fp8", N_ODD, K, gen(4))
    x = torch.randn(2, K, generator=gen(5))
    y = QuantLinear.from_quantized(qw, None, torch.float32, backend="chunked")(x)
    assert_matches(y, x.double() @ reference_weight(qw).T, FP32_REL)


@isolated
def test_nf4_through_bitsandbytes_matches_decoded_codes():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    g = gen(6)
    w = torch.randn(N_ODD, K, generator=g)
    packed, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    qw = QuantizedWeight("nf4", packed, None, shape=(N_ODD, K), quant_state=state)
    # Independent decode: two codes per byte, first in the high nibble; value = code table[code] * block absmax.
    flat = packed.flatten()
    codes = torch.stack([flat >> 4, flat & 15], dim=-1).flatten()[: N_ODD * K].long()
    w_ref = (state.code.double()[codes] * state.absmax.double().repeat_interleave(64)).view(N_ODD, K)
    bias = torch.randn(N_ODD, generator=g)
    x = torch.randn(3, K, generator=g)
    with torch.no_grad():
        y = QuantLinear.from_quantized(qw, bias, torch.float32)(x)
    assert_matches(y, x.double() @ w_ref.T + bias.double(), FP32_REL)


@pytest.mark.parametrize(
    "fmt,symmetric", [("int8", True), ("fp8", True), ("int4", True), ("int4", False), ("nf4", True)]
)
def test_weights_from_formats_quantize_weight(fmt, symmetric):
    """The producer of QuantizedWeight (formats.quantize_weight) feeds QuantLinear as is, on the auto backend."""
    from posttrain.quant.formats import dequantize_weight, quantize_weight

    if fmt == "nf4":
        pytest.importorskip("bitsandbytes")
    g = gen(11)
    qw = quantize_weight(torch.randn(N_ODD, K, generator=g), fmt, group_size=64 if fmt == "int4" else None,
                         symmetric=symmetric)
    layer = QuantLinear.from_quantized(qw, None, torch.float32)
    x = torch.randn(3, K, generator=g)
    x_seen = x.bfloat16() if layer.backend == "aten" else x
    with torch.no_grad():
        y = layer(x)
    ref = x_seen.double() @ dequantize_weight(qw, torch.float64).T
    assert_matches(y, ref, TOLERANCE[layer.backend])


@pytest.mark.parametrize("backend", ["own", "torch"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_dense_linear(backend, weight_dtype, act_dtype, request):
    if backend == "own":
        request.getfixturevalue("own_kernels")
    g = gen(8)
    linear = nn.Linear(K, N_ODD)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(N_ODD, K, generator=g))
        linear.bias.copy_(torch.randn(N_ODD, generator=g))
    layer = DenseLinear.from_linear(linear, act_dtype, weight_dtype, backend=backend)
    assert layer.backend == backend
    x = torch.randn(2, 3, K, generator=g).to(act_dtype)
    y = layer(x)
    assert y.dtype == act_dtype and y.shape == (2, 3, N_ODD)
    # own: fp32 math on the stored weights and fp32 bias; torch: everything rounded to weight_dtype first
    rounded = (lambda t: t) if backend == "own" else (lambda t: t.to(weight_dtype))
    ref = rounded(x).double() @ linear.weight.to(weight_dtype).double().T + rounded(linear.bias).double()
    exact = (backend == "own" and act_dtype == torch.float32) or weight_dtype == act_dtype == torch.float32
    assert_matches(y.reshape(6, N_ODD), ref.reshape(6, N_ODD), FP32_REL if exact else BF16_REL)


def test_bf16_linear_is_dense_linear_with_bf16_weights():
    layer = BF16Linear.from_linear(nn.Linear(K, 8), torch.float32)
    assert layer.weight_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="DenseLinear"):
        BF16Linear(torch.randn(8, K), None, torch.float32, weight_dtype=torch.float32)


# ---- swapping modules ----


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(64, 48, bias=True)
        self.o_proj = nn.Linear(48, 64, bias=False)
        self.norm = nn.LayerNorm(64)

    def forward(self, x):
        return self.norm(x + self.o_proj(torch.relu(self.q_proj(x))))


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(64, 80, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def test_swap_linears_replaces_exactly_the_named_modules_and_keeps_bias():
    torch.manual_seed(0)
    model = TinyModel()
    names = ["layers.0.q_proj", "layers.1.o_proj", "lm_head"]
    quantized = {name: make_qw("int8", *model.get_submodule(name).weight.shape, gen(i)) for i, name in enumerate(names)}
    untouched = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in names}
    reference = TinyModel()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():  # the reference carries the dequantized weights in float64
        for name, qw in quantized.items():
            reference.get_submodule(name).weight.copy_(reference_weight(qw).float())
    reference.double()

    swap_linears(model, quantized, torch.float32)

    for name in names:
        assert isinstance(model.get_submodule(name), QuantLinear)
    for name, module in untouched.items():
        assert model.get_submodule(name) is module
    kept_bias = reference.get_submodule("layers.0.q_proj").bias.float()
    assert torch.equal(model.get_submodule("layers.0.q_proj").bias, kept_bias)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        y, ref = model(x), reference(x.double())
    assert_matches(y, ref, 1e-4)


def test_swap_linears_rejects_bad_names_without_changing_anything():
    model = TinyModel()
    qw = make_qw("int8", 48, 64, gen())
    with pytest.raises(KeyError, match="layers.0.k_proj"):
        swap_linears(model, {"layers.0.q_proj": qw, "layers.0.k_proj": qw}, torch.float32)
    assert isinstance(model.layers[0].q_proj, nn.Linear)  # nothing replaced before the error
    with pytest.raises(TypeError, match="layers.0.norm"):
        swap_linears(model, {"layers.0.norm": qw}, torch.float32)
    with pytest.raises(ValueError, match="layers.0.o_proj"):
        swap_linears(model, {"layers.0.o_proj": qw}, torch.float32)  # shape (48, 64) vs (64, 48)
    with pytest.raises(KeyError, match="nope"):
        swap_dense_linears(model, ["nope"], torch.float32)


def test_swap_dense_linears_replaces_the_named_modules():
    model = TinyModel()
    head = model.lm_head
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
    swap_dense_linears(model, ["layers.0.q_proj", "lm_head"], torch.float32, weight_dtype=torch.float32)
    assert isinstance(model.layers[0].q_proj, DenseLinear) and isinstance(model.lm_head, DenseLinear)
    assert isinstance(model.layers[1].q_proj, nn.Linear) and model.lm_head is not head
    with torch.no_grad():
        assert_matches(model(x), expected.double(), 1e-5)
