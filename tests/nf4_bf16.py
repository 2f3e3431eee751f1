"""How far a bitsandbytes NF4 model may be from float64-dequantized weights when its CPU kernel computes in bf16.

On CPUs with AVX512-BF16, bitsandbytes (0.50) repacks a `Linear4bit` weight on its first forward and runs its
`gemv_4bit` CPU kernel, which casts the activations and the per-block absmax to bf16, multiplies bf16 operands
(AVX-512 BF16 dot products, fp32 accumulation) and returns bf16, cast back to the caller's dtype. Elsewhere (AVX2
CPUs) it dequantizes to fp32 and calls F.linear, which is fp32-exact. So transformers' NF4 logits differ from a
model holding the same dequantized weights in fp32 by the rounding of bf16 (unit roundoff u = 2^-8, 8-bit
significand) of four quantities per Linear: its input, its block absmax, its weight elements and its output.

The size of that difference on a given network and input is obtained without the kernel: the reference model is run
again with exactly those four roundings applied (`bf16_kernel_logits`); its deviation from the reference is what
bf16 arithmetic does to these logits. The kernel rounds the same quantities to the same precision, but individual
values round differently (lookup table precision, accumulation order), so its deviation is another draw of the same
size: `bf16_kernel_bound` allows BF16_DRAW_FACTOR times the emulated one (observed ratio kernel / emulation 0.7-1.2
over tied and untied models and several inputs), plus the fp32 floor FP32_FLOOR that every fp32 path gets.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

BF16_DRAW_FACTOR = 2.0
FP32_FLOOR = 1e-4  # the bound fp32 paths get in these tests (accumulation order over a few layers)


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16 (round to nearest even), in t's dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


def bf16_kernel_weight(w: torch.Tensor, blocksize: int) -> torch.Tensor:
    """A dequantized NF4 weight [N, K] as the bf16 kernel multiplies it: bf16(code * bf16(absmax)) per block.

    NF4 maps each block's largest |w| to the code +-1, so that element's magnitude is the block's absmax.
    """
    blocks = w.reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    rescale = torch.where(absmax > 0, to_bf16(absmax) / absmax, torch.ones_like(absmax))
    return to_bf16((blocks * rescale).reshape(w.shape))


def bf16_kernel_logits(model: nn.Module, names: Iterable[str], blocksize: int, *inputs) -> torch.Tensor:
    """Logits of a copy of `model` whose Linears `names` (holding dequantized NF4 weights) round as the bf16 kernel
    does: weight via bf16_kernel_weight, input and output to bf16. `model` itself is not changed."""
    model = copy.deepcopy(model)
    for name in names:
        linear = model.get_submodule(name)
        with torch.no_grad():
            linear.weight.copy_(bf16_kernel_weight(linear.weight, blocksize))
        linear.register_forward_pre_hook(lambda module, args: (to_bf16(args[0]), *args[1:]))
        linear.register_forward_hook(lambda module, args, out: to_bf16(out))
    with torch.no_grad():
        return model(*inputs).logits


def bf16_kernel_bound(reference: torch.Tensor, emulated: torch.Tensor) -> float:
    """Max |logits - reference| allowed for an NF4 model that may run the bf16 kernel (see the module doc)."""
    return BF16_DRAW_FACTOR * (emulated.double() - reference.double()).abs().max().item() + FP32_FLOOR
