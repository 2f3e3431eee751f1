"""Write quantized weights as a Hugging Face model directory that transformers and vLLM load (all but the own layout
below, which only this project reads).

Layouts (one per format, chosen by `fmt`):

- int8 / int4 / fp8: compressed-tensors (`quantization_config.quant_method == "compressed-tensors"`), the
  layout vLLM serves as W8A16 / W4A16 (Marlin/Machete WNA16 kernels) and FP8 weight-only (W8A16-FP8).
  int8 (per channel) and int4 (group-wise) are `format: "pack-quantized"`: per Linear `weight_packed` int32
  [out, in * bits / 32], `weight_scale` [out, 1] (int8) or [out, in // group] (int4), `weight_shape` int64 [2],
  and for asymmetric int4 `weight_zero_point` int32 [out * 4 / 32, in // group] (packed along rows). A mixed
  int4 export (some projections kept in int8: `module_formats`) has one config group per format, each targeting
  its projection names by regex; vLLM and our engine read it, transformers 5.24 cannot (one scheme for all dense
  layers when it dequantizes).
  fp8 is `format: "float-quantized"`: `weight` float8_e4m3fn [out, in] and `weight_scale` [out, 1].
  Packing and the config come from the compressed-tensors library (`pack_to_int32`, `QuantizationConfig`,
  `ModelCompressor.update_config`). compressed-tensors stores signed codes: its packer adds 2^(bits-1) before
  packing, so asymmetric int4 codes and zero points (canonical [0, 15]) are stored shifted by -8; the difference
  q - zero, and so the dequantized weight, is unchanged.
- nf4: the bitsandbytes serialisation transformers writes for a `load_in_4bit` NF4 model: `weight` (packed
  uint8) plus `weight.absmax`, `weight.quant_map`, `weight.quant_state.bitsandbytes__nf4` (and the nested keys
  under double quantization), `quantization_config.quant_method == "bitsandbytes"`.
- mxfp4 / nvfp4: compressed-tensors' `mxfp4-pack-quantized` / `nvfp4-pack-quantized` (its MXFP4A16 / NVFP4A16
  weight-only schemes, what vLLM serves): `weight_packed` uint8 [out, in / 2] (FP4 codes two a byte, the even
  column in the low nibble), `weight_scale` uint8 E8M0 codes [out, in / 32] (mxfp4) or float8_e4m3fn [out, in / 16]
  (nvfp4), and for nvfp4 `weight_global_scale` fp32 [1], compressed-tensors' global scale: the reciprocal of the
  canonical tensor scale, exact because that is a power of two (`formats`).
- fp16: a plain float checkpoint. The quantized Linears' `weight` is float16, every other tensor is copied unchanged,
  and config.json gets no `quantization_config` (a marker vLLM does not know would stop it loading the directory),
  so transformers, vLLM and `serve.engine.load_engine` load it as a float model, widening fp16 exactly.
  `quantize.json` (below) names the format and the fp16 modules; `export_read.load_quantized` reads them from it.
- fp8_e5m2 and fp4: no layout in compressed-tensors 0.20.1 (its 8-bit float is E4M3 only, its FP4 schemes are
  mxfp4 and nvfp4), so an own one: `quantization_config` = {"quant_method": "posttrain", "format", "group_size",
  "ignore", "layout_version": 1}. fp8_e5m2: `weight` float8_e5m2 [out, in] and `weight_scale` fp32 [out, 1] (the
  float-quantized names); fp4: `weight_packed` uint8 [out, in / 2] (packed as mxfp4's) and `weight_scale` fp32
  [out, in / group]. Only this project reads it (`load_quantized`, `load_engine`): transformers warns of an unknown
  quantization type and leaves the quantized Linears' weights randomly initialised; vLLM has no loader for it.

Scales are written as fp32 whatever the model dtype (those of mxfp4 and nvfp4 in their own formats, E8M0 and E4M3), so
that `export_read.load_quantized` returns exactly the exported scales (transformers and vLLM cast them to the dtype
they run in). `lm_head` and every Linear that is not in `quantized` stay in float and are listed in `ignore`
(`llm_int8_skip_modules` for nf4). vLLM fuses q/k/v and gate/up projections: it needs those siblings all quantized
or all ignored.

Loading the export with transformers on CPU (checked by tests/unit/test_quant_export.py):

    AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        # int8/int4/fp8: compressed-tensors keeps the weights packed and decompresses them to float on the
        # first forward pass (a forward pre-hook); no extra option is needed.
    AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                         quantization_config=CompressedTensorsConfig(dequantize=True))
        # dequantizes at load time instead (`run_compressed=False` is the deprecated spelling of this).
    AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                         quantization_config=CompressedTensorsConfig(dequantize=True))
        # mxfp4 / nvfp4: dequantized at load time, to bf16 (exact: an FP4 value times a power of two or an
        # E4M3 scale times the power-of-two tensor scale has at most 6 significant bits). Without dequantize=True
        # the first forward pass of an fp32 model fails: the library decompresses these to bf16 weights only.
    AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        # nf4: bitsandbytes Linear4bit modules (double quantization too), dequantized in each matmul (slow on CPU).
    Asymmetric int4 needs `dequantize=True`: with compressed-tensors 0.20.1 the default path fails with a
    weight_zero_point size mismatch (the library skips packing zero points on the meta device that
    transformers 5 loads on); the checkpoint itself holds the packed zero points vLLM reads.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from posttrain.artifacts import weight_files
from posttrain.quant import export_fp
from posttrain.quant.formats import FLOAT_FORMATS, FORMATS, PER_CHANNEL_FORMATS, QuantizedWeight

INDEX_NAME = "model.safetensors.index.json"
PROVENANCE_NAME = "quantize.json"
NOT_COPIED = {"config.json", INDEX_NAME, PROVENANCE_NAME}
KEPT_IN_FLOAT = "lm_head"  # vLLM and transformers expect the output projection unquantized
_CODE_RANGE = {("int8", True): (-127, 127), ("int4", True): (-8, 7), ("int4", False): (0, 15)}
INT4_OFFSET = 8  # compressed-tensors stores 4-bit codes signed: canonical asymmetric [0, 15] -> [-8, 7]


# ---------------------------------------------------------------- export


def export_quantized(
    src_dir: str | Path,
    quantized: dict[str, QuantizedWeight],
    out_dir: str | Path,
    fmt: str,
    group_size: int | None = None,
    symmetric: bool = True,
    method: str = "rtn",
) -> Path:
    """Write `src_dir` with the Linear weights named in `quantized` (module name -> weight) replaced.

    Everything is written into a hidden sibling directory that is renamed to `out_dir` only once complete, so
    `out_dir` either does not exist or is finished; a failed export removes its temp directory (a process
    killed outright leaves a `.<name>.partial-*` sibling, never `out_dir`). `out_dir` must not exist.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    if not quantized:
        raise ValueError("nothing to export: `quantized` is empty")
    if out_dir.exists():
        raise FileExistsError(f"export target {out_dir} already exists; refusing to overwrite it")
    shards = source_shards(src_dir)
    shapes = _checkpoint_shapes(shards)
    group_size = _common_group_size(quantized, fmt, group_size)
    schemes = module_schemes(quantized, fmt, group_size, symmetric)
    for name, qw in quantized.items():
        _check_quantized_weight(name, qw, shapes, *schemes[name])
    ignore = _float_linear_names(src_dir, quantized)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp_dir.mkdir()
    try:
        _write_weights(shards, quantized, tmp_dir)
        _copy_side_files(src_dir, tmp_dir)
        if fmt == "nf4":
            _write_bnb_config(src_dir, tmp_dir, quantized, ignore)
        elif fmt == "fp16":  # a plain float checkpoint: see the module docstring
            shutil.copy2(src_dir / "config.json", tmp_dir / "config.json")
        elif fmt in export_fp.OWN_LAYOUT_FORMATS:
            config = json.loads((src_dir / "config.json").read_text())
            config["quantization_config"] = export_fp.own_layout_config(fmt, group_size, ignore)
            (tmp_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            _write_compressed_tensors_config(src_dir, tmp_dir, schemes, ignore)
        provenance = {"format": fmt, "method": method, "group_size": group_size, "symmetric": symmetric,
                      "module_formats": projection_formats(schemes, fmt), "scale_dtype": "float32",
                      "quantized_modules": sorted(quantized), "float_linears": ignore, "source": str(src_dir)}
        (tmp_dir / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")
        os.rename(tmp_dir, out_dir)  # the commit point: same filesystem, so atomic
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def source_shards(src_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or the single model.safetensors."""
    index = src_dir / INDEX_NAME
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src_dir / name for name in names]
    single = src_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{src_dir} has neither model.safetensors nor {INDEX_NAME}")
    return [single]


def _checkpoint_shapes(shards: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers only (no tensor data is loaded)."""
    shapes = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _common_group_size(quantized: dict[str, QuantizedWeight], fmt: str, group_size: int | None) -> int | None:
    """The one group size of the export: `group_size` if given, else the weights' (which must all agree)."""
    if fmt in PER_CHANNEL_FORMATS or fmt == "fp16":
        if group_size is not None:
            raise ValueError(f"{fmt} has no groups (per output channel or no scale): group_size must be None, "
                             f"got {group_size}")
        return None
    if group_size is not None:
        return group_size
    sizes = {qw.group_size for qw in quantized.values() if qw.fmt == fmt}
    if len(sizes) != 1:
        raise ValueError(f"{fmt} export needs one group size; the quantized weights have {sorted(sizes, key=str)}")
    return sizes.pop()


def module_schemes(quantized: dict[str, QuantizedWeight], fmt: str, group_size: int | None,
                   symmetric: bool) -> dict[str, tuple[str, int | None, bool]]:
    """(fmt, group_size, symmetric) of each module: the export's, or int8 per channel for the modules of an int4
    export that `quantize_model(module_formats=...)` kept in int8 (written as a second compressed-tensors config
    group; no other mix has a layout here)."""
    schemes = {}
    for name, qw in quantized.items():
        if qw.fmt == fmt:
            schemes[name] = (fmt, group_size, symmetric)
        elif fmt == "int4" and qw.fmt == "int8":
            schemes[name] = ("int8", None, True)
        else:
            raise ValueError(f"{name!r} is {qw.fmt}, the export is {fmt}: the only mixed export is int4 with some "
                             f"linears in int8")
    return schemes


def projection_formats(schemes: dict[str, tuple], fmt: str) -> dict[str, str]:
    """{projection name: format} of the modules whose format is not the export's (e.g. {"down_proj": "int8"})."""
    return {name.rsplit(".", 1)[-1]: scheme[0] for name, scheme in sorted(schemes.items()) if scheme[0] != fmt}


def _check_quantized_weight(name: str, qw: QuantizedWeight, shapes: dict, fmt: str, group_size: int | None,
                            symmetric: bool) -> None:
    """Raise if `qw` cannot be written as module `name` of this export (names the module and what is wrong)."""
    key = f"{name}.weight"
    if key not in shapes:
        raise KeyError(f"quantized module {name!r} has no tensor {key!r} in the source checkpoint")
    if name.split(".")[-1] == KEPT_IN_FLOAT:
        raise ValueError(f"{name!r}: {KEPT_IN_FLOAT} stays in float in this export (listed in `ignore`)")
    if (qw.fmt, qw.group_size, qw.symmetric) != (fmt, group_size, symmetric):
        raise ValueError(f"{name!r} is (fmt, group_size, symmetric) = {(qw.fmt, qw.group_size, qw.symmetric)}, "
                         f"the export is {(fmt, group_size, symmetric)}")
    out_features, in_features = shapes[key]
    if tuple(qw.shape) != (out_features, in_features):
        raise ValueError(f"{name!r}: quantized shape {tuple(qw.shape)} != checkpoint {key} {shapes[key]}")
    if fmt in FLOAT_FORMATS:
        export_fp.check_float_weight(name, qw, group_size)
        return
    if fmt == "nf4":
        state = qw.quant_state
        if state is None or state.quant_type != "nf4" or tuple(state.shape) != tuple(qw.shape):
            raise ValueError(f"{name!r}: nf4 needs a bitsandbytes nf4 quant_state of shape {tuple(qw.shape)}")
        if qw.qweight.dtype != torch.uint8 or state.blocksize != group_size:
            raise ValueError(f"{name!r}: nf4 needs packed uint8 codes and blocksize {group_size}, got "
                             f"{qw.qweight.dtype} and {state.blocksize}")
        return
    code_dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
    if qw.qweight.dtype != code_dtype or tuple(qw.qweight.shape) != tuple(qw.shape):
        raise ValueError(f"{name!r}: codes must be {code_dtype} {tuple(qw.shape)}, got {qw.qweight.dtype} "
                         f"{tuple(qw.qweight.shape)}")
    scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
    if qw.scale is None or tuple(qw.scale.shape) != scale_shape:
        got = None if qw.scale is None else tuple(qw.scale.shape)
        raise ValueError(f"{name!r}: scale must have shape {scale_shape}, got {got}")
    if fmt == "fp8":
        return
    low, high = _CODE_RANGE[(fmt, symmetric)]
    # Out-of-range codes would be silently corrupted by bit packing.
    _check_range(f"{name!r} codes", qw.qweight, low, high)
    if not symmetric:
        if qw.zero is None or qw.zero.dtype != torch.int8 or tuple(qw.zero.shape) != scale_shape:
            raise ValueError(f"{name!r}: asymmetric int4 needs int8 zero points of shape {scale_shape}")
        _check_range(f"{name!r} zero points", qw.zero, 0, 15)


def _check_range(what: str, values: torch.Tensor, low: int, high: int) -> None:
    if values.numel() and (values.min() < low or values.max() > high):
        raise ValueError(f"{what} span [{values.min().item()}, {values.max().item()}], expected [{low}, {high}]")


def _float_linear_names(src_dir: Path, quantized: dict[str, QuantizedWeight]) -> list[str]:
    """The `ignore` list: lm_head, then every other nn.Linear of the model that is not quantized.

    Builds the model on the meta device (no memory) to know which modules are Linear; a quantized name that
    is not a Linear is an error, since neither compressed-tensors nor bitsandbytes would pick it up.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src_dir))
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    for name in quantized:
        if name not in linears:
            raise ValueError(f"quantized module {name!r} is not an nn.Linear of the model in {src_dir}")
    return [KEPT_IN_FLOAT] + sorted(linears - set(quantized) - {KEPT_IN_FLOAT})


def _write_weights(shards: list[Path], quantized: dict[str, QuantizedWeight], out_dir: Path) -> None:
    """Each source shard -> a shard of the same name with its quantized Linears replaced; index if sharded."""
    weight_map, total_bytes = {}, 0
    for shard in shards:
        tensors = {}
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                module = key.removesuffix(".weight")
                if module in quantized and key.endswith(".weight"):
                    for local, tensor in _serialized_tensors(quantized[module]).items():
                        tensors[f"{module}.{local}"] = tensor
                else:
                    tensors[key] = f.get_tensor(key)  # copied unchanged: same dtype and values
        save_file(tensors, out_dir / shard.name, metadata={"format": "pt"})
        weight_map.update({key: shard.name for key in tensors})
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _serialized_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One Linear's tensors under their module-local checkpoint names (`weight_packed`, `weight_scale`, ...)."""
    out_features, in_features = qw.shape
    if qw.fmt == "nf4":
        state = {f"weight.{key}": value for key, value in qw.quant_state.as_dict(packed=True).items()}
        return {"weight": qw.qweight.contiguous(), **state}
    if qw.fmt in FLOAT_FORMATS:
        return export_fp.float_tensors(qw)
    scale = qw.scale.float().reshape(out_features, -1).contiguous()  # channel: [out, 1]; group: [out, n_groups]
    if qw.fmt == "fp8":
        return {"weight": qw.qweight.contiguous(), "weight_scale": scale}
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    bits = 8 if qw.fmt == "int8" else 4
    codes = qw.qweight if qw.symmetric else qw.qweight - INT4_OFFSET  # int8 [out, in], signed
    tensors = {
        "weight_packed": pack_to_int32(codes.contiguous(), bits),  # int32 [out, in * bits / 32]
        "weight_scale": scale,
        "weight_shape": torch.tensor([out_features, in_features]),
    }
    if not qw.symmetric:
        # Zero points are packed along the output dim (dim 0), as compressed-tensors and vLLM expect.
        tensors["weight_zero_point"] = pack_to_int32((qw.zero - INT4_OFFSET).contiguous(), bits, packed_dim=0)
    return tensors


def _copy_side_files(src_dir: Path, out_dir: Path) -> None:
    """Tokenizer files, generation config, chat template, ...: every top-level file that is not a weight."""
    weights = {path.name for path in weight_files(src_dir)}
    for path in sorted(src_dir.iterdir()):
        if path.is_file() and path.name not in weights and path.name not in NOT_COPIED:
            shutil.copy2(path, out_dir / path.name)


def _compressed_tensors_scheme(fmt: str, group_size: int | None, symmetric: bool):
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if fmt == "fp8":  # weight-only: no input_activations, so activations stay in float
        weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
        return QuantizationScheme(targets=["Linear"], weights=weights, format=CompressionFormat.float_quantized)
    if fmt in export_fp.COMPRESSED_TENSORS_FP4:  # the library's weight-only presets
        from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16

        preset, layout = ((MXFP4A16, CompressionFormat.mxfp4_pack_quantized) if fmt == "mxfp4"
                          else (NVFP4A16, CompressionFormat.nvfp4_pack_quantized))
        return QuantizationScheme(targets=["Linear"], **preset, format=layout)
    if fmt == "int8":
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    else:
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size,
                                   symmetric=symmetric)
    return QuantizationScheme(targets=["Linear"], weights=weights, format=CompressionFormat.pack_quantized)


def scheme_targets(schemes: dict[str, tuple]) -> dict[tuple, list[str]]:
    """Each distinct scheme -> its compressed-tensors targets: ["Linear"] when there is one scheme, else a regex on
    the projection names that scheme covers (a projection name in two schemes has no such target: an error)."""
    projections: dict[tuple, set[str]] = {}
    for name, scheme in schemes.items():
        projections.setdefault(scheme, set()).add(name.rsplit(".", 1)[-1])
    if len(projections) == 1:
        return {scheme: ["Linear"] for scheme in projections}
    seen: dict[str, tuple] = {}
    for scheme, names in projections.items():
        for projection in names:
            if seen.setdefault(projection, scheme) != scheme:
                raise ValueError(f"{projection} modules are quantized as both {seen[projection]} and {scheme}: a "
                                 f"mixed export gives each projection name one format")
    return {scheme: [rf"re:.*\.({'|'.join(sorted(names))})$"] for scheme, names in projections.items()}


def _write_compressed_tensors_config(src_dir: Path, out_dir: Path, schemes: dict[str, tuple], ignore: list[str]
                                     ) -> None:
    """config.json from the source plus the compressed-tensors `quantization_config`, written by the library:
    one config group per scheme (`scheme_targets`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    groups = {}
    for i, (scheme, targets) in enumerate(scheme_targets(schemes).items()):
        groups[f"group_{i}"] = _compressed_tensors_scheme(*scheme).model_copy(update={"targets": targets})
    # one layout for every group: the only mix (`module_schemes`) is int4 with int8, both pack-quantized
    config = QuantizationConfig(config_groups=groups, format=groups["group_0"].format, ignore=ignore,
                                quantization_status=QuantizationStatus.COMPRESSED)
    shutil.copy2(src_dir / "config.json", out_dir / "config.json")
    ModelCompressor(quantization_config=config).update_config(str(out_dir))


def _write_bnb_config(src_dir: Path, out_dir: Path, quantized: dict[str, QuantizedWeight],
                      ignore: list[str]) -> None:
    """config.json with the `quantization_config` transformers writes for a load_in_4bit NF4 model."""
    from transformers import BitsAndBytesConfig

    config = json.loads((src_dir / "config.json").read_text())
    nested = {qw.quant_state.nested for qw in quantized.values()}
    if len(nested) > 1:
        raise ValueError("nf4 export needs double quantization on all modules or none; the weights mix both")
    compute_dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                             bnb_4bit_use_double_quant=bool(nested and nested.pop()),
                             llm_int8_skip_modules=ignore)
    config["quantization_config"] = bnb.to_dict()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
