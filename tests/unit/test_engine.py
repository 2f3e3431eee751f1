"""The serving engine against transformers on tiny random configs of every family it runs.

Exactness: full-sequence logits equal transformers' forward (fp32, < 1e-4); greedy tokens with the KV cache equal
greedy tokens from recomputing the whole sequence with transformers at every step (20+ prompts per family); a
prompt gives the same tokens alone and inside a batch of mixed lengths. Then sampling, stops, limits, errors.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.serve.engine import Engine, SamplingParams, load_engine, model_from_hf
from posttrain.serve.sampling import sample

VOCAB = 160


def tiny_hf(family: str, seed: int = 0):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif family == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif family == "llama":  # SmolLM2's architecture (tied embeddings)
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    elif family == "qwen3_moe":  # 8 experts, 2 per token, layer 0 dense (mlp_only_layers)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, moe_intermediate_size=32, num_experts=8,
                                                   num_experts_per_tok=2, mlp_only_layers=[0], **common))
    else:
        raise ValueError(family)
    with torch.no_grad():  # random, non-trivial norms and biases, so a mistake in either shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


FAMILIES = ["qwen3", "qwen2", "llama", "qwen3_moe"]


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence at every step (no cache)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_forward(family):
    hf = tiny_hf(family)
    model = model_from_hf(hf)
    model.setup_cache(3, 64)
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids, torch.arange(40).expand(3, 40), slice(0, 3), 40)
    assert ref.abs().max() > 0.1  # a real signal, not zeros
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_equals_recompute_and_batch_equals_alone(family):
    hf = tiny_hf(family)
    engine = Engine(model_from_hf(hf), None, max_batch=8, max_len=64, stop_token_ids=[])
    prompts = random_prompts(20, seed=2)
    params = SamplingParams(max_tokens=10)
    batched = [c.token_ids for c in engine.generate(prompts, params)]  # batches of 8 mixed lengths
    for prompt, tokens in zip(prompts, batched):
        assert len(tokens) == 10
        assert tokens == hf_greedy(hf, prompt, 10)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts[:6]]
    assert alone == batched[:6]
    assert len({tuple(t) for t in batched}) > 5  # the prompts lead to different continuations


def test_decode_computes_only_the_new_token():
    """A decode step feeds one token per row through the projections: count the rows q_proj sees."""
    engine = Engine(model_from_hf(tiny_hf("qwen3")), None, max_batch=2, max_len=64, stop_token_ids=[])
    seen = []
    hook = engine.model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out: seen.append(tuple(inp[0].shape[:2])))
    engine.generate([[5, 6, 7, 8, 9], [1, 2]], SamplingParams(max_tokens=4))
    hook.remove()
    assert seen == [(2, 5), (2, 1), (2, 1), (2, 1)]  # prefill [B, longest prompt], then [B, 1] per step


def test_sampling_is_seeded_and_truncates():
    engine = Engine(model_from_hf(tiny_hf("qwen3")), None, max_batch=4, max_len=64, stop_token_ids=[])
    prompt = [[3, 1, 4, 1, 5]]
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=7)
    first, again = engine.generate(prompt, hot)[0].token_ids, engine.generate(prompt, hot)[0].token_ids
    other = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.5, seed=8))[0].token_ids
    greedy = engine.generate(prompt, SamplingParams(max_tokens=12))[0].token_ids
    assert first == again and first != other and first != greedy
    assert engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3))[0].token_ids == greedy
    assert engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3))[0].token_ids == greedy


def test_sample_keeps_only_top_k_and_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert draws == {0, 4}
    probs = torch.softmax(logits, 0)  # token 4: 0.61, token 0: 0.22 -> top_p 0.7 keeps exactly those two
    assert probs[4] < 0.7 < probs[4] + probs[0]
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), g) for _ in range(200)}
    assert draws == {0, 4}


def test_stop_token_and_limit(tiny_tokenizer):
    hf = tiny_hf("qwen3")
    engine = Engine(model_from_hf(hf), None, max_batch=2, max_len=64, stop_token_ids=[])
    free = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_at = free.token_ids[3]
    cut = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8, stop_token_ids=[stop_at]))[0]
    first = free.token_ids.index(stop_at)
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:first]
    assert cut.ttft_s > 0 and (free.tbt_s or 0) > 0


def test_stop_strings_cut_the_text(tmp_path, tiny_tokenizer):
    from posttrain.models.tiny import TinyArch, build_tiny_model

    hf = build_tiny_model(TinyArch(num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16),
                          tiny_tokenizer)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    engine = load_engine(tmp_path, max_batch=2, max_len=128)
    prompt = "Return the following message <start> hello world <end>"
    free = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert free.text and len(free.token_ids) == 20
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    cut = engine.generate([prompt], SamplingParams(max_tokens=20, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    # the directory's own tokenizer and weights: same greedy tokens as transformers' generate
    ids = tiny_tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert free.token_ids == ref.tolist()


def test_bad_requests_name_the_problem():
    engine = Engine(model_from_hf(tiny_hf("llama")), None, max_batch=2, max_len=32, stop_token_ids=[])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt 1: 30 prompt tokens"):
        engine.generate([[1], [2] * 30], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams())


def test_compiled_decode_step_gives_the_same_tokens():
    """torch.compile'd decode (attending over the whole cache, fixed shapes) decodes exactly like eager."""
    model = model_from_hf(tiny_hf("qwen3"))
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_tokens=8)
    eager = Engine(model, None, max_batch=3, max_len=48, stop_token_ids=[]).generate(prompts, params)
    compiled = Engine(model, None, max_batch=3, max_len=48, stop_token_ids=[], compile=True).generate(prompts, params)
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
