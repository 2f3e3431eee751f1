"""Train only the top of a decoder: every parameter below the top N decoder layers is frozen.

A frozen parameter gets no gradient, and since nothing below the top N layers needs one, autograd's backward pass
stops at layer L - N: a step costs one forward pass plus the backward pass of N layers, against a forward and a
whole backward pass (about three forward passes) when every weight trains. The top N layers, the final norm and
any head above the decoder (a sequence-classification `score`, an `lm_head` that is not tied to the input
embeddings) keep training.
"""

from __future__ import annotations

from torch import nn


def freeze_below_top_layers(model: nn.Module, n: int) -> dict:
    """Freeze every parameter of `model` outside its top `n` decoder layers and the modules above them.

    The decoder layers are found as the first `ModuleList` named `layers` (`model.layers`, `model.model.layers`).
    A parameter shared with a frozen module (tied input and output embeddings) stays frozen. Returns
    {"layers": L, "trained_layers": n, "trainable_params": ..., "frozen_params": ...}.
    """
    layers = next((module for name, module in model.named_modules()
                   if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleList)), None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `layers` ModuleList of decoder layers to freeze below")
    if not 1 <= n <= len(layers):
        raise ValueError(f"train_top_layers={n}: {type(model).__name__} has {len(layers)} decoder layers; "
                         f"expected 1..{len(layers)}")
    frozen = {id(p) for layer in layers[: len(layers) - n] for p in layer.parameters()}
    below = _modules_before(model, layers)
    frozen |= {id(p) for module in below for p in module.parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) not in frozen)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"layers": len(layers), "trained_layers": n, "trainable_params": trainable,
            "frozen_params": total - trainable}


def _modules_before(model: nn.Module, layers: nn.ModuleList) -> list[nn.Module]:
    """The modules that feed the decoder layers: the siblings of `layers` registered before it (embeddings,
    rotary tables), so that an input embedding tied to the output head is frozen too."""
    for parent in model.modules():
        children = list(parent.named_children())
        if any(child is layers for _, child in children):
            before = []
            for _, child in children:
                if child is layers:
                    return before
                before.append(child)
    return []
