"""A mixed int4 copy: `quantize_model(module_formats={"down_proj": "int8"})` keeps the named projections in int8
per output channel, the export writes them as a second compressed-tensors config group, and every reader
(our `load_quantized`, transformers, the engine) gets each module's own format back."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.quant.calibrate import check_module_formats, quantize_model
from posttrain.quant.export import export_quantized, scheme_targets
from posttrain.quant.export_read import load_quantized
from posttrain.stages.quantize import variant_settings
from tests.unit.test_quant_export import random_tokens, write_tiny_model

MIXED = {"down_proj": "int8"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("float")
    write_tiny_model(path, tied=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the engine needs one
    tokenizer.save_pretrained(path)
    return path


def float_model(src):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def calibration() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(5))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(random_tokens()).logits


@pytest.fixture(scope="module")
def mixed(src, tmp_path_factory):
    """(model holding the dequantized mixed weights, {name: QuantizedWeight}, export dir)."""
    model = float_model(src)
    quantized = quantize_model(model, "gptq", "int4", 32, False, calibration(), module_formats=MIXED)
    out = export_quantized(src, quantized, tmp_path_factory.mktemp("out") / "mixed", "int4", 32, False, "gptq")
    return model, quantized, out


def test_named_projections_are_int8_per_channel_the_rest_int4(mixed):
    _, quantized, _ = mixed
    assert len(quantized) == 14  # 2 layers x 7 projections
    for name, q in quantized.items():
        expected = ("int8", None, True) if name.endswith("down_proj") else ("int4", 32, False)
        assert (q.fmt, q.group_size, q.symmetric) == expected, name


def test_gptq_gives_each_module_the_codes_its_own_format_would(src, mixed):
    """Inside the first layer every Hessian comes from the float layer, so its down_proj codes are those of an
    all-int8 GPTQ run, and its other codes those of an all-int4 run."""
    _, quantized, _ = mixed
    all_int8 = quantize_model(float_model(src), "gptq", "int8", None, True, calibration())
    all_int4 = quantize_model(float_model(src), "gptq", "int4", 32, False, calibration())
    first = "model.layers.0."
    for name, q in quantized.items():
        if name.startswith(first):
            reference = all_int8[name] if name.endswith("down_proj") else all_int4[name]
            assert torch.equal(q.qweight, reference.qweight) and torch.equal(q.scale, reference.scale), name


def test_the_int8_projections_cut_the_logit_error(src, mixed):
    model, _, _ = mixed
    all_int4 = float_model(src)
    quantize_model(all_int4, "gptq", "int4", 32, False, calibration())
    reference = logits(float_model(src))
    assert (logits(model) - reference).abs().mean() < (logits(all_int4) - reference).abs().mean()


def test_export_writes_one_config_group_per_format(mixed):
    _, _, out = mixed
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {tuple(g["targets"]): (g["weights"]["num_bits"], g["weights"]["strategy"])
              for g in config["config_groups"].values()}
    assert groups == {(r"re:.*\.(down_proj)$",): (8, "channel"),
                      (r"re:.*\.(gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)$",): (4, "group")}
    assert json.loads((out / "quantize.json").read_text())["module_formats"] == MIXED


def test_load_quantized_returns_each_modules_format_and_codes(mixed):
    _, quantized, out = mixed
    _, loaded, _ = load_quantized(out)
    assert set(loaded) == set(quantized)
    for name, q in quantized.items():
        back = loaded[name]
        assert (back.fmt, back.group_size, back.symmetric) == (q.fmt, q.group_size, q.symmetric), name
        assert torch.equal(back.qweight, q.qweight) and torch.equal(back.scale, q.scale), name
        assert (q.zero is None) == (back.zero is None) and (q.zero is None or torch.equal(back.zero, q.zero))


def test_the_engine_computes_the_mixed_model(mixed):
    from posttrain.serve.engine import load_engine

    model, _, out = mixed
    engine = load_engine(out, max_batch=2, max_len=32)
    engine.model.setup_cache(2, 32)
    tokens = random_tokens()  # [2, 12]
    with torch.no_grad():
        ours = engine.model(tokens, torch.arange(12).expand(2, 12), slice(0, 2), 12)
    assert (ours.float() - logits(model)).abs().max() < 1e-4


@pytest.mark.xfail(strict=True, raises=(AssertionError, RuntimeError), reason=(
    "transformers 5.x dequantizes every dense layer of a compressed-tensors checkpoint with one config group "
    "(integrations.compressed_tensors.get_dense_scheme), so the int8 group's layers are read as int4; the "
    "default decompress-on-forward path has the asymmetric int4 zero-point bug (test_quant_export)"))
def test_transformers_cannot_load_the_mixed_export_yet(mixed):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, _, out = mixed
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    assert (logits(loaded) - logits(model)).abs().max() < 1e-4


def test_bad_module_formats_are_named():
    with pytest.raises(ValueError, match="module_formats key 'mlp' is not a quantized projection"):
        check_module_formats({"mlp": "int8"}, "gptq")
    with pytest.raises(ValueError, match=r"module_formats.down_proj='fp8': expected one of \('int8',\)"):
        check_module_formats({"down_proj": "fp8"}, "gptq")
    with pytest.raises(ValueError, match="gate_proj, up_proj read the same input and are fused by vLLM"):
        check_module_formats({"gate_proj": "int8"}, "rtn")
    with pytest.raises(ValueError, match="module_formats is an RTN / GPTQ option"):
        check_module_formats(MIXED, "awq")
    check_module_formats({"gate_proj": "int8", "up_proj": "int8", "down_proj": "int8"}, "gptq")
    variant = {"fmt": "int8", "method": "gptq", "symmetric": True, "group_size": None, "act_order": False,
               "module_formats": MIXED}
    with pytest.raises(ValueError, match="quantize.variants.v.module_formats: int8 projections mix with int4 only"):
        variant_settings("v", variant)
    with pytest.raises(ValueError, match="quantize.variants.v: module_formats key 'lm_head'"):
        variant_settings("v", dict(variant, fmt="int4", module_formats={"lm_head": "int8"}))
    with pytest.raises(ValueError, match="down_proj modules are quantized as both"):
        scheme_targets({"a.down_proj": ("int4", 32, True), "b.down_proj": ("int8", None, True)})
