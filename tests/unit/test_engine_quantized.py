"""Quantized artifacts through the engine: an export transformers loads gives the same logits in our engine,
whose quantized linears are fused dequant-matmul modules (the full weight never materialised)."""

from __future__ import annotations

import pytest
import torch

from posttrain.serve.engine import SamplingParams, load_engine
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


@pytest.mark.parametrize("fmt,group,symmetric", [("int8", None, True), ("int4", 32, True), ("int4", 64, False),
                                                 ("fp8", None, True), ("nf4", 64, True)])
def test_exported_checkpoint_gives_transformers_logits_in_our_engine(float_dir, tmp_path, fmt, group, symmetric):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.export import export_quantized
    from posttrain.quant.linear import QuantLinear

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    quantized = quantize_model(model, "rtn", fmt, group, symmetric)
    out = export_quantized(float_dir, quantized, tmp_path / "q", fmt, group_size=group, symmetric=symmetric)

    options = {} if fmt == "nf4" else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **options).eval()
    engine = load_engine(out, max_batch=2, max_len=64)
    swapped = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert len(swapped) == len(quantized) == 14  # 2 layers x (q, k, v, o, gate, up, down)

    ids = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(3))
    engine.model.setup_cache(2, 64)
    with torch.no_grad():
        ref = reference(ids).logits
        ours = engine.model(ids, torch.arange(24).expand(2, 24), slice(0, 2), 24)
        unquantized = model.__class__.from_pretrained(float_dir, dtype=torch.float32)(ids).logits
    assert (ref - unquantized).abs().max() > 1e-3  # the quantization is visible in the logits...
    tol = 2e-3 if fmt == "nf4" else 1e-4  # bitsandbytes' CPU path computes in its own order
    assert (ours - ref).abs().max().item() < tol  # ...and our fused kernels reproduce transformers' result

    greedy = engine.generate([ids[0, :8].tolist()], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        expect = reference.generate(ids[:1, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                    pad_token_id=0)[0, 8:].tolist()
    assert greedy == expect


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
