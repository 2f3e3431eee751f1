"""Quantized artifacts through the engine: an export transformers loads gives the same logits in our engine,
whose quantized linears are fused dequant-matmul modules (the full weight never materialised)."""

from __future__ import annotations

import pytest
import torch

from posttrain.serve.engine import SamplingParams, load_engine
from tests.native import isolated
from tests.nf4_bf16 import bf16_kernel_bound, bf16_kernel_logits
from tests.unit.test_engine import tiny_hf


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tiny_tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("float")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def quantized_checkpoint(float_dir, out_dir, fmt, group, symmetric):
    """(float model now holding the dequantized weights, {name: QuantizedWeight}, export dir, our engine on it)."""
    from transformers import AutoModelForCausalLM

    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.export import export_quantized
    from posttrain.quant.linear import QuantLinear

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    quantized = quantize_model(model, "rtn", fmt, group, symmetric)  # model keeps the dequantized weights
    out = export_quantized(float_dir, quantized, out_dir, fmt, group_size=group, symmetric=symmetric)
    engine = load_engine(out, max_batch=2, max_len=64)
    swapped = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 14  # 2 layers x (q, k, v, o, gate, up, down); q/k/v and gate/up may share a module
    assert sum(m.out_features * m.in_features for m in swapped) == sum(q.shape[0] * q.shape[1]
                                                                       for q in quantized.values())
    engine.model.setup_cache(2, 64)
    return model, quantized, out, engine


def greedy_matches(engine, reference, ids: torch.Tensor) -> bool:
    greedy = engine.generate([ids[0, :8].tolist()], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        expect = reference.generate(ids[:1, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                    pad_token_id=0)[0, 8:].tolist()
    return greedy == expect


IDS = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("fmt,group,symmetric", [("int8", None, True), ("int4", 32, True), ("int4", 64, False),
                                                 ("fp8", None, True)])
def test_exported_checkpoint_gives_transformers_logits_in_our_engine(float_dir, tmp_path, fmt, group, symmetric):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, _, out, engine = quantized_checkpoint(float_dir, tmp_path / "q", fmt, group, symmetric)
    reference = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        ref = reference(IDS).logits
        ours = engine.model(IDS, torch.arange(24).expand(2, 24), slice(0, 2), 24)
        unquantized = model.__class__.from_pretrained(float_dir, dtype=torch.float32)(IDS).logits
    assert (ref - unquantized).abs().max() > 1e-3  # the quantization is visible in the logits...
    assert (ours - ref).abs().max().item() < 1e-4  # ...and our fused kernels reproduce transformers' result
    assert greedy_matches(engine, reference, IDS)


@pytest.mark.parametrize("fmt,group", [("fp8_e5m2", None), ("fp4", 32), ("mxfp4", None), ("nvfp4", None),
                                       ("fp16", None)])
def test_float_format_export_in_our_engine_matches_the_dequantized_float_model(float_dir, tmp_path, fmt, group):
    """No fused kernel: the quantized linears run the reference path ("chunked"); fp16 loads as a float model."""
    from transformers import AutoModelForCausalLM

    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.export import export_quantized
    from posttrain.quant.linear import QuantLinear

    dequantized = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    quantized = quantize_model(dequantized, "rtn", fmt, group)  # the model now holds the dequantized weights
    engine = load_engine(export_quantized(float_dir, quantized, tmp_path / "q", fmt, group_size=group), max_batch=2,
                         max_len=64)
    swapped = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 14 and len(swapped) == (0 if fmt == "fp16" else 14)  # chunked modules are not fused
    assert all(m.fmt == fmt and m.backend == "chunked" for m in swapped)
    engine.model.setup_cache(2, 64)
    with torch.no_grad():
        ref = dequantized(IDS).logits
        ours = engine.model(IDS, torch.arange(24).expand(2, 24), slice(0, 2), 24)
        unquantized = dequantized.__class__.from_pretrained(float_dir, dtype=torch.float32)(IDS).logits
    assert (ours - ref).abs().max().item() < 1e-5
    assert (unquantized - ref).abs().max().item() > (1e-5 if fmt == "fp16" else 1e-3)
    assert greedy_matches(engine, dequantized, IDS)


@isolated  # bitsandbytes' native CPU kernels: a crash fails this test only
def test_exported_nf4_checkpoint_in_our_engine_and_in_transformers(float_dir, tmp_path):
    """Ours and transformers' Linear4bit, each against the float model holding the same dequantized NF4 weights."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    dequantized, quantized, out, engine = quantized_checkpoint(float_dir, tmp_path / "q", "nf4", 64, True)
    transformers_nf4 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = dequantized(IDS).logits
        ours = engine.model(IDS, torch.arange(24).expand(2, 24), slice(0, 2), 24)
        theirs = transformers_nf4(IDS).logits
        unquantized = dequantized.__class__.from_pretrained(float_dir, dtype=torch.float32)(IDS).logits
    # Ours dequantizes the NF4 blocks to fp32 and multiplies in fp32, as the reference does: the fp32 bound of the
    # other formats. Transformers' Linear4bit computes in bf16 on AVX512-BF16 CPUs (fp32 elsewhere): its bound is
    # what bf16 rounding of its inputs, absmax, weights and outputs does to these logits, times 2, plus the fp32
    # floor (tests/nf4_bf16.py); about 1.4e-2 here, far below the NF4 rounding's own effect (checked below).
    assert (ours - ref).abs().max().item() < 1e-4
    bound = bf16_kernel_bound(ref, bf16_kernel_logits(dequantized, quantized, 64, IDS))
    assert (theirs - ref).abs().max().item() <= bound
    assert (unquantized - ref).abs().max().item() > 4 * bound
    assert greedy_matches(engine, dequantized, IDS)


def test_quantized_moe_engine_matches_dequantized_float_model():
    """Qwen3-MoE: experts quantized one by one (checkpoint-style names), our engine on the codes vs the float model
    holding the dequantized weights."""
    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.linear import swap_linears
    from posttrain.serve.engine import model_from_hf

    hf = tiny_hf("qwen3_moe")
    quantized = quantize_model(hf, "rtn", "int4", 32)  # hf now holds the dequantized weights
    assert any(".mlp.experts.3.down_proj" in name for name in quantized)
    ours = model_from_hf(hf)
    swap_linears(ours, quantized, torch.float32)
    ours.setup_cache(1, 32)
    ids = torch.randint(0, 160, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, torch.arange(20)[None], slice(0, 1), 20)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family,fmt,backend", [("qwen2", "int4", "own"), ("llama", "int4", "own_q8"),
                                                ("qwen3_moe", "int8", "own"), ("qwen3", "fp8", "own")])
def test_fused_projections_give_the_same_logits(family, fmt, backend):
    """q/k/v and gate/up merged into one own-kernel module each (biases included: Qwen2) compute exactly what the
    separate modules did, in prefill and in a decode step; a layout the kernels cannot merge stays as it was."""
    import copy

    from posttrain.quant import cpu_kernels
    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.linear import QuantLinear, swap_linears
    from posttrain.serve.engine import model_from_hf

    if not cpu_kernels.available():
        pytest.skip(f"own CPU kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    hf = tiny_hf(family)
    quantized = quantize_model(hf, "rtn", fmt, 32 if fmt == "int4" else None)
    separate = swap_linears(model_from_hf(hf), quantized, torch.float32, backend=backend)
    fused = copy.deepcopy(separate)
    experts = sum(1 for n in quantized if n.endswith("experts.0.gate_proj")) * 8
    assert fused.fuse_projections() == 2 * 2 - (1 if family == "qwen3_moe" else 0) + experts
    assert not hasattr(fused.model.layers[0].self_attn, "q_proj")
    assert sum(isinstance(m, QuantLinear) for m in fused.modules()) < len(quantized)
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(5))
    outs = []
    for model in (separate, fused):
        model.setup_cache(2, 16)
        with torch.no_grad():
            prefill = model(ids, torch.arange(12).expand(2, 12), slice(0, 2), 12)
            step = model(ids[:, :1], torch.full((2, 1), 12), slice(0, 2), 13, last=torch.zeros(2, dtype=torch.long))
        outs.append((prefill, step))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    aten = swap_linears(model_from_hf(tiny_hf("llama")), quantize_model(tiny_hf("llama"), "rtn", "int8", None),
                        torch.bfloat16, backend="aten")
    assert aten.fuse_projections() == 0 and hasattr(aten.model.layers[0].self_attn, "q_proj")
