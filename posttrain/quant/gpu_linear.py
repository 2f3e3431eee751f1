"""Drop-in replacements for nn.Linear that multiply by an int8 or int4 weight with the Triton kernels (GPU serving).

`TritonQuantLinear(qw, bias, device)` holds one canonical `formats.QuantizedWeight` in the layout
`triton_kernels` reads, on `device`:
- int8 (per output channel, symmetric): codes int8 [out, in], scale fp32 [out]  -> `w8a16_matmul`
- int4 (group-wise, sym or asym): codes packed two per byte by `pack_int4` into uint8 [out, in // 2],
  scale fp32 [out, in // G], zero int8 [out, in // G] or None (symmetric)       -> `w4a16_matmul`
The dequantized weight never exists in memory; activations stay in their dtype (bf16/fp16 on a GPU, fp32 works
too) and the bias, if any, is added after the product.

`swap_linears_triton(model, quantized, device)` replaces named nn.Linear modules in place. It is built from two
halves that a benchmark can use separately: `build_triton_linears` (check the names, build the modules, touch
nothing) and `replace_modules` (put given modules at given names). The benchmark builds the modules once and puts
the same instances into our engine's model and into the transformers model, so both run the same kernels.

`kernels` (every constructor takes it) is the module providing `pack_int4`, `w8a16_matmul`, `w4a16_matmul` and
`interpreter_active`; by default `posttrain.quant.triton_kernels`. Tests pass a copy of that module loaded with
the Triton interpreter on, which runs the kernels on CPU tensors (see tests/unit/test_triton_kernels.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from posttrain.quant.formats import QuantizedWeight
from posttrain.quant.linear import quantized_target

TRITON_FORMATS = ("int8", "int4")


def default_kernels() -> ModuleType:
    # Imported on first use: triton is an optional dependency (the `gpu` extra) and slow to import.
    from posttrain.quant import triton_kernels

    return triton_kernels


def _check_quantized(qw: QuantizedWeight) -> None:
    """Raise unless `qw` is an int8 or int4 QuantizedWeight whose tensors have the contract's shapes."""
    if qw.fmt not in TRITON_FORMATS:
        raise ValueError(f"TritonQuantLinear serves {TRITON_FORMATS}, got fmt {qw.fmt!r}")
    out_features, in_features = qw.shape
    if qw.qweight.dtype != torch.int8 or tuple(qw.qweight.shape) != (out_features, in_features):
        raise ValueError(f"{qw.fmt} qweight must be int8 {(out_features, in_features)}, got "
                         f"{qw.qweight.dtype} {tuple(qw.qweight.shape)}")
    if qw.fmt == "int8":
        if qw.scale is None or tuple(qw.scale.shape) != (out_features,):
            got = None if qw.scale is None else tuple(qw.scale.shape)
            raise ValueError(f"int8 scale must have shape ({out_features},) (per output channel), got {got}")
        return
    group_size = qw.group_size
    if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size:
        raise ValueError(f"int4 group_size {group_size!r} must be a positive int dividing in_features {in_features}")
    if in_features % 2:
        raise ValueError(f"int4 in_features {in_features} must be even (two codes per packed byte)")
    groups = (out_features, in_features // group_size)
    if qw.scale is None or tuple(qw.scale.shape) != groups:
        got = None if qw.scale is None else tuple(qw.scale.shape)
        raise ValueError(f"int4 scale must have shape {groups} (one per group of input columns), got {got}")
    if qw.symmetric and qw.zero is not None:
        raise ValueError("int4 symmetric=True must have zero=None (codes in [-8, 7]), got a zero tensor")
    if not qw.symmetric and (qw.zero is None or tuple(qw.zero.shape) != groups):
        got = None if qw.zero is None else tuple(qw.zero.shape)
        raise ValueError(f"int4 symmetric=False needs zero int8 {groups}, got {got}")


class TritonQuantLinear(nn.Module):
    """y = x @ dequant(W)^T + bias for x [..., in_features] -> [..., out_features] in x's dtype."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device | str,
                 kernels: ModuleType | None = None):
        super().__init__()
        _check_quantized(qw)
        kernels = kernels or default_kernels()
        device = torch.device(device)
        if device.type == "cpu" and not kernels.interpreter_active():
            raise ValueError("TritonQuantLinear on CPU needs kernels loaded with the Triton interpreter "
                             "(TRITON_INTERPRET=1 before triton_kernels is imported); use a CUDA device")
        self.fmt, self.group_size = qw.fmt, qw.group_size
        self.out_features, self.in_features = qw.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({self.out_features},)")
        # The kernels want fp32 scales and index them as scale[n] / scale[n, g]: contiguous fp32 on the device.
        scale = qw.scale.detach().to(device=device, dtype=torch.float32).contiguous()
        if qw.fmt == "int8":
            self.register_buffer("qweight", qw.qweight.detach().to(device).contiguous())
            self.register_buffer("scale", scale)
            self._matmul = kernels.w8a16_matmul  # a function, not the module: keeps copy.deepcopy working
        else:
            self.register_buffer("packed", kernels.pack_int4(qw.qweight.detach().to(device)))  # [out, in // 2]
            self.register_buffer("scale", scale)
            zero = None if qw.zero is None else qw.zero.detach().to(device=device, dtype=torch.int8).contiguous()
            self.register_buffer("zero", zero)
            self._matmul = kernels.w4a16_matmul
        self.register_buffer("bias", None if bias is None else bias.detach().to(device))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}, symmetric={self.zero is None}" if self.fmt == "int4" else ""
        return f"{self.in_features}->{self.out_features}, fmt={self.fmt}{group}, bias={self.bias is not None}"

    def weight_bytes(self) -> int:
        """Bytes one call reads besides x: codes, scales, zero points and bias (what decode streams per token)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has shape {tuple(x.shape)}, expected [..., in_features={self.in_features}]")
        if self.fmt == "int8":
            y = self._matmul(x, self.qweight, self.scale)
        else:
            y = self._matmul(x, self.packed, self.scale, self.zero, self.group_size)
        # y is a fresh tensor in x's dtype: add the bias in place, cast to that dtype (no dtype promotion)
        return y if self.bias is None else y.add_(self.bias)


def build_triton_linears(model: nn.Module, quantized: dict[str, QuantizedWeight], device: torch.device | str,
                         kernels: ModuleType | None = None) -> dict[str, TritonQuantLinear]:
    """{name: TritonQuantLinear} for each named nn.Linear of `model`, keeping its bias; `model` is not changed.

    Every name is checked (present, nn.Linear, shape matching the QuantizedWeight) before anything is built."""
    linears = {name: quantized_target(model, name, qw)[2] for name, qw in quantized.items()}
    return {name: TritonQuantLinear(quantized[name], linear.bias, device, kernels) for name, linear in linears.items()}


def replace_modules(model: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """Put each module at its dotted name in `model` (in place; every name must already exist); returns model."""
    for name in modules:
        try:
            model.get_submodule(name)
        except AttributeError as exc:
            raise KeyError(f"model has no module named {name!r} to replace") from exc
    for name, module in modules.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, module)
    return model


def swap_linears_triton(model: nn.Module, quantized: dict[str, QuantizedWeight], device: torch.device | str,
                        kernels: ModuleType | None = None) -> nn.Module:
    """Replace each named nn.Linear of `model` by a TritonQuantLinear of its quantized weight on `device`, in place.

    Names not in `quantized` (say `lm_head`) stay as they are. Raises KeyError for a missing name, TypeError for a
    module that is not an nn.Linear, ValueError for a shape mismatch, before any module is replaced."""
    return replace_modules(model, build_triton_linears(model, quantized, device, kernels))
