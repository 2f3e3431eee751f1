"""GPTQ: the blocked implementation against a plain unblocked float64 one written here, its gain over
round-to-nearest on correlated inputs, the identity-Hessian case, dead inputs; and the model driver on a tiny
random Qwen3."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from posttrain.quant.calibrate import _hook_hessians, _quantize_group, quantization_targets, quantize_model
from posttrain.quant.formats import QuantizedWeight, dequantize_weight, quantize_weight
from posttrain.quant.gptq import HessianAccumulator, gptq_quantize

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def correlated_inputs(n_tokens: int, in_features: int, seed: int) -> torch.Tensor:
    """X [n, in]: a random low-rank mix plus noise, with per-channel scales (like real activations)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_features // 4, in_features, generator=gen)
    x = torch.randn(n_tokens, in_features // 4, generator=gen) @ mix + 0.5 * torch.randn(n_tokens, in_features,
                                                                                         generator=gen)
    return x * torch.exp(0.5 * torch.randn(in_features, generator=gen))


def random_weight(out_features: int, in_features: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05 + shift


def reference_params(values: torch.Tensor, fmt: str, symmetric: bool):
    """Plain float64 scale and zero point for each row of values [out, k]."""
    if symmetric:
        scale = values.abs().amax(dim=1) / (127.0 if fmt == "int8" else 7.0)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale)
    low, high = values.amin(dim=1).clamp(max=0), values.amax(dim=1).clamp(min=0)
    scale = (high - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.round(-low / scale).clamp(0, 15)


def reference_round(column: torch.Tensor, scale, zero, fmt: str, symmetric: bool) -> torch.Tensor:
    low, high = (-127, 127) if fmt == "int8" else ((-8, 7) if symmetric else (0, 15))
    return torch.clamp(torch.round(column / scale) + zero, low, high)


def reference_gptq(w, hessian, fmt, group_size, symmetric, damp=0.01, act_order=False):
    """Unblocked float64 GPTQ in its textbook (OBS) form: quantize one column, spread its error over the
    remaining columns through the inverse Hessian, eliminate the column from the inverse Hessian. -> codes."""
    weight, hessian = w.double().clone(), hessian.double().clone()
    out_features, in_features = weight.shape
    group = group_size or in_features
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1.0
    hessian += damp * torch.diagonal(hessian).mean() * torch.eye(in_features, dtype=torch.float64)
    order = torch.argsort(torch.diagonal(hessian), descending=True) if act_order else torch.arange(in_features)
    static = [reference_params(weight[:, g:g + group], fmt, symmetric) for g in range(0, in_features, group)]
    inverse = torch.linalg.inv(hessian[order][:, order])
    weight = weight[:, order]
    codes = torch.zeros(out_features, in_features, dtype=torch.float64)
    params = {}
    for j in range(in_features):
        original = int(order[j])
        if act_order:
            params[original // group] = static[original // group]
        elif original % group == 0:
            params[original // group] = reference_params(weight[:, j:j + group], fmt, symmetric)
        scale, zero = params[original // group]
        codes[:, original] = reference_round(weight[:, j], scale, zero, fmt, symmetric)
        error = weight[:, j] - (codes[:, original] - zero) * scale
        # `inverse` covers the columns j.. not yet quantized; its row 0 is column j.
        pivot, row = inverse[0, 0], inverse[0, 1:]
        weight[:, j + 1:] -= torch.outer(error / pivot, row)
        inverse = inverse[1:, 1:] - torch.outer(row, row) / pivot
    return codes


def output_error(x, w, q: QuantizedWeight) -> float:
    return (x.double() @ (w.double() - dequantize_weight(q, torch.float64)).T).norm().item()


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    accumulator = HessianAccumulator(x.shape[1])
    accumulator.add(x)
    return accumulator.hessian()


@pytest.mark.parametrize(
    "fmt, group_size, symmetric, block_size, act_order",
    [
        ("int4", 32, True, 64, False),  # two groups per block
        ("int4", 32, False, 64, False),
        ("int4", 128, True, 64, False),  # groups span two blocks
        ("int4", 32, True, 48, False),  # misaligned block size
        ("int8", None, True, 64, False),
        ("int4", 32, True, 64, True),
        ("int8", None, True, 128, True),
    ],
)
def test_blocked_gptq_matches_unblocked_float64_reference(fmt, group_size, symmetric, block_size, act_order):
    in_features = 256 if group_size == 128 else 128
    x = correlated_inputs(512, in_features, seed=1)
    w = random_weight(32, in_features, seed=2, shift=0.0 if symmetric else 0.02)
    hessian = hessian_of(x)
    q = gptq_quantize(w, hessian, fmt, group_size, symmetric, block_size=block_size, act_order=act_order)
    ref_codes = reference_gptq(w, hessian, fmt, group_size, symmetric, act_order=act_order)
    same = (q.qweight.double() == ref_codes).double().mean().item()
    assert same >= 0.99, f"only {same:.4f} of GPTQ codes match the unblocked float64 reference"
    ref_q = copy.copy(q)
    ref_q.qweight = ref_codes.to(torch.int8)
    ours, theirs = output_error(x, w, q), output_error(x, w, ref_q)
    assert abs(ours - theirs) <= 0.03 * theirs, (ours, theirs)


@pytest.mark.parametrize("fmt, group_size", [("int4", 32), ("int4", 128), ("int8", None)])
def test_gptq_beats_round_to_nearest_on_held_out_correlated_inputs(fmt, group_size):
    tokens = correlated_inputs(1536, 256, seed=3)
    calibration, held_out = tokens[:1024], tokens[1024:]  # same mixing and channel scales, different tokens
    w = random_weight(64, 256, seed=4)
    gptq = gptq_quantize(w, hessian_of(calibration), fmt, group_size)
    rtn = quantize_weight(w, fmt, group_size)
    assert output_error(held_out, w, gptq) < 0.9 * output_error(held_out, w, rtn)


@pytest.mark.parametrize("fmt, group_size, symmetric", [("int4", 32, True), ("int4", 64, False), ("int8", None, True)])
def test_identity_hessian_gives_round_to_nearest(fmt, group_size, symmetric):
    w = random_weight(16, 128, seed=5, shift=0.01)
    for hessian in (torch.eye(128), 3.0 * torch.eye(128)):
        q = gptq_quantize(w, hessian, fmt, group_size, symmetric)
        rtn = quantize_weight(w, fmt, group_size, symmetric)
        assert torch.equal(q.qweight, rtn.qweight) and torch.equal(q.scale, rtn.scale)
        assert (q.zero is None) == (rtn.zero is None) and (q.zero is None or torch.equal(q.zero, rtn.zero))


def test_dead_inputs_are_rounded_to_nearest_and_finite():
    x = correlated_inputs(256, 64, seed=6)
    dead = torch.tensor([3, 17, 40])
    x[:, dead] = 0.0
    w = random_weight(8, 64, seed=7)
    q = gptq_quantize(w, hessian_of(x), "int4", 32)
    deq = dequantize_weight(q)
    assert torch.isfinite(deq).all()
    half_step = q.scale.repeat_interleave(32, dim=1)[:, dead] / 2
    # A dead column is decoupled: it is neither updated nor zeroed, just rounded with its group's scale.
    assert ((deq[:, dead] - w[:, dead]).abs() <= half_step * (1 + 1e-5)).all()
    assert (w[:, dead].abs() > 0).all()
    assert torch.isfinite(gptq_quantize(w, torch.zeros(64, 64), "int4", 32).scale).all()


def test_hessian_accumulator_matches_float64_formula():
    gen = torch.Generator().manual_seed(8)
    batches = [torch.randn(2, 5, 12, generator=gen), torch.randn(7, 12, generator=gen)]
    accumulator = HessianAccumulator(12)
    for batch in batches:
        accumulator.add(batch)
    tokens = torch.cat([b.reshape(-1, 12) for b in batches]).double()
    assert accumulator.n_tokens == 17
    torch.testing.assert_close(accumulator.hessian().double(), 2 * tokens.T @ tokens / 17, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"input last dim 11 \(shape \(3, 11\)\) != in_features 12"):
        accumulator.add(torch.randn(3, 11))


def test_gptq_bad_inputs():
    w = random_weight(8, 64, seed=9)
    with pytest.raises(ValueError, match="supports fmt in .* got 'nf4'"):
        gptq_quantize(w, torch.eye(64), "nf4")
    with pytest.raises(ValueError, match=r"hessian shape \(32, 32\) != \[in, in\] = \[64, 64\]"):
        gptq_quantize(w, torch.eye(32), "int4", 32)
    with pytest.raises(ValueError, match="group_size 48"):
        gptq_quantize(w, torch.eye(64), "int4", 48)


# ---- the model driver ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128)
    return Qwen3ForCausalLM(config).eval()


def expected_names(n_layers: int = 2) -> set[str]:
    return {f"model.layers.{i}.{projection}" for i in range(n_layers) for projection in PROJECTIONS}


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_model_covers_every_decoder_linear_and_writes_back(tiny_qwen3, method):
    model = copy.deepcopy(tiny_qwen3)
    before = {name: p.clone() for name, p in model.named_parameters()}
    calib_ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    result = quantize_model(model, method, "int4", 32, True, calib_ids)
    assert set(result) == expected_names()
    modules = dict(model.named_modules())
    for name, q in result.items():
        assert torch.equal(modules[name].weight, dequantize_weight(q))
        assert not torch.equal(modules[name].weight, before[name + ".weight"])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(dict(model.named_parameters())[name], before[name])


def quantized_logit_errors(model, vocab: int, group_size: int, calib_rows: int, seq: int, seed: int):
    """{method: relative logit error on held-out ids, with the method's model and result} for rtn and gptq.
    Plain random token ids (calibration and held-out drawn independently) already show GPTQ's gain."""
    gen = torch.Generator().manual_seed(seed)
    calib_ids = torch.randint(0, vocab, (calib_rows, seq), generator=gen)
    held_out = torch.randint(0, vocab, (calib_rows // 2, seq), generator=gen)
    with torch.no_grad():
        reference = model(held_out).logits
    out = {}
    for method in ("rtn", "gptq"):
        quantized = copy.deepcopy(model)
        result = quantize_model(quantized, method, "int4", group_size, True, calib_ids)
        with torch.no_grad():
            error = ((quantized(held_out).logits - reference).norm() / reference.norm()).item()
        out[method] = (error, quantized, result)
    return out


def test_gptq_model_logits_closer_than_rtn(tiny_qwen3):
    errors = {method: e for method, (e, _, _) in quantized_logit_errors(tiny_qwen3, 128, 32, 16, 64, 2).items()}
    assert errors["gptq"] < 0.95 * errors["rtn"], errors


def test_routers_are_not_quantization_targets(caplog):
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(8, 8)
    layer.mlp = nn.Module()
    layer.mlp.gate = nn.Linear(8, 4)  # the router
    layer.mlp.shared_expert_gate = nn.Linear(8, 1)
    layer.mlp.experts = nn.ModuleList([nn.Module() for _ in range(2)])
    for expert in layer.mlp.experts:
        expert.gate_proj, expert.up_proj, expert.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
    layer.odd = nn.Parameter(torch.randn(2, 3, 4))  # a 3-D weight of no known layout
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        names = set(quantization_targets(layer, "model.layers.5"))
    assert names == {"model.layers.5.self_attn.q_proj"} | {
        f"model.layers.5.mlp.experts.{j}.{p}" for j in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    assert "left in float: model.layers.5.odd" in caplog.text


@pytest.fixture(scope="module")
def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, vocab_size=64)
    return Qwen3MoeForCausalLM(config).eval()


def test_fused_experts_quantized_and_router_kept(tiny_qwen3_moe):
    runs = quantized_logit_errors(tiny_qwen3_moe, 64, 16, 8, 32, 1)
    expected = {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    expected |= {f"model.layers.{i}.mlp.experts.{j}.{p}" for i in (0, 1) for j in range(4)
                 for p in ("gate_proj", "up_proj", "down_proj")}
    for _, model, result in runs.values():
        assert set(result) == expected
        experts = model.model.layers[1].mlp.experts
        up_2, down_3 = result["model.layers.1.mlp.experts.2.up_proj"], result["model.layers.1.mlp.experts.3.down_proj"]
        assert torch.equal(experts.gate_up_proj[2, 32:], dequantize_weight(up_2))  # up rows follow the gate rows
        assert torch.equal(experts.down_proj[3], dequantize_weight(down_3))
        for i in (0, 1):
            assert torch.equal(model.model.layers[i].mlp.gate.weight, tiny_qwen3_moe.model.layers[i].mlp.gate.weight)
    assert runs["gptq"][0] < runs["rtn"][0], {method: run[0] for method, run in runs.items()}


def test_expert_hessians_come_from_routed_tokens(tiny_qwen3_moe):
    layer = copy.deepcopy(tiny_qwen3_moe.model.layers[0])
    experts = layer.mlp.experts
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 32, generator=gen)
    # [tokens, 2] distinct experts per token, drawn from 0..2: expert 3 gets no tokens.
    top_k_index = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(40)])
    accumulators, _, handles = _hook_hessians(layer, "L")
    with torch.no_grad():
        experts(hidden, top_k_index, torch.full((40, 2), 0.5))
    for handle in handles:
        handle.remove()
    for j in range(4):
        tokens = hidden[(top_k_index == j).any(dim=1)].double()
        gate_up = experts.gate_up_proj[j].detach().double()
        mid = torch.nn.functional.silu(tokens @ gate_up[:32].T) * (tokens @ gate_up[32:].T)
        for name, x in (("gate_proj", tokens), ("up_proj", tokens), ("down_proj", mid)):
            expected = 2 * x.T @ x / max(x.shape[0], 1)
            torch.testing.assert_close(accumulators[f"L.mlp.experts.{j}.{name}"].hessian().double(), expected,
                                       rtol=1e-4, atol=1e-6)
    assert accumulators["L.mlp.experts.3.down_proj"].n_tokens == 0


def test_linears_reading_one_input_share_one_hessian(tiny_qwen3):
    """q/k/v read the same normed hidden states and gate/up the same ones: one accumulator each, summed once per
    call, equal to the Hessian of that input; o_proj and down_proj read their own inputs."""
    layer = tiny_qwen3.model.layers[0]
    seen = {}
    recorders = [layer.get_submodule(part).register_forward_pre_hook(
        lambda module, args, part=part: seen.setdefault(part, []).append(args[0].detach().clone()))
        for part in PROJECTIONS]
    accumulators, shared, handles = _hook_hessians(layer, "L")
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            for row in ids:  # three calls, as GPTQ's calibration batches
                tiny_qwen3(row[None])
                shared.end_call()
    finally:
        for handle in handles + recorders:
            handle.remove()
    assert accumulators == {}  # no fused experts here
    by_name = {name.removeprefix("L."): accumulator for name, accumulator in shared.by_name.items()}
    assert by_name["self_attn.q_proj"] is by_name["self_attn.k_proj"] is by_name["self_attn.v_proj"]
    assert by_name["mlp.gate_proj"] is by_name["mlp.up_proj"]
    assert len({id(a) for a in by_name.values()}) == 4  # qkv, o, gate/up, down
    for name in PROJECTIONS:
        x = torch.cat([h.reshape(-1, h.shape[-1]) for h in seen[name]]).double()
        assert by_name[name].n_tokens == x.shape[0] == 30
        torch.testing.assert_close(by_name[name].hessian().double(), 2 * x.T @ x / 30, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("fmt", "group_size", "symmetric", "act_order"),
                         [("int4", 32, False, False), ("int4", 32, True, True), ("int8", None, True, False)])
def test_stacked_weights_get_the_codes_each_gets_alone(fmt, group_size, symmetric, act_order):
    """GPTQ on [q; k; v] stacked by rows gives each weight the codes, scales and zeros it gets on its own."""
    x = correlated_inputs(256, 64, seed=6)
    hessian = 2 * x.T @ x / x.shape[0]
    weights = [random_weight(rows, 64, seed) for rows, seed in ((48, 1), (16, 2), (16, 3))]
    stacked = _quantize_group(weights, hessian, fmt, group_size, symmetric, 0.01, act_order)
    for weight, together in zip(weights, stacked):
        alone = gptq_quantize(weight, hessian, fmt, group_size, symmetric, damp=0.01, act_order=act_order)
        assert together.shape == alone.shape == tuple(weight.shape)
        assert torch.equal(together.qweight, alone.qweight)
        torch.testing.assert_close(together.scale, alone.scale, rtol=0, atol=0)
        assert (together.zero is None) == (alone.zero is None)
        if alone.zero is not None:
            assert torch.equal(together.zero, alone.zero)


def test_quantize_model_bad_arguments(tiny_qwen3):
    model = copy.deepcopy(tiny_qwen3)
    with pytest.raises(ValueError, match="unknown quantization method 'smoothquant'"):
        quantize_model(model, "smoothquant", "int4", 32)
    with pytest.raises(ValueError, match=r"gptq needs calib_ids as a LongTensor \[n, seq\] with n >= 1, got None"):
        quantize_model(model, "gptq", "int4", 32)
    with pytest.raises(ValueError, match=r"awq needs calib_ids .* got \(8,\) torch.int64"):
        quantize_model(model, "awq", "int4", 32, calib_ids=torch.zeros(8, dtype=torch.long))
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj weight \(64, 64\): int4 group_size 128"):
        quantize_model(model, "rtn", "int4", 128)
    with pytest.raises(ValueError, match="int8 is symmetric only"):
        quantize_model(model, "rtn", "int8", None, False)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    with pytest.raises(ValueError, match="GPTQ supports fmt in .* got 'fp8'"):
        quantize_model(model, "gptq", "fp8", None, calib_ids=torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="no `model.model.layers`"):
        quantize_model(nn.Linear(4, 4), "rtn", "int8")


def test_quantize_model_awq_delegates(tiny_qwen3):
    model = copy.deepcopy(tiny_qwen3)
    calib_ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(3))
    result = quantize_model(model, "awq", "int4", 32, True, calib_ids)
    assert set(result) == expected_names()
    assert all(isinstance(q, QuantizedWeight) and q.fmt == "int4" for q in result.values())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gptq_runs_on_llama_and_qwen2_layouts(family):
    import transformers

    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_class(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=64)
    model = model_class(config).eval()
    calib_ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(5))
    result = quantize_model(model, "gptq", "int4", 32, False, calib_ids)
    assert set(result) == expected_names()
    assert all(q.zero is not None and torch.isfinite(dequantize_weight(q)).all() for q in result.values())
