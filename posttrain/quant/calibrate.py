"""Quantize every decoder linear of a Hugging Face causal LM (Qwen3, Qwen2, Llama layouts) with RTN, GPTQ or AWQ.

Quantized: `model.model.layers[i].self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`, and MoE experts: as
`nn.Linear` modules (`mlp.experts.j.gate_proj`, shared experts) or fused 3-D parameters (transformers 5's Qwen3-MoE
`mlp.experts.gate_up_proj` [experts, 2 * inter, hidden], gate rows first, and `down_proj` [experts, hidden, inter]),
keyed like the checkpoint as "...mlp.experts.{j}.gate_proj" etc. Never quantized: the MoE router `mlp.gate`,
`shared_expert_gate`, `lm_head`, embeddings, norms. Other 3-D parameters are left in float with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn
from tqdm.auto import tqdm

from posttrain.quant.formats import QuantizedWeight, dequantize_weight, quantize_weight, resolve_group_size
from posttrain.quant.awq import awq_quantize_model
from posttrain.quant.gptq import GPTQ_FORMATS, HessianAccumulator, gptq_quantize
from posttrain.quant.layer_calls import capture_layer_calls, layer_output
from posttrain.quant.microscaling import check_finite

log = logging.getLogger("posttrain")

METHODS = ("rtn", "gptq", "awq")
# Last name component of the linears we quantize; the router is `mlp.gate`, whose last component is "gate".
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """`model.model.layers` of a causal LM, with an error that says what was expected."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.model.layers` ModuleList (expected a Qwen3/Qwen2/"
                         "Llama-style causal LM)")
    return layers


def quantizable_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The layer's linears to quantize, keyed by their name inside the layer (e.g. "self_attn.q_proj")."""
    return {
        name: module
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS
    }


def fused_experts(layer: nn.Module) -> nn.Module | None:
    """The layer's fused experts module (Qwen3-MoE layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]), if any."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return None
    # Shapes rule out a transposed layout; an interleaved gate/up layout has the same shapes and is not detected.
    shapes_fit = gate_up.dim() == down.dim() == 3 and gate_up.shape[2] == down.shape[1]
    if not shapes_fit or gate_up.shape[1] != 2 * down.shape[2]:
        return None  # another layout: left in float, warned about
    return experts


def quantization_targets(layer: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """{full name: weight [out, in]} of what to quantize in one decoder layer; fused experts give views into
    their 3-D parameters, so writing a target writes the model."""
    targets = {f"{prefix}.{name}": linear.weight for name, linear in quantizable_linears(layer).items()}
    experts = fused_experts(layer)
    if experts is not None:
        inter = experts.down_proj.shape[2]
        for j in range(experts.gate_up_proj.shape[0]):
            targets[f"{prefix}.mlp.experts.{j}.gate_proj"] = experts.gate_up_proj[j, :inter]
            targets[f"{prefix}.mlp.experts.{j}.up_proj"] = experts.gate_up_proj[j, inter:]
            targets[f"{prefix}.mlp.experts.{j}.down_proj"] = experts.down_proj[j]
    handled = {id(p) for p in (experts.gate_up_proj, experts.down_proj)} if experts is not None else set()
    skipped = [name for name, p in layer.named_parameters() if p.dim() == 3 and id(p) not in handled]
    if skipped:
        log.warning("quantize_model: 3-D weights of an unknown layout left in float: %s",
                    ", ".join(f"{prefix}.{name}" for name in skipped))
    return targets


@torch.no_grad()
def _write_back(weight: torch.Tensor, q: QuantizedWeight) -> None:
    weight.copy_(dequantize_weight(q, dtype=weight.dtype))


def quantize_model(
    model: nn.Module,
    method: str = "rtn",
    fmt: str = "int4",
    group_size: int | None = None,
    symmetric: bool = True,
    calib_ids: torch.Tensor | None = None,
    *,
    damp: float = 0.01,
    act_order: bool = False,
    calib_batch_size: int = 8,
    module_formats: dict[str, str] | None = None,
) -> dict[str, QuantizedWeight]:
    """Quantize the decoder linears of `model` in place; returns {module name: QuantizedWeight}.

    Keys are full module names, e.g. "model.layers.0.self_attn.q_proj". Afterwards the model's linear weights
    hold the *dequantized* values (same dtype as before), so the model can be evaluated in float as the quantized
    model would compute; the returned QuantizedWeights are what an export packs.

    method "rtn": round to nearest, no data. "gptq": needs calib_ids [n, seq] (LongTensor); runs layer by layer,
    each layer calibrated on the outputs of the already quantized layers before it (damp, act_order: see
    `gptq_quantize`; calib_batch_size rows per forward). "awq": delegates to
    `posttrain.quant.awq.awq_quantize_model(model, fmt, group_size, symmetric, calib_ids)`.

    module_formats maps a projection name (the last name component, e.g. "down_proj") to int8: those linears are
    quantized per output channel to int8 instead (a mixed copy, like llama.cpp's q4_k_m keeping some of ffn_down
    in 6 bits), with the same method and calibration. RTN and GPTQ only.

    GPTQ memory: the hidden states of all calibration rows (n * seq * hidden in the model dtype) and, for the
    current layer, one float64 [in, in] Hessian per linear (per expert for MoE layers).
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {METHODS}")
    if method != "rtn" and (calib_ids is None or calib_ids.dim() != 2 or calib_ids.shape[0] == 0
                            or calib_ids.dtype != torch.long):
        got = None if calib_ids is None else f"{tuple(calib_ids.shape)} {calib_ids.dtype}"
        raise ValueError(f"{method} needs calib_ids as a LongTensor [n, seq] with n >= 1, got {got}")
    check_module_formats(module_formats, method)
    if method == "awq":
        return awq_quantize_model(model, fmt, group_size, symmetric, calib_ids)
    if method == "gptq" and fmt not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ supports fmt in {GPTQ_FORMATS}, got {fmt!r}")
    layers = decoder_layers(model)
    names = {module: name for name, module in model.named_modules()}
    targets_per_layer = [quantization_targets(layer, names[layer]) for layer in layers]
    scheme = Schemes((fmt, group_size, symmetric), module_formats or {})
    _check_targets_fit(targets_per_layer, scheme)  # fail before any weight is changed
    if method == "rtn":
        return _rtn_model(targets_per_layer, scheme)
    was_training = model.training
    model.eval()
    try:
        return _gptq_model(model, layers, [names[layer] for layer in layers], targets_per_layer, scheme,
                           calib_ids, damp, act_order, calib_batch_size)
    finally:
        model.train(was_training)


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MODULE_FORMATS = ("int8",)  # what `module_formats` may give a projection: per channel, symmetric


def check_module_formats(module_formats: dict[str, str] | None, method: str) -> None:
    """Raise, naming the key, unless every entry maps a quantized projection to a format in MODULE_FORMATS."""
    for projection, fmt in (module_formats or {}).items():
        if projection not in QUANTIZED_PROJECTIONS:
            raise ValueError(f"module_formats key {projection!r} is not a quantized projection; expected one of "
                             f"{QUANTIZED_PROJECTIONS}")
        if fmt not in MODULE_FORMATS:
            raise ValueError(f"module_formats.{projection}={fmt!r}: expected one of {MODULE_FORMATS}")
    for siblings in FUSED_SIBLINGS:  # vLLM runs these as one matmul: one format for all of them
        if len({(module_formats or {}).get(projection) for projection in siblings}) > 1:
            raise ValueError(f"module_formats: {', '.join(siblings)} read the same input and are fused by vLLM; "
                             f"give them one format")
    if module_formats and method == "awq":
        raise ValueError("module_formats is an RTN / GPTQ option: AWQ scales every linear of a layer for one format")


class Schemes:
    """(fmt, group_size, symmetric) per module: the variant's, or the per-channel format `overrides` gives the
    module's projection name."""

    def __init__(self, default: tuple[str, int | None, bool], overrides: dict[str, str]):
        self.default, self.overrides = default, dict(overrides)

    def __call__(self, name: str) -> tuple[str, int | None, bool]:
        fmt = self.overrides.get(name.rsplit(".", 1)[-1])
        return self.default if fmt is None else (fmt, None, True)


def _check_targets_fit(targets_per_layer, scheme: Schemes) -> None:
    fmt, _, symmetric = scheme.default
    if not symmetric and fmt != "int4":
        raise ValueError(f"{fmt} is symmetric only; symmetric=False is int4 only")
    for targets in targets_per_layer:
        for name, weight in targets.items():
            fmt, group_size, _ = scheme(name)
            try:
                resolve_group_size(fmt, group_size, weight.shape[1])
                check_finite(weight.detach(), fmt)  # a NaN would give NaN scales, or no FP4 code at all
            except ValueError as error:
                raise ValueError(f"{name} weight {tuple(weight.shape)}: {error}") from None


def _rtn_model(targets_per_layer, scheme: Schemes) -> dict[str, QuantizedWeight]:
    results = {}
    for targets in tqdm(targets_per_layer, desc=f"rtn {scheme.default[0]}", unit="layer"):
        for name, weight in targets.items():
            try:
                results[name] = quantize_weight(weight, *scheme(name))
            except ValueError as error:  # e.g. an fp16 weight beyond 65504: say which module holds it
                raise ValueError(f"{name} weight {tuple(weight.shape)}: {error}") from None
            _write_back(weight, results[name])
    return results


def _expert_hessian_hook(gate_up: list[HessianAccumulator], down: list[HessianAccumulator]):
    """Pre-hook for a fused experts module called as experts(hidden [T, H], top_k_index [T, k], top_k_weights):
    expert j's gate/up read the tokens routed to it, its down_proj reads act(gate) * up of those tokens."""

    def hook(experts, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        inter = experts.down_proj.shape[2]
        for j in range(experts.gate_up_proj.shape[0]):
            tokens = hidden[(top_k_index == j).any(dim=-1)]  # [t_j, H]
            if tokens.shape[0] == 0:
                continue
            gate_up[j].add(tokens)
            projected = tokens @ experts.gate_up_proj[j].T  # [t_j, 2I], gate columns first
            down[j].add(experts.act_fn(projected[:, :inter]) * projected[:, inter:])

    return hook


class _SharedInputs:
    """Forward pre-hooks that give every quantization target of a layer the Hessian of its input, one accumulator
    per distinct input tensor: q_proj, k_proj and v_proj read the same normed hidden states, as do gate_proj and
    up_proj, so their Hessian is summed once and GPTQ runs once on their weights stacked by rows (`_quantize_group`).
    Which linears share an input is read from the first call (the same tensor object reaches each of them)."""

    def __init__(self):
        self.by_name: dict[str, HessianAccumulator] = {}
        self._added: list[tuple[torch.Tensor, HessianAccumulator]] = []  # this call's inputs, held until end_call

    def pre_hook(self, name: str, in_features: int):
        def hook(module, args):
            x = args[0]
            accumulator = self.by_name.get(name)
            if accumulator is None:
                accumulator = next((a for seen, a in self._added if seen is x), None)
                accumulator = self.by_name[name] = accumulator or HessianAccumulator(in_features)
            if not any(seen is x and a is accumulator for seen, a in self._added):
                accumulator.add(x)
                self._added.append((x, accumulator))

        return hook

    def end_call(self) -> None:
        self._added.clear()


def _hook_hessians(layer: nn.Module, prefix: str) -> tuple[dict[str, HessianAccumulator], _SharedInputs, list]:
    """Hooks that accumulate the input Hessian of every quantization target of `layer` while it runs.

    Returns ({full name: accumulator} for the fused experts, the linears' shared-input hooks, hook handles); gate_proj
    and up_proj of a fused expert share one accumulator, as linears that read the same input do.
    """
    accumulators, handles, shared = {}, [], _SharedInputs()
    for name, linear in quantizable_linears(layer).items():
        handles.append(linear.register_forward_pre_hook(shared.pre_hook(f"{prefix}.{name}", linear.in_features)))
    experts = fused_experts(layer)
    if experts is not None:
        n_experts, _, hidden_size = experts.gate_up_proj.shape
        gate_up = [HessianAccumulator(hidden_size) for _ in range(n_experts)]
        down = [HessianAccumulator(experts.down_proj.shape[2]) for _ in range(n_experts)]
        for j in range(n_experts):
            base = f"{prefix}.mlp.experts.{j}"
            accumulators.update({f"{base}.gate_proj": gate_up[j], f"{base}.up_proj": gate_up[j],
                                 f"{base}.down_proj": down[j]})
        handles.append(experts.register_forward_pre_hook(_expert_hessian_hook(gate_up, down), with_kwargs=True))
    return accumulators, shared, handles


def _shared_hessian_groups(targets: dict[str, torch.Tensor], accumulators: dict[str, HessianAccumulator],
                           scheme: Schemes) -> list[tuple[HessianAccumulator, list[str]]]:
    """The targets grouped by their accumulator and scheme, in target order; a target the calibration never reached
    (an expert no token was routed to) gets an empty accumulator of its own: every input then counts as dead."""
    groups: dict[tuple, tuple[HessianAccumulator, list[str]]] = {}
    for name, weight in targets.items():
        accumulator = accumulators.get(name) or HessianAccumulator(weight.shape[1])
        groups.setdefault((id(accumulator), scheme(name)), (accumulator, []))[1].append(name)
    return list(groups.values())


def _quantize_group(weights: list[torch.Tensor], hessian: torch.Tensor, fmt, group_size, symmetric, damp,
                    act_order) -> list[QuantizedWeight]:
    """GPTQ on weights that share one input Hessian, stacked by rows and run once: GPTQ treats each output row
    on its own (its error is spread over its own later columns, its scales are its own), so the stack gives each
    weight the codes it would get alone, in one column loop instead of one per weight."""
    if len(weights) == 1:
        return [gptq_quantize(weights[0], hessian, fmt, group_size, symmetric, damp=damp, act_order=act_order)]
    whole = gptq_quantize(torch.cat([w.detach() for w in weights]), hessian, fmt, group_size, symmetric, damp=damp,
                          act_order=act_order)
    parts, start = [], 0
    for weight in weights:
        rows = slice(start, start + weight.shape[0])
        parts.append(replace(whole, qweight=whole.qweight[rows].clone(), scale=whole.scale[rows].clone(),
                             zero=None if whole.zero is None else whole.zero[rows].clone(),
                             shape=(weight.shape[0], whole.shape[1])))
        start = rows.stop
    return parts


@torch.no_grad()
def _gptq_model(model, layers, prefixes, targets_per_layer, scheme: Schemes, calib_ids, damp, act_order, batch_size):
    hidden_per_batch, calls = capture_layer_calls(model.model, layers, calib_ids, batch_size, model.device)
    results = {}
    for index in tqdm(range(len(layers)), desc=f"gptq {scheme.default[0]}", unit="layer"):
        layer, prefix, targets = layers[index], prefixes[index], targets_per_layer[index]
        # The layer's input comes from the quantized layers before it, but inside the layer every linear's
        # Hessian is taken with the layer still in float (one pass; GPTQ's "true sequential" option would re-run
        # the layer after quantizing q/k/v, then o, then gate/up).
        accumulators, shared, handles = _hook_hessians(layer, prefix)
        try:
            for hidden, (args, kwargs) in zip(hidden_per_batch, calls[index]):
                layer(hidden, *args, **kwargs)
                shared.end_call()
        finally:
            for handle in handles:
                handle.remove()
        for accumulator, names in _shared_hessian_groups(targets, {**shared.by_name, **accumulators}, scheme):
            quantized = _quantize_group([targets[name] for name in names], accumulator.hessian(), *scheme(names[0]),
                                        damp, act_order)
            for name, q in zip(names, quantized):
                results[name] = q
                _write_back(targets[name], q)
        # The next layer calibrates on what this layer outputs once quantized, as GPTQ does.
        hidden_per_batch = [layer_output(layer(hidden, *args, **kwargs))
                            for hidden, (args, kwargs) in zip(hidden_per_batch, calls[index])]
    return results
