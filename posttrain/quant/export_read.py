"""Read an export of posttrain.quant.export back: the compressed-tensors layouts (int8, int4, fp8, mxfp4, nvfp4),
bitsandbytes NF4, the own layout (fp8_e5m2, fp4) and fp16 checkpoints, into canonical QuantizedWeights (what the
engine loads), plus the checkpoint's float tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from posttrain.artifacts import weight_files
from posttrain.quant import export_fp
from posttrain.quant.export import INT4_OFFSET, PROVENANCE_NAME, source_shards
from posttrain.quant.export_fp import pop_module
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
    provenance_path = model_dir / PROVENANCE_NAME
    provenance = json.loads(provenance_path.read_text()) if provenance_path.exists() else {}
    if raw is None and provenance.get("format") != "fp16":
        raise ValueError(f"{model_dir / 'config.json'} has no quantization_config and {provenance_path} names no "
                         f"fp16 export: not a quantized export")
    tensors = {}
    for shard in source_shards(model_dir):
        with safe_open(shard, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    method = None if raw is None else raw.get("quant_method")
    if raw is None:  # fp16: a float checkpoint whose fp16 Linears the provenance file names
        quantized = export_fp.read_fp16(provenance.get("quantized_modules", []), tensors)
    elif method == "compressed-tensors":
        quantized = _read_compressed_tensors(raw, tensors)
    elif method == "bitsandbytes":
        quantized = _read_bnb_nf4(tensors)
    elif method == export_fp.OWN_QUANT_METHOD:
        quantized = export_fp.read_own_layout(raw, tensors)
    else:
        raise ValueError(f"{model_dir}: quant_method {method!r} is none of 'compressed-tensors', 'bitsandbytes', "
                         f"{export_fp.OWN_QUANT_METHOD!r}")
    return AutoConfig.from_pretrained(model_dir), quantized, tensors


def size_on_disk(model_dir: str | Path) -> int:
    """Bytes of the directory's weight files (safetensors shards with their headers; config/tokenizer excluded)."""
    return sum(path.stat().st_size for path in weight_files(Path(model_dir)))


def _canonical_format(weights) -> str:
    """The `formats.FORMATS` name of a compressed-tensors weight scheme this module writes."""
    kind = (weights.type, weights.num_bits, weights.strategy)
    if kind == ("float", 8, "channel"):
        return "fp8"
    if kind == ("float", 4, "group") and weights.group_size == 32:
        return "mxfp4"
    if kind == ("float", 4, "tensor_group") and weights.group_size == 16:
        return "nvfp4"
    if kind == ("int", 8, "channel") and weights.symmetric:
        return "int8"
    if kind == ("int", 4, "group"):
        return "int4"
    raise ValueError(f"compressed-tensors weight scheme (type, bits, strategy) = {kind} has no canonical format")


def _read_compressed_tensors(raw: dict, tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(raw)
    groups = list(config.config_groups.values())
    modules = sorted(key.removesuffix(".weight_scale") for key in tensors if key.endswith(".weight_scale"))
    quantized = {}
    for module in modules:
        weights = _module_weights(module, groups)
        fmt = _canonical_format(weights)
        if fmt == "fp8":
            local = pop_module(tensors, module, ("weight", "weight_scale"))
            codes = local["weight"]  # float8_e4m3fn [out, in]
            quantized[module] = QuantizedWeight("fp8", codes, local["weight_scale"].float().reshape(-1),
                                                shape=tuple(codes.shape))
            continue
        if fmt in export_fp.COMPRESSED_TENSORS_FP4:
            required = ("weight_packed", "weight_scale") + (("weight_global_scale",) if fmt == "nvfp4" else ())
            quantized[module] = export_fp.read_compressed_tensors_fp4(fmt, module, pop_module(tensors, module,
                                                                                               required))
            continue
        required = ("weight_packed", "weight_scale", "weight_shape")
        local = pop_module(tensors, module, required + (() if weights.symmetric else ("weight_zero_point",)))
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


def _module_weights(module: str, groups: list):
    """The weight args of the config group whose targets name `module`: a name or regex target before the class
    target "Linear" (compressed-tensors' precedence); an error when none or several groups name it."""
    from compressed_tensors.utils.match import match_name

    named = [group for group in groups if any(match_name(module, target) for target in group.targets)]
    matched = named or [group for group in groups if "Linear" in group.targets]
    if len(matched) != 1:
        raise ValueError(f"{module}: {len(matched)} compressed-tensors config groups target it, expected one")
    return matched[0].weights


def _read_bnb_nf4(tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    import bitsandbytes.functional as bnb_functional

    marker = ".weight.quant_state.bitsandbytes__"
    modules = sorted(key.split(marker)[0] for key in tensors if marker in key)
    quantized = {}
    for module in modules:
        packed = tensors.pop(f"{module}.weight")
        local = pop_module(tensors, f"{module}.weight", ("absmax", "quant_map"))
        state = bnb_functional.QuantState.from_dict(local, device=torch.device("cpu"))
        if state.quant_type != "nf4":
            raise ValueError(f"{module!r}: bitsandbytes quant_type {state.quant_type!r}, expected 'nf4'")
        quantized[module] = QuantizedWeight("nf4", packed, None, None, state.blocksize, True, tuple(state.shape),
                                            state)
    return quantized
