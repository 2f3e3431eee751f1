"""The quantize stage's parts for the floating-point formats: recipe variants, their settings, the labels, the
round-to-nearest error table of every compared format, and the scorecard and report that print it."""

from __future__ import annotations

import pytest
import torch

from posttrain import config as config_mod
from posttrain.config import RecipeError, compose
from posttrain.evaluation.report import quantization_plot
from posttrain.evaluation.scorecard import render_quantization
from posttrain.stages import quantize as stage
from posttrain.stages.quantize import COMPARED_FORMATS, format_error_table, format_label, variant_settings

NEW_LABELS = {"fp16", "fp8_e5m2", "fp4 g32", "mxfp4", "nvfp4"}
VARIANTS = {"fp16": ("fp16", None), "fp8-e5m2": ("fp8_e5m2", None), "fp4": ("fp4", 32), "mxfp4": ("mxfp4", None),
            "nvfp4": ("nvfp4", None)}


def weights(*shapes) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(*shape, generator=gen) * 0.02 for i, shape in enumerate(shapes)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_recipe_variants_compose_and_resolve(variant):
    cfg = compose(["pipeline=tiny"])
    view = config_mod.stage_view(cfg, f"quantize:{variant}")
    fmt, method, symmetric, group = variant_settings(variant, view["quantize"]["variants"][variant])
    assert (fmt, group) == VARIANTS[variant] and method == "rtn" and symmetric


def test_unknown_format_and_calibrated_float_format_are_refused_by_name():
    with pytest.raises(RecipeError, match="quantize.variants.int8.fmt.*fp5.*valid values: .*fp8_e5m2, fp4, mxfp4, "
                                          "nvfp4"):
        compose(["quantize.variants.int8.fmt=fp5"])
    variant = {"fmt": "fp4", "method": "gptq", "symmetric": True, "group_size": 32, "act_order": False}
    with pytest.raises(ValueError, match="quantize.variants.mine: method gptq calibrates int4 / int8 codes; fp4 is "
                                         "round-to-nearest only"):
        variant_settings("mine", variant)
    # mxfp4 / nvfp4 have fixed blocks: the schema's default group size of 128 is not passed on
    assert variant_settings("v", dict(variant, fmt="nvfp4", method="rtn", group_size=128))[3] is None
    # GPTQ's column order on a round-to-nearest or AWQ variant would be silently ignored
    for method in ("rtn", "awq"):
        with pytest.raises(ValueError, match=f"quantize.variants.v: act_order is a GPTQ option; method {method}"):
            variant_settings("v", dict(variant, fmt="int4", method=method, act_order=True))
    assert variant_settings("v", dict(variant, fmt="int4", act_order=True)) == ("int4", "gptq", True, 32)


def test_labels():
    assert [format_label(*entry) for entry in COMPARED_FORMATS] == [
        "int8", "int4 g32", "int4 g64", "int4 g128", "int4 g128 asym", "fp8", "nf4 g64", "fp16", "fp8_e5m2",
        "fp4 g32", "mxfp4", "nvfp4"]
    assert format_label("mxfp4", 32, True) == "mxfp4" and format_label("fp4", 16, True) == "fp4 g16"


def test_error_table_lists_every_format_with_its_error_and_size():
    table = format_error_table(weights((32, 128), (64, 256)))
    assert NEW_LABELS <= set(table) and len(table) == len(COMPARED_FORMATS)
    spread = {label: row["of_spread"] for label, row in table.items()}
    assert spread["fp16"] < spread["int8"] < spread["fp8"] < spread["fp8_e5m2"] < spread["nvfp4"] < spread["mxfp4"]
    assert spread["fp4 g32"] < spread["mxfp4"]  # the same blocks with an exact scale
    size = {label: row["bytes_per_param"] for label, row in table.items()}  # scales counted at 4 bytes
    assert size["fp16"] == 2.0 and size["fp4 g32"] == pytest.approx(0.625) and size["mxfp4"] == pytest.approx(0.53125)
    assert size["nvfp4"] == pytest.approx(0.5625 + 4 * 2 / (32 * 128 + 64 * 256))  # one tensor scale per weight


def test_error_table_leaves_out_formats_whose_blocks_do_not_fit():
    table = format_error_table(weights((16, 48), (16, 64)))  # 48: a multiple of 16, not of 32
    assert set(table) == {"int8", "fp8", "fp16", "fp8_e5m2", "nvfp4"}


def test_scorecard_and_report_print_the_new_labels():
    table = format_error_table(weights((32, 128)))
    summary = {"label": "nvfp4", "parent": "dpo", "size_mb": 3.7, "parent_size_mb": 14.0, "bytes_per_param": 0.5625,
               "mean_of_spread": 0.095, "perplexity": {"change": 0.01}, "format_errors": table}
    card = {"rows": [], "suites": [], "quantization": {"dpo-nvfp4": summary}}
    lines = render_quantization(card)
    assert "| dpo-nvfp4 | nvfp4 | 3.70 (14.00) | 0.562 | 0.095 | +1.00% |" in lines
    errors_line = lines[-1]
    for label in NEW_LABELS:
        assert f"{label}: {table[label]['of_spread']:.3f}" in errors_line
    assert quantization_plot(card)  # the bar chart takes the labels as they are
    assert "on dpo's weights, as a fraction" in errors_line
    summary["format_errors_rows"] = 128  # a large model's table, from sampled rows: the line says so
    assert "on dpo's weights (128 evenly spaced rows of each), as a fraction" in render_quantization(card)[-1]


def test_a_large_models_format_error_table_is_measured_on_sampled_rows(monkeypatch):
    """Past ERROR_TABLE_FULL_PARAMS each weight's table entry comes from ERROR_TABLE_ROWS evenly spaced rows: the
    figures stay within a few percent of the full table's, and the stage records how many rows it used."""
    torch.manual_seed(0)
    originals = {f"layer{i}": torch.randn(1024, 256) * (1 + i) for i in range(3)}
    full = stage.format_error_table(originals)
    assert stage.error_table_rows(originals) is None
    monkeypatch.setattr(stage, "ERROR_TABLE_FULL_PARAMS", 100_000)
    monkeypatch.setattr(stage, "ERROR_TABLE_ROWS", 128)
    assert stage.error_table_rows(originals) == 128
    sampled = stage.format_error_table(originals)
    assert sampled.keys() == full.keys() and len(full) >= 10
    for label, entry in full.items():
        assert sampled[label]["of_spread"] == pytest.approx(entry["of_spread"], rel=0.05), label
        assert sampled[label]["bytes_per_param"] == pytest.approx(entry["bytes_per_param"], rel=0.02), label
