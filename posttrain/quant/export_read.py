"""Read an export of posttrain.quant.export back: the compressed-tensors layout (int8, int4, fp8) and
bitsandbytes NF4, into canonical QuantizedWeights (what the engine loads), plus the checkpoint's float tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from posttrain.artifacts import weight_files
from posttrain.quant.export import INT4_OFFSET, source_shards
from posttrain.quant.formats import QuantizedWeight


def load_quantized(model_dir: str | Path) -> tuple[object, dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Read an export back -> (transformers config, module name -> canonical QuantizedWeight, float tensors).

    The inverse of `export_quantized`: codes are unpacked and shifted back to the canonical ranges, scales and
    zero points come back exactly as exported. The float tensors (embeddings, norms, float Linears) are the
    checkpoint's other tensors, unchanged, keyed by their checkpoint names.
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if raw is None:
        raise ValueError(f"{model_dir / 'config.json'} has no quantization_config: not a quantized export")
    tensors = {}
    for shard in source_shards(model_dir):
        with safe_open(shard, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        quantized = _read_compressed_tensors(raw, tensors)
    elif method == "bitsandbytes":
        quantized = _read_bnb_nf4(tensors)
    else:
        raise ValueError(f"{model_dir}: quant_method {method!r} is neither 'compressed-tensors' nor 'bitsandbytes'")
    return AutoConfig.from_pretrained(model_dir), quantized, tensors


def size_on_disk(model_dir: str | Path) -> int:
    """Bytes of the directory's weight files (safetensors shards with their headers; config/tokenizer excluded)."""
    return sum(path.stat().st_size for path in weight_files(Path(model_dir)))


def _canonical_format(weights) -> str:
    """The `formats.FORMATS` name of a compressed-tensors weight scheme this module writes."""
    kind = (weights.type, weights.num_bits, weights.strategy)
    if kind == ("float", 8, "channel"):
        return "fp8"
    if kind == ("int", 8, "channel") and weights.symmetric:
        return "int8"
    if kind == ("int", 4, "group"):
        return "int4"
    raise ValueError(f"compressed-tensors weight scheme (type, bits, strategy) = {kind} has no canonical format")


def _pop_module(tensors: dict[str, torch.Tensor], module: str, required: tuple[str, ...]) -> dict:
    """Remove module `module`'s tensors from `tensors` -> {local name: tensor}; raise naming a missing one."""
    prefix = f"{module}."
    local = {key[len(prefix):]: tensors.pop(key) for key in [k for k in tensors if k.startswith(prefix)]}
    missing = [f"{prefix}{name}" for name in required if name not in local]
    if missing:
        raise KeyError(f"quantized module {module!r} lacks {missing} in the checkpoint")
    return local


def _read_compressed_tensors(raw: dict, tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(raw)
    if len(config.config_groups) != 1:
        raise ValueError(f"expected one compressed-tensors config group, found {sorted(config.config_groups)}")
    weights = next(iter(config.config_groups.values())).weights
    fmt = _canonical_format(weights)
    modules = sorted(key.removesuffix(".weight_scale") for key in tensors if key.endswith(".weight_scale"))
    quantized = {}
    for module in modules:
        if fmt == "fp8":
            local = _pop_module(tensors, module, ("weight", "weight_scale"))
            codes = local["weight"]  # float8_e4m3fn [out, in]
            quantized[module] = QuantizedWeight("fp8", codes, local["weight_scale"].float().reshape(-1),
                                                shape=tuple(codes.shape))
            continue
        required = ("weight_packed", "weight_scale", "weight_shape")
        local = _pop_module(tensors, module, required + (() if weights.symmetric else ("weight_zero_point",)))
        shape = tuple(int(v) for v in local["weight_shape"].tolist())
        codes = unpack_from_int32(local["weight_packed"], weights.num_bits, torch.Size(shape))  # int8 [out, in]
        scale = local["weight_scale"].float()
        if fmt == "int8":
            quantized[module] = QuantizedWeight("int8", codes, scale.reshape(-1), shape=shape)
            continue
        zero = None
        if not weights.symmetric:
            zero = unpack_from_int32(local["weight_zero_point"], 4, scale.shape, packed_dim=0) + INT4_OFFSET
            codes = codes + INT4_OFFSET
        quantized[module] = QuantizedWeight("int4", codes, scale, zero, weights.group_size, weights.symmetric, shape)
    return quantized


def _read_bnb_nf4(tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    import bitsandbytes.functional as bnb_functional

    marker = ".weight.quant_state.bitsandbytes__"
    modules = sorted(key.split(marker)[0] for key in tensors if marker in key)
    quantized = {}
    for module in modules:
        packed = tensors.pop(f"{module}.weight")
        local = _pop_module(tensors, f"{module}.weight", ("absmax", "quant_map"))
        state = bnb_functional.QuantState.from_dict(local, device=torch.device("cpu"))
        if state.quant_type != "nf4":
            raise ValueError(f"{module!r}: bitsandbytes quant_type {state.quant_type!r}, expected 'nf4'")
        quantized[module] = QuantizedWeight("nf4", packed, None, None, state.blocksize, True, tuple(state.shape),
                                            state)
    return quantized
