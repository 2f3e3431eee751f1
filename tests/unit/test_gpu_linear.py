"""TritonQuantLinear and swap_linears_triton on CPU, with the Triton kernels run by the interpreter.

The kernels are a private copy of triton_kernels.py loaded with the interpreter forced on, by the loader of
test_triton_kernels.py (its docstring says why a plain import cannot be trusted to be interpreted). Every result
is compared with a float64 computation written out here from the canonical QuantizedWeight: codes, scales and
zero points, dequantized group by group, never through formats.dequantize_weight or the kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.test_triton_kernels import _load_kernels  # also skips this file when triton is absent

from posttrain.quant.formats import quantize_weight
from posttrain.quant.gpu_linear import (TritonQuantLinear, build_triton_linears, replace_modules,
                                        swap_linears_triton)

# |y - ref| <= RTOL |ref| + ATOL max|ref|: RTOL covers rounding the output to its dtype, plus (bf16/fp16) the
# second rounding when the bias is added in that dtype; ATOL the fp32 accumulation over K.
RTOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}
ATOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.fixture(scope="module")
def tk():
    module = _load_kernels(True, "_triton_kernels_interpreted_for_gpu_linear")
    assert module.interpreter_active()
    return module


def dequantize_f64(qw) -> torch.Tensor:
    """The float64 weight [out, in] a QuantizedWeight stands for, one group of columns at a time."""
    if qw.fmt == "int8":
        return qw.qweight.double() * qw.scale.double()[:, None]
    out_features, in_features = qw.shape
    w = torch.empty(out_features, in_features, dtype=torch.float64)
    for g in range(in_features // qw.group_size):
        cols = slice(g * qw.group_size, (g + 1) * qw.group_size)
        zero = 0.0 if qw.zero is None else qw.zero[:, g : g + 1].double()
        w[:, cols] = (qw.qweight[:, cols].double() - zero) * qw.scale[:, g : g + 1].double()
    return w


def assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert y.dtype == dtype and y.shape == ref.shape, f"{what}: got {y.dtype} {tuple(y.shape)}"
    bound = RTOL[dtype] * ref.abs() + ATOL[dtype] * ref.abs().max()
    err = (y.double() - ref).abs()
    assert torch.all(err <= bound), f"{what}: max err {err.max():.3g}, worst err/bound {(err / bound).max():.3g}"


QUANT_CASES = [("int8", None, True), ("int4", 32, True), ("int4", 32, False), ("int4", 16, False)]


@pytest.mark.parametrize("case", range(len(QUANT_CASES)))
def test_forward_matches_float64_reference(tk, case):
    """Decode (M = 1, the gemv kernel) and prefill-like (M = 6 over leading dims [2, 3], the gemm kernel) inputs,
    in fp32, fp16 and bf16, with a bias (and one case without)."""
    fmt, group_size, symmetric = QUANT_CASES[case]
    gen = torch.Generator().manual_seed(case)
    out_features, in_features = 24, 64
    qw = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.05, fmt, group_size, symmetric)
    bias = None if group_size == 16 else torch.randn(out_features, generator=gen) * 0.1
    layer = TritonQuantLinear(qw, bias, "cpu", kernels=tk)
    w64 = dequantize_f64(qw)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for lead in ((1,), (2, 3)):
            x = torch.randn(*lead, in_features, generator=gen).to(dtype)
            ref = x.double() @ w64.T + (0.0 if bias is None else bias.to(dtype).double())
            assert_close(layer(x), ref, dtype, f"{fmt} G={group_size} sym={symmetric} {dtype} x{tuple(x.shape)}")


def test_layout_and_weight_bytes(tk):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=gen)
    int8 = TritonQuantLinear(quantize_weight(w, "int8"), torch.randn(8, generator=gen), "cpu", kernels=tk)
    assert int8.qweight.dtype == torch.int8 and int8.scale.shape == (8,)
    assert int8.weight_bytes() == 8 * 64 + 8 * 4 + 8 * 4  # codes, fp32 scales, fp32 bias
    asym = quantize_weight(w, "int4", 32, symmetric=False)
    int4 = TritonQuantLinear(asym, None, "cpu", kernels=tk)
    assert int4.packed.dtype == torch.uint8 and int4.packed.shape == (8, 32)
    first_byte = (int(asym.qweight[0, 0]) & 15) | ((int(asym.qweight[0, 1]) & 15) << 4)  # low nibble = column 0
    assert int(int4.packed[0, 0]) == first_byte
    assert int4.weight_bytes() == 8 * 32 + 8 * 2 * 4 + 8 * 2  # packed codes, fp32 scales, int8 zeros


def test_rejected_weights_and_inputs(tk):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=gen)
    with pytest.raises(ValueError, match="fmt 'fp8'"):
        TritonQuantLinear(quantize_weight(w, "fp8"), None, "cpu", kernels=tk)
    sym = quantize_weight(w, "int4", 32)
    sym.zero = torch.zeros(8, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="symmetric=True must have zero=None"):
        TritonQuantLinear(sym, None, "cpu", kernels=tk)
    with pytest.raises(ValueError, match=r"bias has shape \(9,\), expected \(8,\)"):
        TritonQuantLinear(quantize_weight(w, "int8"), torch.zeros(9), "cpu", kernels=tk)
    layer = TritonQuantLinear(quantize_weight(w, "int8"), None, "cpu", kernels=tk)
    with pytest.raises(ValueError, match=r"expected \[..., in_features=64\]"):
        layer(torch.randn(2, 63))
    compiled = _load_kernels(False, "_triton_kernels_compiled_for_gpu_linear")
    with pytest.raises(ValueError, match="Triton interpreter"):
        TritonQuantLinear(quantize_weight(w, "int8"), None, "cpu", kernels=compiled)


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 32, bias=True)
        self.act = nn.SiLU()
        self.down = nn.Linear(32, 48, bias=False)
        self.head = nn.Linear(48, 16, bias=True)

    def forward(self, x):
        return self.head(self.act(self.down(self.act(self.up(x)))))


def test_swap_matches_float64_model(tk):
    torch.manual_seed(3)
    model = TinyMLP().eval()
    quantized = {"up": quantize_weight(model.up.weight, "int8"),
                 "down": quantize_weight(model.down.weight, "int4", 16, symmetric=False)}
    w_up, w_down = dequantize_f64(quantized["up"]), dequantize_f64(quantized["down"])
    head, b_up = model.head, model.up.bias.detach().double()
    x = torch.randn(5, 64)
    assert swap_linears_triton(model, quantized, "cpu", kernels=tk) is model
    assert isinstance(model.up, TritonQuantLinear) and isinstance(model.down, TritonQuantLinear)
    assert model.head is head  # not in `quantized`: untouched
    h = F.silu(x.double() @ w_up.T + b_up)
    ref = F.silu(h @ w_down.T) @ head.weight.double().T + head.bias.double()
    with torch.no_grad():
        assert_close(model(x), ref, torch.float32, "swapped TinyMLP")


def test_swap_errors_leave_the_model_unchanged(tk):
    model = TinyMLP()
    up, down = model.up, model.down
    good = quantize_weight(model.up.weight, "int8")
    cases = [
        ({"up": good, "middle": good}, KeyError, "no module named 'middle'"),
        ({"up": good, "act": good}, TypeError, "module 'act' is SiLU, expected nn.Linear"),
        ({"up": good, "down": good}, ValueError, r"'down' has shape \(32, 64\), the module is \(48, 32\)"),
    ]
    for quantized, error, message in cases:
        with pytest.raises(error, match=message):
            swap_linears_triton(model, quantized, "cpu", kernels=tk)
        assert model.up is up and model.down is down
    with pytest.raises(KeyError, match="no module named 'gone' to replace"):
        replace_modules(model, {"up": nn.Identity(), "gone": nn.Identity()})
    assert model.up is up


def test_same_modules_in_two_models_and_restore(tk):
    """What the GPU benchmark does: build once, share between two models, put the nn.Linear back afterwards."""
    torch.manual_seed(4)
    first, second = TinyMLP(), TinyMLP()
    second.load_state_dict(first.state_dict())
    original = {"up": first.up}
    built = build_triton_linears(first, {"up": quantize_weight(first.up.weight, "int8")}, "cpu", kernels=tk)
    assert isinstance(first.up, nn.Linear)  # building changes nothing
    replace_modules(first, built)
    replace_modules(second, built)
    assert first.up is second.up is built["up"]
    x = torch.randn(3, 64)
    with torch.no_grad():
        quantized_out = first(x)
        assert torch.equal(quantized_out, second(x))
        replace_modules(first, original)
        assert first.up is original["up"] and isinstance(second.up, TritonQuantLinear)
        h = F.silu(x.double() @ first.up.weight.double().T + first.up.bias.double())
        h = F.silu(h @ first.down.weight.double().T)
        ref = h @ first.head.weight.double().T + first.head.bias.double()
        assert_close(first(x), ref, torch.float32, "restored float model")
        assert not torch.allclose(quantized_out, first(x), rtol=0, atol=1e-6)  # the int8 rounding shows


def test_engine_and_transformers_share_swapped_modules(tk):
    """The GPU benchmark's setup on a one-layer Qwen3 (interpreted kernels are slow): our engine's model built from
    the float HF model, then the same TritonQuantLinear modules swapped into both. HF logits must match the HF model
    holding the float64-dequantized weights, and both must produce the same greedy tokens."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from posttrain.serve.engine import Engine, SamplingParams, model_from_hf

    torch.manual_seed(5)
    config = Qwen3Config(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True)
    hf = Qwen3ForCausalLM(config).eval()
    names = [n for n, m in hf.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    quantized = {n: quantize_weight(hf.get_submodule(n).weight, "int4", 32, symmetric=False) for n in names}
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.copy_(dequantize_f64(quantized[name]).float())
    ours = model_from_hf(hf)
    modules = build_triton_linears(hf, quantized, "cpu", kernels=tk)
    replace_modules(hf, modules)
    replace_modules(ours, modules)
    prompt = torch.randint(0, 160, (1, 6))
    with torch.no_grad():
        logits, ref = hf(prompt).logits, reference(prompt).logits
        assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
        hf_tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[0, 6:].tolist()
    engine = Engine(ours, None, max_batch=1, max_len=16, stop_token_ids=[])
    done = engine.generate([prompt[0].tolist()], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert done.token_ids == hf_tokens and len(hf_tokens) == 4
