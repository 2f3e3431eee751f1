"""GGUF export: the K-quant encoders, llama-quantize's choice of block type per tensor, and files that transformers'
`gguf_file=` loader reads back (weights, architecture, tokenizer and chat template). llama.cpp itself reading them
is tests/integration/test_gguf_llamacpp.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from posttrain.config_schema import GGUF_TYPES
from posttrain.models.loading import load_gguf_model
from posttrain.quant import k_quants
from posttrain.quant.gguf_export import GGUF_FORMATS, export_gguf, llama_permute, tensor_type, use_more_bits

Q = gguf.GGMLQuantizationType


def rms_of_spread(x: np.ndarray, decoded: np.ndarray) -> float:
    return float(np.sqrt(np.mean((decoded.reshape(x.shape) - x) ** 2)) / x.std())


@pytest.fixture(scope="module")
def rows():
    return np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)


def test_k_quants_have_llamacpp_block_sizes_and_rank_by_bits(rows):
    q4k, q6k = k_quants.quantize_q4_k(rows), k_quants.quantize_q6_k(rows)
    assert q4k.shape == (64, 2 * 144) and q6k.shape == (64, 2 * 210)
    errors = {name: rms_of_spread(rows, gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype))
              for name, qtype in (("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q5_0", Q.Q5_0))}
    errors["q4_k"] = rms_of_spread(rows, gguf.quants.dequantize(q4k, Q.Q4_K))
    errors["q6_k"] = rms_of_spread(rows, gguf.quants.dequantize(q6k, Q.Q6_K))
    # Q4_K's searched scale and min beat both 4-bit block types of the same rows; Q6_K's two extra bits beat Q5_0.
    assert errors["q4_k"] < errors["q4_1"] < errors["q4_0"], errors
    assert errors["q6_k"] < errors["q5_0"] / 1.5, errors
    assert errors["q6_k"] < 0.025, errors


def test_k_quants_keep_zero_blocks_zero_and_reject_short_rows(rows):
    zeros = np.zeros((2, 256), np.float32)
    assert not gguf.quants.dequantize(k_quants.quantize_q4_k(zeros), Q.Q4_K).any()
    assert not k_quants.quantize_q6_k(zeros).any()
    constant = np.full((1, 256), 0.5, np.float32)  # one value: the min is 0, the scale carries it
    assert np.allclose(gguf.quants.dequantize(k_quants.quantize_q4_k(constant), Q.Q4_K), 0.5, atol=0.02)
    with pytest.raises(ValueError, match="multiple of 256"):
        k_quants.quantize_q4_k(rows[:, :96])


def test_recipe_check_knows_every_gguf_format():
    assert sorted(GGUF_TYPES) == sorted(GGUF_FORMATS)


def test_block_types_follow_llama_quantize_q4_k_m_rules():
    # 4 layers: n/8 = 0 and 7n/8 = 3, so layers 2 ((2 - 0) % 3 == 2) and 3 keep attn_v and ffn_down at Q6_K.
    assert [use_more_bits(i, 4) for i in range(4)] == [False, False, True, True]
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert tensor_type("blk.0.attn_v.weight", (128, 256), "q4_k_m", 4, True) == Q.Q4_K
    assert tensor_type("blk.2.attn_v.weight", (128, 256), "q4_k_m", 4, True) == Q.Q6_K
    assert tensor_type("blk.3.ffn_down.weight", (256, 768), "q4_k_m", 4, True) == Q.Q6_K
    assert tensor_type("blk.3.ffn_up.weight", (768, 256), "q4_k_m", 4, True) == Q.Q4_K
    assert tensor_type("token_embd.weight", (2048, 256), "q4_k_m", 4, True) == Q.Q6_K  # tied: the output's type
    assert tensor_type("token_embd.weight", (2048, 256), "q4_k_m", 4, False) == Q.Q4_K
    assert tensor_type("output.weight", (2048, 256), "q4_0", 4, False) == Q.Q6_K
    assert tensor_type("output.weight", (2048, 256), "q8_0", 4, False) == Q.Q8_0
    # SmolLM2's rows of 576 are no multiple of 256: Q4_K falls back to Q5_0, Q6_K to Q8_0.
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "q4_k_m", 30, True) == Q.Q5_0
    assert tensor_type("token_embd.weight", (49152, 576), "q4_k_m", 30, True) == Q.Q8_0
    assert tensor_type("blk.0.attn_norm.weight", (256,), "q4_k_m", 4, True) == Q.F32


def test_llama_permute_interleaves_each_heads_halves():
    weights = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)  # 2 heads of 4 rows: halves [0, 1] and [2, 3]
    permuted = llama_permute(weights, 2)
    assert permuted[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]


def save_tiny(path, tokenizer, family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                  tie_word_embeddings=True)
    model = (Qwen3ForCausalLM(Qwen3Config(**common)) if family == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**common))).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_f32_and_q8_0_files_load_in_transformers_with_the_same_logits(tmp_path, tiny_tokenizer, family):
    model = save_tiny(tmp_path / "src", tiny_tokenizer, family)
    ids = torch.tensor([tiny_tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 + 3 ?"}],
                                                           add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        reference = model(ids).logits
        for fmt, tolerance in (("f32", 1e-5), ("q8_0", 0.05)):
            records = export_gguf(tmp_path / "src", tmp_path / f"{fmt}.gguf", fmt)
            loaded = load_gguf_model(tmp_path / f"{fmt}.gguf", torch.float32).eval()
            difference = (loaded(ids).logits - reference).abs().max().item()
            assert difference < tolerance * reference.std().item() * 10, (fmt, difference)
    assert {r["type"] for r in records if r["name"].startswith("blk.") and "rel_error" in r} == {"Q8_0"}
    assert max(r["of_spread"] for r in records if "of_spread" in r) < 0.01  # Q8_0: ~0.4 % of the spread


def test_file_carries_the_tokenizer_and_chat_template(tmp_path, tiny_tokenizer):
    save_tiny(tmp_path / "src", tiny_tokenizer, "qwen3")
    export_gguf(tmp_path / "src", tmp_path / "m.gguf", "q4_k_m")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.chat_template"].contents() == tiny_tokenizer.chat_template
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == len(tiny_tokenizer)
    assert types[tokens.index("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tokens.index("<think>")] == gguf.TokenType.USER_DEFINED
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(fields["tokenizer.ggml.merges"].contents()) > 1000
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert fields["qwen3.attention.key_length"].contents() == 64


def test_bad_sources_raise_before_a_file_exists(tmp_path, tiny_tokenizer):
    save_tiny(tmp_path / "src", tiny_tokenizer, "qwen3")
    with pytest.raises(ValueError, match="unknown GGUF format"):
        export_gguf(tmp_path / "src", tmp_path / "a.gguf", "q3_k_s")
    (tmp_path / "b.gguf").write_text("")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        export_gguf(tmp_path / "src", tmp_path / "b.gguf", "q8_0")
    config = (tmp_path / "src" / "config.json")
    config.write_text(config.read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no GGUF export"):
        export_gguf(tmp_path / "src", tmp_path / "c.gguf", "q8_0")
    save_tiny(tmp_path / "plain", tiny_tokenizer, "qwen3")
    template = tmp_path / "plain" / "chat_template.jinja"
    template.unlink()  # a tokenizer without a chat template: the file would not know how to chat
    with pytest.raises(ValueError, match="no chat template"):
        export_gguf(tmp_path / "plain", tmp_path / "d.gguf", "q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.gguf", "plain", "src"]  # no partial file left
