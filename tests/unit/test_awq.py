"""AWQ on tiny random Qwen3 / Llama / Qwen3-MoE models: scale folding is exact in float, the alpha search includes
round-to-nearest (alpha 0) and beats it when activations have outlier channels, every decoder linear comes back."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from posttrain.quant.awq import (
    CLIP_RATIOS,
    apply_scale,
    awq_quantize_model,
    quantizable_linears,
    scale_groups,
    search_clip,
    search_scale,
)
from posttrain.quant.formats import dequantize_weight, quantize_weight

OUTLIER_CHANNELS = [3, 17, 40]
SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, head_dim=16,
             vocab_size=128, max_position_embeddings=64)


def tiny_model(kind: str, outliers: bool = False, seed: int = 0) -> nn.Module:
    """Qwen3 with grouped-query attention (4 heads, 2 kv heads: o_proj not scaled), Llama or Qwen2 with 4."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, num_key_value_heads=2))
    elif kind == "qwen2":  # q/k/v biases: folding into v_proj must divide its bias too
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=4))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.v_proj.bias.normal_()  # random, not the zeros of a fresh model
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=4))
    model.eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape))  # not all ones, so folding shows
                if outliers:
                    norm.weight[OUTLIER_CHANNELS] *= 20  # a few large activation channels, as in real LLMs
    return model


def random_ids(n: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (n, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.double()


@torch.no_grad()
def rtn_in_place(model: nn.Module, fmt: str, group_size: int | None) -> None:
    for layer in model.model.layers:
        for linear in quantizable_linears(layer).values():
            linear.weight.copy_(dequantize_weight(quantize_weight(linear.weight, fmt, group_size)))


def rtn_int4_float64(w: torch.Tensor, group: int) -> torch.Tensor:
    """Independent symmetric int4 round-to-nearest in float64: codes in [-8, 7], scale = group absmax / 7."""
    grouped = w.double().reshape(w.shape[0], -1, group)
    scale = grouped.abs().amax(-1, keepdim=True) / 7
    return (torch.round(grouped / scale).clamp(-8, 7) * scale).reshape(w.shape)


@torch.no_grad()
def first_layer_qkv_input(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What q_proj of layer 0 reads (input_layernorm's output), flattened to [tokens, hidden]."""
    seen = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model(input_ids=ids)
    handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


@pytest.mark.parametrize("kind, expected_groups", [("qwen3", ["qkv", "gate_up", "down"]),
                                                   ("llama", ["qkv", "o", "gate_up", "down"]),
                                                   ("qwen2", ["qkv", "o", "gate_up", "down"])])
def test_folding_scales_leaves_float_logits_unchanged(kind, expected_groups):
    model = tiny_model(kind, outliers=True)
    ids = random_ids(2, 16, seed=5)
    before = logits(model, ids)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        groups = scale_groups(layer, model.config)
        assert [group.name for group in groups] == expected_groups
        for group in groups:
            in_features = group.linears[0].in_features
            apply_scale(group, torch.exp(torch.randn(in_features, generator=generator)))  # s spans ~0.05 .. 20
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, norm_before)  # the fold did something
    after = logits(model, ids)
    assert (after - before).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_awq_int4_beats_round_to_nearest_on_outlier_model(kind):
    model = tiny_model(kind, outliers=True)
    calib, held_out = random_ids(8, 32, seed=1), random_ids(4, 32, seed=2)
    reference = logits(model, held_out)

    rtn_model = copy.deepcopy(model)
    rtn_in_place(rtn_model, "int4", 32)
    rtn_error = (logits(rtn_model, held_out) - reference).pow(2).mean().item()

    awq_model = copy.deepcopy(model)
    result = awq_quantize_model(awq_model, "int4", 32, True, calib)
    awq_error = (logits(awq_model, held_out) - reference).pow(2).mean().item()
    assert awq_error < 0.8 * rtn_error, (awq_error, rtn_error)  # measured: about 0.3-0.4 of RTN's

    # the model holds exactly the dequantized weights that come back
    for name, q in result.items():
        assert q.fmt == "int4" and q.group_size == 32 and q.qweight.min() >= -8 and q.qweight.max() <= 7
        assert torch.equal(awq_model.get_submodule(name).weight, dequantize_weight(q)), name


def test_alpha_search_picks_alpha_above_zero_on_outliers_and_alpha_zero_is_rtn():
    model = tiny_model("qwen3", outliers=True)
    x = first_layer_qkv_input(model, random_ids(8, 32, seed=1))  # [256, 64]
    attn = model.model.layers[0].self_attn
    weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()  # [128, 64]
    found = search_scale(x, weight, "int4", 32, True, n_grid=20)

    assert found.alphas[0] == 0 and len(found.alphas) == 20 and max(found.alphas) < 1
    assert found.alpha > 0
    assert min(found.errors) == found.errors[found.alphas.index(found.alpha)] < found.errors[0]
    # alpha 0 is plain round-to-nearest: its error matches an independent float64 computation
    x64 = x.double()
    rtn_error = (x64 @ rtn_int4_float64(weight, 32).T - x64 @ weight.double().T).pow(2).mean().item()
    assert found.errors[0] == pytest.approx(rtn_error, rel=1e-3)
    # the chosen scales are (mean |x|) ** alpha normalised by sqrt(max * min)
    s = x64.abs().mean(0) ** found.alpha
    assert torch.allclose(found.scales.double(), s / (s.max() * s.min()).sqrt(), rtol=1e-4)


def test_clip_search_never_raises_a_groups_partial_output_error():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(200, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator)
    weight[:, 5] *= 8  # one large column per row: clipping its group may pay off
    assert CLIP_RATIOS[0] == 1.0
    clipped = search_clip(x, weight, "int4", 32, True)

    def partial_errors(w):  # [rows, groups] mean squared error of x_g @ w_g in float64
        x_groups, dq = x.double().view(200, 2, 32), rtn_int4_float64(w, 32).view(48, 2, 32)
        exact = torch.einsum("tgk,rgk->trg", x_groups, weight.double().view(48, 2, 32))
        return (torch.einsum("tgk,rgk->trg", x_groups, dq) - exact).pow(2).mean(0)

    assert (partial_errors(clipped) <= partial_errors(weight) * (1 + 1e-6)).all()
    assert (clipped.abs() <= weight.abs()).all() and not torch.equal(clipped, weight)


def test_every_decoder_linear_is_returned_and_bad_formats_raise():
    model = tiny_model("llama")
    expected = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)} - {"lm_head"}
    result = awq_quantize_model(copy.deepcopy(model), "int8", None, True, random_ids(4, 16, seed=1), n_grid=5)
    assert set(result) == expected and len(expected) == 14
    assert all(q.fmt == "int8" and q.scale.shape == (q.shape[0],) for q in result.values())

    calib = random_ids(2, 8, seed=1)
    with pytest.raises(ValueError, match="fmt must be one of"):
        awq_quantize_model(model, "fp8", None, True, calib)
    with pytest.raises(ValueError, match="group_size"):
        awq_quantize_model(model, "int4", 48, True, calib)  # 48 does not divide hidden 64
    with pytest.raises(ValueError, match="calib_ids"):
        awq_quantize_model(model, "int4", 32, True, calib.float())


def test_qwen3_moe_scales_attention_and_rounds_fused_experts():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SMALL, num_key_value_heads=4, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config).eval()
    held_out = random_ids(2, 16, seed=2)
    reference = logits(model, held_out)
    result = awq_quantize_model(model, "int4", 32, False, random_ids(4, 16, seed=1), n_grid=5)

    experts = model.model.layers[1].mlp.experts
    for j in range(4):
        gate = result[f"model.layers.1.mlp.experts.{j}.gate_proj"]
        assert gate.shape == (32, 64) and torch.equal(experts.gate_up_proj[j, :32], dequantize_weight(gate))
        assert torch.equal(experts.down_proj[j], dequantize_weight(result[f"model.layers.1.mlp.experts.{j}.down_proj"]))
    assert "model.layers.0.self_attn.o_proj" in result
    assert not any(name.endswith("mlp.gate") or "embed" in name or "lm_head" in name for name in result)
    relative = ((logits(model, held_out) - reference).norm() / reference.norm()).item()
    assert 0 < relative < 0.2
