"""AWQ (activation-aware weight quantization) for Llama, Qwen2, Qwen3 and Qwen3-MoE decoder layers.

Idea: a few input channels of a linear carry large activations; their weight columns matter most for the output.
Multiplying those columns by s > 1 before round-to-nearest gives them finer steps, and dividing the input by s (folded
into the op that produces the input) keeps the float model unchanged. Per group of linears that read one input:

    s_x = mean over tokens of |x|                      [in]
    s(alpha) = s_x ** alpha, normalised by sqrt(max * min)
    error(alpha) = mean (x @ W.T - (x / s) @ Q(W * s).T) ** 2   over the calibration tokens
    keep the alpha with the least error; alpha = 0 (s = 1) is plain round-to-nearest, so a group never gets worse.

The error is that of the group's concatenated projection outputs (q|k|v, gate|up, down alone, o alone), not of
the whole attention or MLP block: it is a pure function of (inputs, weights), cheap and easy to test.

Groups and where 1/s is folded:
- q, k, v   <- input_layernorm.weight
- o         <- v_proj output rows (and bias), only when num_attention_heads == num_key_value_heads: with grouped
               query attention one value channel feeds several o_proj columns, which could not all get their own s.
- gate, up  <- post_attention_layernorm.weight
- down      <- up_proj output rows (and bias): down's input is act(gate) * up, linear in up's output.

After scaling, each weight gets AWQ's max-value clip search (per output row and input group, shrink the range by a
ratio in 1.0 .. 0.55, keep the ratio with the least error of that group's partial output); as AWQ does, q_proj and
k_proj are not clipped (the softmax of q.k makes a per-row partial error a poor guide).

Qwen3-MoE: attention groups are scaled as above; experts get no scaling: fused 3-D experts (`mlp.experts.gate_up_proj`
/ `down_proj`, as transformers 5 stores them) get plain round-to-nearest, expert or shared-expert nn.Linear modules
round-to-nearest after the clip search on the tokens routed to them. Routers (`mlp.gate`, `shared_expert_gate`) stay
in float.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn
from posttrain.quant.formats import dequantize_weight, quantize_weight, resolve_group_size
from posttrain.quant.layer_calls import capture_layer_calls, layer_output

log = logging.getLogger("posttrain")

AWQ_FORMATS = ("int4", "int8")
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # 1.0, 0.95, ..., 0.55 of each group's range
CLIP_MAX_TOKENS = 512  # tokens used by the clip search (AWQ's choice); the scale search uses all of them
ROUTER_SUFFIXES = ("mlp.gate", "shared_expert_gate")
NO_CLIP_SUFFIXES = ("q_proj", "k_proj")


@dataclass
class ScaleGroup:
    """Linears that read one input, the op that produces that input (1/s folds into it), and whose recorded input
    is the group's input."""

    name: str
    prev: nn.Module  # an RMSNorm (weight [in]) or an nn.Linear (output rows [in])
    linears: list[nn.Linear]
    input_of: nn.Linear


@dataclass
class ScaleSearch:
    alpha: float
    scales: torch.Tensor  # [in] fp32
    alphas: list[float]
    errors: list[float]  # output mean squared error per alpha, same order as `alphas`


def check_arguments(fmt: str, group_size: int | None, symmetric: bool, config) -> None:
    """Fail before any work on a format AWQ does not do or a group size that does not fit the model's widths."""

    if fmt not in AWQ_FORMATS:
        raise ValueError(f"AWQ fmt must be one of {AWQ_FORMATS}, got {fmt!r}")
    if fmt != "int4" and not symmetric:
        raise ValueError(f"{fmt} is symmetric only; symmetric=False is int4 only")
    for width_name in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
        if getattr(config, width_name, None):
            resolve_group_size(fmt, group_size, getattr(config, width_name))  # raises on a group that does not divide


def fake_quantize(w: torch.Tensor, fmt: str, group_size: int | None, symmetric: bool) -> torch.Tensor:
    """Round-to-nearest through formats.py and back: [out, in] fp32 -> [out, in] fp32."""

    return dequantize_weight(quantize_weight(w, fmt, group_size=group_size, symmetric=symmetric), dtype=torch.float32)


def awq_scales(x_mag: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = s_x ** alpha for [in] mean |x|, normalised so that sqrt(max(s) * min(s)) = 1 (alpha = 0 gives ones)."""
    s = x_mag.float().clamp(min=1e-4) ** alpha
    return s / torch.sqrt(s.max() * s.min())


def search_scale(
    x: torch.Tensor, weight: torch.Tensor, fmt: str, group_size: int | None, symmetric: bool, n_grid: int = 20
) -> ScaleSearch:
    """Grid-search alpha in {0, 1/n_grid, ..., (n_grid - 1)/n_grid} for inputs x [tokens, in] and the group's
    concatenated weight [out, in]; error = mean squared difference of x @ W.T (float) and (x/s) @ Q(W*s).T."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"inputs x {tuple(x.shape)} do not match weight [out, in] {tuple(weight.shape)}")
    x, weight = x.float(), weight.float()
    x_mag = x.abs().mean(0)  # [in]
    reference = x @ weight.T  # [tokens, out]
    alphas = [i / n_grid for i in range(n_grid)]
    errors = []
    for alpha in alphas:
        s = awq_scales(x_mag, alpha)
        quantized = fake_quantize(weight * s, fmt, group_size, symmetric) / s  # (x/s) @ Q.T == x @ (Q/s).T
        errors.append((x @ quantized.T - reference).pow(2).mean().item())
    best = min(range(n_grid), key=errors.__getitem__)
    return ScaleSearch(alphas[best], awq_scales(x_mag, alphas[best]), alphas, errors)


def search_clip(
    x: torch.Tensor, weight: torch.Tensor, fmt: str, group_size: int | None, symmetric: bool, rows_per_step: int = 256
) -> torch.Tensor:
    """Clip each (output row, input group) of weight [out, in] to the ratio of its range in CLIP_RATIOS that gives the
    least mean squared error of that group's partial output x_g @ w_g over x [tokens, in]. Returns [out, in] fp32."""

    x = x.float()[:: max(1, math.ceil(x.shape[0] / CLIP_MAX_TOKENS))]  # evenly strided tokens
    out_features, in_features = weight.shape
    group = resolve_group_size(fmt, group_size, in_features) or in_features  # int8: one group per row
    x_groups = x.view(x.shape[0], in_features // group, group)  # [tokens, groups, group]
    clipped_rows = []
    for start in range(0, out_features, rows_per_step):  # rows are independent; bounds memory of [tokens, rows, groups]
        w = weight[start : start + rows_per_step].float().view(-1, in_features // group, group)  # [rows, groups, group]
        reference = torch.einsum("tgk,rgk->trg", x_groups, w)
        w_max, w_min = w.amax(-1, keepdim=True), w.amin(-1, keepdim=True)
        best_error = torch.full(w.shape[:2], float("inf"), device=w.device)
        best = w.clone()
        for ratio in CLIP_RATIOS:
            high = w.abs().amax(-1, keepdim=True) * ratio if symmetric else w_max * ratio
            low = -high if symmetric else w_min * ratio
            candidate = torch.minimum(torch.maximum(w, low), high)
            deq = fake_quantize(candidate.reshape(-1, in_features), fmt, group_size, symmetric).view_as(w)
            error = (torch.einsum("tgk,rgk->trg", x_groups, deq) - reference).pow(2).mean(0)  # [rows, groups]
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best = torch.where(better[..., None], candidate, best)
        clipped_rows.append(best.reshape(-1, in_features))
    return torch.cat(clipped_rows)


@torch.no_grad()
def apply_scale(group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide group.prev's output channels by s [in] and multiply the linears' input columns by s: the float function
    of the layer is unchanged (up to rounding)."""
    prev = group.prev
    if isinstance(prev, nn.Linear):
        if prev.out_features != s.numel():
            raise ValueError(f"{group.name}: previous linear has {prev.out_features} output rows, scales {s.numel()}")
        prev.weight.copy_(prev.weight.float() / s[:, None])
        if prev.bias is not None:
            prev.bias.copy_(prev.bias.float() / s)
    else:
        norm_weight = getattr(prev, "weight", None)
        if norm_weight is None or norm_weight.shape != s.shape:
            raise ValueError(f"{group.name}: expected a norm with weight {tuple(s.shape)} before the group, got {prev}")
        norm_weight.copy_(norm_weight.float() / s)
    for linear in group.linears:
        linear.weight.copy_(linear.weight.float() * s[None, :])


def scale_groups(layer: nn.Module, config) -> list[ScaleGroup]:
    """The AWQ groups of one Llama/Qwen2/Qwen3(-MoE) decoder layer, in the order they are searched."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj")):
        raise ValueError(
            f"AWQ expects a Llama/Qwen-style decoder layer with self_attn.q_proj/k_proj/v_proj, "
            f"got {type(layer).__name__}"
        )
    groups = [ScaleGroup("qkv", layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], attn.q_proj)]
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config.num_attention_heads == kv_heads and attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(ScaleGroup("o", attn.v_proj, [attn.o_proj], attn.o_proj))
    # else: grouped-query attention, o_proj is not scaled (see the module docstring)
    mlp = layer.mlp
    if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        gate_up = [mlp.gate_proj, mlp.up_proj]
        groups.append(ScaleGroup("gate_up", layer.post_attention_layernorm, gate_up, mlp.gate_proj))
        groups.append(ScaleGroup("down", mlp.up_proj, [mlp.down_proj], mlp.down_proj))
    # else: a mixture-of-experts block, its experts get round-to-nearest
    return groups


def quantizable_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear of a decoder layer except routers, by name relative to the layer."""
    return {
        name: module for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(ROUTER_SUFFIXES)
    }


@torch.no_grad()
def record_inputs(
    layer: nn.Module, hidden_per_batch: list, kwargs_per_batch: list, linears: list[nn.Linear]
) -> dict[nn.Linear, torch.Tensor]:
    """Run the layer on every batch and return each linear's input, flattened to [tokens, in] fp32."""
    seen: dict[nn.Linear, list[torch.Tensor]] = {linear: [] for linear in linears}
    handles = [
        linear.register_forward_hook(lambda m, args, out: seen[m].append(args[0].reshape(-1, m.in_features).float()))
        for linear in linears
    ]
    try:
        for hidden, kwargs in zip(hidden_per_batch, kwargs_per_batch):
            layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {linear: torch.cat(xs) if xs else torch.zeros(0, linear.in_features) for linear, xs in seen.items()}


@torch.no_grad()
def _quantize_into(linear_weight: torch.Tensor, w: torch.Tensor, fmt, group_size, symmetric):
    """Quantize w [out, in] fp32, write the dequantized weight into linear_weight; return the QuantizedWeight."""

    q = quantize_weight(w, fmt, group_size=group_size, symmetric=symmetric)
    linear_weight.copy_(dequantize_weight(q, dtype=torch.float32))
    return q


@torch.no_grad()
def _quantize_fused_experts(experts: nn.Module, prefix: str, hidden_size: int, fmt, group_size, symmetric) -> dict:
    """Round-to-nearest for 3-D expert weights: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I].
    Keys follow the checkpoint names: {prefix}.{j}.gate_proj / up_proj / down_proj."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dim() != 3 or gate_up.shape[-1] != hidden_size or down.shape[1] != hidden_size:
        raise ValueError(
            f"{prefix}: expected gate_up_proj [E, 2I, {hidden_size}] and down_proj [E, {hidden_size}, I], "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    inter = gate_up.shape[1] // 2
    result = {}
    for j in range(gate_up.shape[0]):
        parts = (("gate_proj", gate_up[j, :inter]), ("up_proj", gate_up[j, inter:]), ("down_proj", down[j]))
        for name, weight in parts:  # views into the 3-D parameters: writing them writes the model
            result[f"{prefix}.{j}.{name}"] = _quantize_into(weight, weight.float(), fmt, group_size, symmetric)
    return result


@torch.no_grad()
def awq_quantize_layer(
    layer: nn.Module, prefix: str, hidden_per_batch: list, kwargs_per_batch: list, config, fmt: str,
    group_size: int | None, symmetric: bool, n_grid: int = 20, clip: bool = True,
) -> dict:
    """Search and fold AWQ scales for one decoder layer run on hidden_per_batch [b, seq, hidden] with its recorded
    kwargs, then quantize its linears; the layer keeps the dequantized weights. Returns {full name: QuantizedWeight}."""
    groups = scale_groups(layer, config)
    linears = quantizable_linears(layer)
    # every linear reads either its group's input or its own
    source = {linear: linear for linear in linears.values()}
    for group in groups:
        source.update({linear: group.input_of for linear in group.linears})
    inputs = record_inputs(layer, hidden_per_batch, kwargs_per_batch, list(dict.fromkeys(source.values())))

    for group in groups:
        weight = torch.cat([linear.weight.float() for linear in group.linears])
        found = search_scale(inputs[group.input_of], weight, fmt, group_size, symmetric, n_grid)
        apply_scale(group, found.scales)
        inputs[group.input_of] = inputs[group.input_of] / found.scales  # what the scaled linears now read
        log.debug("AWQ %s.%s: alpha %.2f, error %.3g (alpha 0: %.3g)", prefix, group.name, found.alpha,
                  min(found.errors), found.errors[0])

    result = {}
    for name, linear in linears.items():
        w = linear.weight.float()
        x = inputs[source[linear]]
        if clip and x.shape[0] > 0 and not name.endswith(NO_CLIP_SUFFIXES):
            w = search_clip(x, w, fmt, group_size, symmetric)
        result[f"{prefix}.{name}"] = _quantize_into(linear.weight, w, fmt, group_size, symmetric)

    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter):
        result.update(_quantize_fused_experts(experts, f"{prefix}.mlp.experts", config.hidden_size, fmt, group_size,
                                              symmetric))
    return result


def _decoder_layers(model: nn.Module) -> tuple[str, nn.Module, nn.ModuleList]:
    """(name, decoder module, its layers): "model.layers" for a *ForCausalLM, "layers" for a bare decoder."""
    for name, decoder in (("model.layers", getattr(model, "model", None)), ("layers", model)):
        if isinstance(getattr(decoder, "layers", None), nn.ModuleList):
            return name, decoder, decoder.layers
    raise ValueError(f"AWQ could not find decoder layers at model.model.layers or model.layers of "
                     f"{type(model).__name__}")


@torch.no_grad()
def awq_quantize_model(
    model: nn.Module, fmt: str, group_size: int | None, symmetric: bool, calib_ids: torch.Tensor, n_grid: int = 20,
    clip: bool = True, batch_size: int = 8,
) -> dict:
    """AWQ-quantize every decoder-layer linear of a Llama/Qwen2/Qwen3(-MoE) causal LM, layer by layer.

    calib_ids: LongTensor [n, seq] of calibration text, run in batches of `batch_size`. Layer i is calibrated on the
    outputs of the already-quantized layers 0..i-1. fmt "int4" (group-wise; group_size None means formats.py's
    default, 128) or "int8" (per output channel; group_size must be None). n_grid alphas in [0, 1) are tried per
    group; clip=True adds AWQ's max-value clip search.

    Returns {module name, e.g. "model.layers.0.self_attn.q_proj": QuantizedWeight} for every linear in the decoder
    layers (fused MoE experts as "...mlp.experts.{j}.gate_proj" etc.); never lm_head, embeddings or routers.

    The model is changed in place and left holding the dequantized weights (in its own dtype), so it can be
    evaluated as is. Its RMSNorm weights and the v_proj / up_proj rows carry the folded 1/s: the QuantizedWeights
    are only correct together with the model's current (not the original) norm weights, so an export must save
    those too.
    """
    from tqdm.auto import tqdm

    check_arguments(fmt, group_size, symmetric, model.config)
    if calib_ids.dim() != 2 or calib_ids.shape[0] == 0 or calib_ids.dtype != torch.long:
        raise ValueError(f"calib_ids must be a LongTensor [n, seq] with n >= 1, got {tuple(calib_ids.shape)} "
                         f"{calib_ids.dtype}")
    layers_name, decoder, layers = _decoder_layers(model)
    was_training = model.training
    model.eval()
    try:
        hidden_per_batch, calls = capture_layer_calls(decoder, layers, calib_ids, batch_size,
                                                      layers[0].input_layernorm.weight.device)
        if any(args for layer_calls in calls for args, _ in layer_calls):
            raise ValueError("AWQ expects decoder layers called with hidden_states and keywords only, got extra "
                             "positional arguments")
        calls = [[kwargs for _, kwargs in layer_calls] for layer_calls in calls]
        result = {}
        for i, layer in enumerate(tqdm(layers, desc=f"awq {fmt}", unit="layer")):
            result.update(awq_quantize_layer(layer, f"{layers_name}.{i}", hidden_per_batch, calls[i], model.config,
                                             fmt, group_size, symmetric, n_grid, clip))
            # the next layer calibrates on what this layer outputs once quantized
            hidden_per_batch = [layer_output(layer(hidden, **kwargs)) for hidden, kwargs in zip(hidden_per_batch,
                                                                                                 calls[i])]
    finally:
        model.train(was_training)
    return result
