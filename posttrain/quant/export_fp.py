"""The floating-point formats of an export (fp16, fp8_e5m2, fp4, mxfp4, nvfp4): their tensors on disk, their checks,
and reading them back into canonical QuantizedWeights. `export` and `export_read` call these; the layouts are
described in `export`'s module docstring.

FP4 codes (fp4, mxfp4, nvfp4) are stored two per byte, the even column in the low nibble: compressed-tensors' FP4
packing (`pack_fp4_to_uint8`), which vLLM reads.
"""

from __future__ import annotations

import torch

from posttrain.quant.formats import FIXED_BLOCK, FLOAT_FORMATS, QuantizedWeight

OWN_LAYOUT_FORMATS = ("fp8_e5m2", "fp4")  # no compressed-tensors layout in 0.20.1: quant_method "posttrain"
OWN_QUANT_METHOD = "posttrain"
OWN_LAYOUT_VERSION = 1
COMPRESSED_TENSORS_FP4 = ("mxfp4", "nvfp4")  # compressed-tensors' mxfp4- / nvfp4-pack-quantized


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes uint8 [out, in] (0..15) -> uint8 [out, in / 2], column 2j in the low nibble, 2j + 1 in the high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_fp4`: uint8 [out, in / 2] -> FP4 codes uint8 [out, in]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def float_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One Linear's tensors under their module-local checkpoint names, for a format of FLOAT_FORMATS."""
    out_features = qw.shape[0]
    if qw.fmt == "fp16":
        return {"weight": qw.qweight.contiguous()}
    if qw.fmt == "fp8_e5m2":  # fp8's float-quantized names and shapes, with E5M2 codes
        return {"weight": qw.qweight.contiguous(), "weight_scale": qw.scale.float().reshape(out_features, 1)}
    tensors = {"weight_packed": pack_fp4(qw.qweight), "weight_scale": qw.scale.contiguous()}
    if qw.fmt == "nvfp4":  # compressed-tensors' global scale is the reciprocal: exact, the tensor scale is 2^k
        tensors["weight_global_scale"] = (1.0 / qw.tensor_scale.float()).reshape(1)
    return tensors


def check_float_weight(name: str, qw: QuantizedWeight, group_size: int | None) -> None:
    """Raise naming module `name` unless `qw`'s tensors have its format's dtypes and shapes (and FP4 codes fit)."""
    out_features, in_features = qw.shape
    code_dtype = {"fp16": torch.float16, "fp8_e5m2": torch.float8_e5m2}.get(qw.fmt, torch.uint8)
    if qw.qweight.dtype != code_dtype or tuple(qw.qweight.shape) != tuple(qw.shape):
        raise ValueError(f"{name!r}: {qw.fmt} codes must be {code_dtype} {tuple(qw.shape)}, got {qw.qweight.dtype} "
                         f"{tuple(qw.qweight.shape)}")
    if qw.fmt == "fp16":
        return
    scale_dtype = {"mxfp4": torch.uint8, "nvfp4": torch.float8_e4m3fn}.get(qw.fmt, torch.float32)
    scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
    if qw.scale is None or qw.scale.dtype != scale_dtype or tuple(qw.scale.shape) != scale_shape:
        got = None if qw.scale is None else f"{qw.scale.dtype} {tuple(qw.scale.shape)}"
        raise ValueError(f"{name!r}: {qw.fmt} scale must be {scale_dtype} {scale_shape}, got {got}")
    if qw.fmt == "fp8_e5m2":
        return
    if qw.qweight.numel() and int(qw.qweight.max()) > 15:  # packing two a byte would corrupt a wider code
        raise ValueError(f"{name!r}: FP4 codes span [0, {int(qw.qweight.max())}], expected [0, 15]")
    if qw.fmt == "nvfp4":
        scale = qw.tensor_scale
        if not (scale is not None and scale.numel() == 1 and float(scale) > 0
                and float(torch.frexp(scale.float())[0]) == 0.5):
            raise ValueError(f"{name!r}: nvfp4 needs a tensor_scale that is one positive power of two (its "
                             f"reciprocal is stored exactly), got {scale}")


def own_layout_config(fmt: str, group_size: int | None, ignore: list[str]) -> dict:
    """The `quantization_config` of the own layout (fp8_e5m2, fp4)."""
    return {"quant_method": OWN_QUANT_METHOD, "format": fmt, "group_size": group_size, "ignore": ignore,
            "layout_version": OWN_LAYOUT_VERSION}


def pop_module(tensors: dict[str, torch.Tensor], module: str, required: tuple[str, ...]) -> dict:
    """Remove module `module`'s tensors from `tensors` -> {local name: tensor}; raise naming a missing one."""
    prefix = f"{module}."
    local = {key[len(prefix):]: tensors.pop(key) for key in [k for k in tensors if k.startswith(prefix)]}
    missing = [f"{prefix}{name}" for name in required if name not in local]
    if missing:
        raise KeyError(f"quantized module {module!r} lacks {missing} in the checkpoint")
    return local


def read_own_layout(raw: dict, tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """The quantized Linears of an own-layout export, removed from `tensors`."""
    fmt, group_size, version = raw.get("format"), raw.get("group_size"), raw.get("layout_version")
    if fmt not in OWN_LAYOUT_FORMATS or version != OWN_LAYOUT_VERSION:
        raise ValueError(f"quantization_config (quant_method {OWN_QUANT_METHOD!r}) has format {fmt!r}, "
                         f"layout_version {version!r}; this reader knows {OWN_LAYOUT_FORMATS}, version "
                         f"{OWN_LAYOUT_VERSION}")
    modules = sorted(key.removesuffix(".weight_scale") for key in tensors if key.endswith(".weight_scale"))
    quantized = {}
    for module in modules:
        if fmt == "fp8_e5m2":
            local = pop_module(tensors, module, ("weight", "weight_scale"))
            codes = local["weight"]
            quantized[module] = QuantizedWeight(fmt, codes, local["weight_scale"].reshape(-1), shape=tuple(codes.shape))
            continue
        local = pop_module(tensors, module, ("weight_packed", "weight_scale"))
        codes = unpack_fp4(local["weight_packed"])
        quantized[module] = QuantizedWeight(fmt, codes, local["weight_scale"], group_size=group_size,
                                            shape=tuple(codes.shape))
    return quantized


def read_compressed_tensors_fp4(fmt: str, module: str, local: dict[str, torch.Tensor]) -> QuantizedWeight:
    """One mxfp4 / nvfp4 Linear from its compressed-tensors tensors (weight_packed, weight_scale[, global scale])."""
    codes = unpack_fp4(local["weight_packed"])
    tensor_scale = None
    if fmt == "nvfp4":
        global_scale = local["weight_global_scale"].float()
        if global_scale.numel() != 1:
            raise ValueError(f"{module!r}: weight_global_scale has {global_scale.numel()} values, expected 1")
        tensor_scale = (1.0 / global_scale).reshape(())
    return QuantizedWeight(fmt, codes, local["weight_scale"], group_size=FIXED_BLOCK[fmt], shape=tuple(codes.shape),
                           tensor_scale=tensor_scale)


def read_fp16(modules: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """The fp16 Linears named by the provenance file, removed from `tensors` (a plain float checkpoint otherwise)."""
    quantized = {}
    for module in modules:
        weight = tensors.pop(f"{module}.weight", None)
        if weight is None or weight.dtype != torch.float16:
            got = None if weight is None else weight.dtype
            raise ValueError(f"fp16 export: module {module!r} needs a float16 tensor {module}.weight, got {got}")
        quantized[module] = QuantizedWeight("fp16", weight, None, shape=tuple(weight.shape))
    return quantized
