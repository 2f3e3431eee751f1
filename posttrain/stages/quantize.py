"""Quantize stage: parent model -> int8 / int4 / FP8 (E4M3, E5M2) / NF4 / FP16 / FP4 / MXFP4 / NVFP4 weights, exported
in a layout transformers and vLLM load (fp8_e5m2 and fp4 in an own layout only this project reads: quant.export).

One variant per stage (`quantize:<name>` in a pipeline): round-to-nearest, GPTQ or AWQ, the latter two calibrated
on the model's own SFT rows rendered through its chat template. The manifest reports what the format costs:
size on disk, bytes per parameter with scales, each layer's error (relative, and as a fraction of the weights'
spread), held-out perplexity against the parent, and the round-to-nearest error of every other format on the
same weights, so one artifact answers "what would int4 g32 or fp8 have cost". GPTQ and AWQ calibrate int4 / int8
codes; every other format is round-to-nearest only.

A `fmt: gguf` variant (`export_gguf_variant`) writes one `model.gguf` for llama.cpp instead, in the mix of block types
llama-quantize gives its `gguf_type` (q8_0, q4_0, q4_1, q4_k_m), with the same report.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from posttrain import training
from posttrain.artifacts import read_manifest, sha256_json
from posttrain.config_schema import GGUF_TYPES
from posttrain.data.chat_rows import load_rows, tokenize_rows
from posttrain.models.likelihood import perplexity
from posttrain.models.loading import load_gguf_model, load_tokenizer, model_location
from posttrain.quant.calibrate import check_module_formats, decoder_layers, quantization_targets, quantize_model
from posttrain.quant.export import export_quantized
from posttrain.quant.export_read import size_on_disk
from posttrain.quant.formats import GROUPED_FORMATS, bytes_per_param, quantize_weight, resolve_group_size, weight_error
from posttrain.quant.gguf_names import GGUF_NAME
from posttrain.registry import checkpoint_label
from posttrain.training import StageRun

log = logging.getLogger("posttrain")

# The formats the error table compares on the parent's weights (round to nearest, no data needed).
COMPARED_FORMATS = [("int8", None, True), ("int4", 32, True), ("int4", 64, True), ("int4", 128, True),
                    ("int4", 128, False), ("fp8", None, True), ("nf4", 64, True), ("fp16", None, True),
                    ("fp8_e5m2", None, True), ("fp4", 32, True), ("mxfp4", None, True), ("nvfp4", None, True)]


def format_label(fmt: str, group_size: int | None, symmetric: bool) -> str:
    """"int4 g128", "int4 g128 asym", "fp4 g32", "nf4 g64"; formats without a choice of group are just named."""
    label = f"{fmt} g{group_size}" if group_size is not None and fmt in GROUPED_FORMATS else fmt
    return label if symmetric or fmt != "int4" else label + " asym"


def rendered_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    return [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False) for r in rows]


def calibration_ids(tokenizer, rows: list[dict], length: int):
    """The rendered rows as one token stream cut into [n, length] sequences (GPTQ's and AWQ's usual input)."""
    import torch

    stream = [t for ids in rendered_ids(tokenizer, rows) for t in ids]
    n = len(stream) // length
    if n == 0:
        raise ValueError(f"calibration rows hold {len(stream)} tokens, fewer than one sequence of {length}")
    return torch.tensor(stream[: n * length]).view(n, length)


def layer_errors(originals: dict, quantized: dict) -> list[dict]:

    return [{"name": name, **weight_error(originals[name], q)} for name, q in quantized.items()]


# Above this many quantizable parameters the table of format errors is measured on a sample of each weight's rows:
# 12 formats over SmolLM2-135M's 106M parameters took 22 s on 2 cores, more than GPTQ itself. Every compared
# format keeps its scales within a row (a group, a block, the row itself), so a whole row is quantized exactly as
# in the full weight; only nvfp4's one tensor scale then comes from the sampled rows' largest value.
ERROR_TABLE_FULL_PARAMS = 20_000_000
ERROR_TABLE_ROWS = 128  # evenly spaced rows of each weight when sampled


def error_table_rows(originals: dict) -> int | None:
    """How many rows of each weight the format-error table measures: None for all of them."""
    return ERROR_TABLE_ROWS if sum(w.numel() for w in originals.values()) > ERROR_TABLE_FULL_PARAMS else None


def format_error_table(originals: dict) -> dict[str, dict]:
    """Round-to-nearest error of each compared format over all quantizable weights (parameter-weighted means),
    on every row of each weight, or on `error_table_rows` evenly spaced rows of each weight of a large model."""

    table = {}
    total = sum(w.numel() for w in originals.values())
    rows = error_table_rows(originals)
    for fmt, group, symmetric in COMPARED_FORMATS:
        if not all(_fits(fmt, group, w.shape[1]) for w in originals.values()):
            continue  # e.g. int4 g128, mxfp4 or nvfp4 on a model whose widths its groups do not divide
        rel = spread = nbytes = 0.0
        for full in originals.values():
            w = full if rows is None else full[::-(-full.shape[0] // rows)]  # at most `rows` evenly spaced rows
            q = quantize_weight(w, fmt, group_size=group, symmetric=symmetric)
            err = weight_error(w, q)
            rel += err["rel_error"] * full.numel() / total
            spread += err["of_spread"] * full.numel() / total
            nbytes += bytes_per_param(q, scale_bytes=4) * full.numel() / total
        table[format_label(fmt, group, symmetric)] = {"rel_error": rel, "of_spread": spread, "bytes_per_param": nbytes}
    return table


def variant_settings(name: str, variant) -> tuple[str, str, bool, int | None]:
    """(fmt, method, symmetric, group_size) of quantize variant `name`; group_size is None unless the format has a
    choice of group (mxfp4 and nvfp4 have fixed blocks). GPTQ and AWQ calibrate int4 / int8 codes only."""
    fmt, method, symmetric = variant["fmt"], variant["method"], variant["symmetric"]
    if method != "rtn" and fmt not in ("int4", "int8"):
        raise ValueError(f"quantize.variants.{name}: method {method} calibrates int4 / int8 codes; {fmt} is "
                         f"round-to-nearest only (method: rtn)")
    if variant["act_order"] and method != "gptq":
        raise ValueError(f"quantize.variants.{name}: act_order is a GPTQ option; method {method} would ignore it")
    if variant.get("module_formats"):
        if fmt != "int4":
            raise ValueError(f"quantize.variants.{name}.module_formats: int8 projections mix with int4 only, not {fmt}")
        try:
            check_module_formats(dict(variant["module_formats"]), method)
        except ValueError as error:
            raise ValueError(f"quantize.variants.{name}: {error}") from None
    return fmt, method, symmetric, variant["group_size"] if fmt in GROUPED_FORMATS else None


def _fits(fmt: str, group_size: int | None, in_features: int) -> bool:
    try:
        resolve_group_size(fmt, group_size, in_features)
    except ValueError:
        return False
    return True


def main(cfg, run: StageRun) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    # --- config: the variant is checked before anything loads ---------------------------------------------------
    training.begin(run)
    block = run.config["quantize"]
    name = block["variant"]
    variant = block["variants"][name]
    gguf = variant["fmt"] == "gguf"
    settings = gguf_settings(name, variant) if gguf else variant_settings(name, variant)
    if run.parent is None:
        raise ValueError("the quantize stage needs a parent artifact (parent=<stage dir>)")

    # --- the parent, and its perplexity on held-out rows ---------------------------------------------------------
    location = Path(model_location(cfg.model, run.parent))
    tokenizer = load_tokenizer(location)
    rows, record = load_rows(cfg.data)  # the training part: calibration never sees a held-out row
    held_out = held_out_rows(cfg.data, block["eval_rows"])
    ids, masks, _ = tokenize_rows(held_out, tokenizer, "held-out", None, {})
    held_out_ids = list(zip(ids, masks))
    model = AutoModelForCausalLM.from_pretrained(str(location), dtype=torch.float32).eval()
    parent_ppl = perplexity(model, held_out_ids)
    originals = {  # the float weights, to measure each layer's error against (MoE experts included)
        name: w.detach().clone()
        for i, layer in enumerate(decoder_layers(model))
        for name, w in quantization_targets(layer, f"model.layers.{i}").items()
    }

    # --- quantize and export: the returned model holds the weights the artifact will serve -----------------------
    torch.manual_seed(cfg.seed)
    if gguf:
        del model  # llama.cpp's writer reads the parent's files
        model, metrics = export_gguf_variant(name, settings, location, tokenizer, run)
    else:
        calib = calibration_ids(tokenizer, rows[: block["calibration_rows"]], block["calibration_length"])
        metrics = export_tensor_variant(name, variant, settings, model, tokenizer, calib, originals, block, run)
        metrics["parent_size_bytes"] = size_on_disk(location)
    quant_ppl = perplexity(model, held_out_ids)

    # --- report --------------------------------------------------------------------------------------------------
    metrics.update(perplexity={"parent": parent_ppl, "quantized": quant_ppl, "change": quant_ppl / parent_ppl - 1,
                               "held_out_rows": len(held_out_ids)},
                   format_errors=format_error_table(originals), format_errors_rows=error_table_rows(originals))
    log.info("quantize %s: %.2f MB (parent %.2f MB), %.3f bytes/param, held-out perplexity %.4f -> %.4f (%+.2f%%)",
             name, metrics["size_bytes"] / 2**20, metrics["parent_size_bytes"] / 2**20, metrics["bytes_per_param"],
             parent_ppl, quant_ppl, 100 * metrics["perplexity"]["change"])
    role = "source" if gguf else "calibration"
    training.write_artifact(run, stage="quantize", datasets=[dict(record, role=role), held_out_record(held_out)],
                            metrics=metrics, extra={"label": f"{read_parent_label(run.parent)}-{name}", "device": "cpu"})
    return metrics


def export_tensor_variant(name: str, variant, settings: tuple, model, tokenizer, calib, originals: dict, block,
                          run: StageRun) -> dict:
    """Round-to-nearest, GPTQ or AWQ on `model` in place (it then holds the dequantized weights), exported to
    model/ in the format's layout; the variant's metrics (sizes, bytes per parameter, layer errors)."""
    fmt, method, symmetric, group = settings
    log.info("quantize %s: %s %s%s on %d calibration sequences of %d tokens", name, method, fmt,
             f" g{group}" if group else "", calib.shape[0], calib.shape[1])
    module_formats = dict(variant.get("module_formats") or {})
    quantized = quantize_model(model, method, fmt, group, symmetric, None if method == "rtn" else calib,
                               damp=block["damp"], act_order=variant["act_order"], module_formats=module_formats)
    # from the in-memory model, which carries AWQ's folded scales in its norms
    with tempfile.TemporaryDirectory(dir=run.out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        export_quantized(tmp, quantized, run.model_dir, fmt, group_size=group, symmetric=symmetric, method=method)
    errors = layer_errors(originals, quantized) if method != "awq" else []
    n_quant = sum(q.shape[0] * q.shape[1] for q in quantized.values())
    return {
        "variant": name, "fmt": fmt, "method": method, "group_size": group, "symmetric": symmetric,
        "act_order": variant["act_order"], "damp": block["damp"], "module_formats": module_formats,
        "label": format_label(fmt, group, symmetric) + ("" if method == "rtn" else f" {method}")
        + "".join(f", {projection} {f}" for projection, f in sorted(module_formats.items())),
        "size_bytes": size_on_disk(run.model_dir),
        "bytes_per_param": sum(bytes_per_param(q, scale_bytes=4) * q.shape[0] * q.shape[1]
                               for q in quantized.values()) / n_quant,
        "quantized_params": n_quant,
        "layer_errors": errors,
        "mean_of_spread": sum(e["of_spread"] for e in errors) / len(errors) if errors else None,
        "calibration": {"sequences": int(calib.shape[0]), "length": int(calib.shape[1])} if method != "rtn" else None,
    }


def held_out_rows(data_cfg, n: int) -> list[dict]:
    """Up to n held-out rows: the tiny world's test split, or the rows a real dataset holds out (`data.held_out`),
    which neither SFT nor this stage's calibration saw."""
    rows, _ = load_rows(data_cfg, "held_out")
    return rows[:n]


def held_out_record(rows: list[dict]) -> dict:

    return {"id": "held-out", "role": "perplexity", "rows": len(rows),
            "content_sha256": sha256_json([r["messages"] for r in rows])}


def read_parent_label(parent: Path) -> str:

    manifest = read_manifest(parent) or {}
    return manifest.get("label") or checkpoint_label(manifest.get("stage", parent.name))


SIDE_FILES = ("config.json", "generation_config.json")


def write_model_dir(location: Path, tokenizer, out_dir: Path, gguf_type: str) -> list[dict]:
    """model.gguf plus the parent's config and tokenizer into a temporary sibling, renamed to `out_dir` when done."""
    from posttrain.quant.gguf_export import export_gguf  # the `gguf` extra

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        records = export_gguf(location, tmp / GGUF_NAME, gguf_type)
        for name in SIDE_FILES:
            if (Path(location) / name).exists():
                shutil.copy2(Path(location) / name, tmp / name)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return records


def gguf_settings(name: str, variant) -> str:
    """The llama.cpp block-type mix of a `fmt: gguf` variant, checked."""
    gguf_type = variant.get("gguf_type")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"quantize.variants.{name}.gguf_type={gguf_type!r}: expected one of {sorted(GGUF_TYPES)}")
    if variant.get("method", "rtn") != "rtn":
        raise ValueError(f"quantize.variants.{name}: GGUF block types are round-to-nearest here (method: rtn)")
    return gguf_type


def export_gguf_variant(name: str, gguf_type: str, location: Path, tokenizer, run: StageRun):
    """A `fmt: gguf` variant: the parent's float weights -> model/model.gguf for llama.cpp (`gguf_type` picks
    llama.cpp's mix of block types), beside the parent's config and tokenizer: our server renders prompts with
    them and serves the file's weights dequantized, `serve.backend=llamacpp` hands the file to llama.cpp's server.
    Returns the file read back through transformers' `gguf_file=` loader, and the variant's metrics."""
    import torch

    log.info("quantize %s: GGUF %s from %s", name, gguf_type, location)
    records = write_model_dir(location, tokenizer, run.model_dir, gguf_type)
    decoder = [r for r in records if r["name"].startswith("blk.") and "rel_error" in r]
    n_params = sum(r["params"] for r in decoder)
    block_types = dict(Counter(r["type"] for r in records if "rel_error" in r))
    log.info("quantize %s: block types %s", name, block_types)
    metrics = {
        "variant": name, "fmt": "gguf", "gguf_type": gguf_type, "method": "rtn", "group_size": None,
        "symmetric": None, "label": f"gguf {gguf_type}",
        "size_bytes": (run.model_dir / GGUF_NAME).stat().st_size,
        "parent_size_bytes": sum(p.stat().st_size for p in location.glob("*.safetensors")),
        "bytes_per_param": sum(r["bytes"] for r in decoder) / n_params,
        "quantized_params": n_params,
        "block_types": block_types,
        "layer_errors": [{k: r[k] for k in ("name", "type", "rel_error", "of_spread", "max_abs")} for r in decoder],
        "mean_of_spread": sum(r["of_spread"] * r["params"] for r in decoder) / n_params,
        "calibration": None,
    }
    return load_gguf_model(run.model_dir / GGUF_NAME, torch.float32).eval(), metrics
