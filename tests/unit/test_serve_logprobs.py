"""The scheduler's log-probabilities (what the server returns for OpenAI's `logprobs`, `top_logprobs` and `echo`)
against transformers' forward pass on the same weights, float and quantized; and the logit processors
(`logit_bias`, frequency and presence penalties) changing what is sampled. Random models, nothing trained."""

from __future__ import annotations

import pytest
import torch

from posttrain.serve.engine import Engine, load_engine, model_from_hf
from posttrain.serve.sampling import SamplingParams, adjusted
from posttrain.serve.scheduler import Request, Scheduler
from tests.unit.test_engine import tiny_hf
from tests.unit.test_engine_quantized import quantized_checkpoint
from tests.unit.test_serve_parts import run

TOLERANCE = 1e-3  # nats per token, fp32


def reference(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """transformers' log-softmax over prompt + completion, [S, vocab]: row i scores token i + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def gap(request: Request, ref: torch.Tensor, k: int) -> float:
    """The largest difference between the request's reported log-probabilities (prompt and completion, chosen and
    top k) and the reference's; also checks that each top-k list is the reference's k most likely tokens."""
    ids = request.prompt + request.tokens
    entries = (request.prompt_logprobs or [None])[1:] + request.logprobs
    assert len(entries) == len(ids) - 1, "one entry per token after the first"
    worst = 0.0
    for i, (lp, top) in enumerate(entries):
        row = ref[i]
        worst = max(worst, abs(lp - float(row[ids[i + 1]])))
        assert len(top) == k
        expected = torch.topk(row, k).values.tolist()
        worst = max([worst] + [abs(v - e) for (_, v), e in zip(top, expected)])
        worst = max([worst] + [abs(v - float(row[t])) for t, v in top])
    return worst


@pytest.fixture(scope="module")
def hf():
    return tiny_hf("llama")  # SmolLM2's architecture


@pytest.fixture
def scheduler(hf):
    s = Scheduler(Engine(model_from_hf(hf), None, max_batch=4, max_len=96, stop_token_ids=[]))
    yield s
    s.close()


def test_echoed_prompt_and_generated_tokens_score_as_transformers_does(hf, scheduler):
    prompts = [[5, 9, 17, 33, 2, 8, 41], [7, 7, 1], [60, 3, 99, 12, 45, 6, 1, 88, 23, 4, 15]]
    greedy = [Request(p, SamplingParams(max_tokens=6, top_logprobs=3, prompt_logprobs=3)) for p in prompts]
    sampled = [Request(p, SamplingParams(max_tokens=6, temperature=0.9, seed=3, top_logprobs=2)) for p in prompts]
    plain = Request(prompts[0], SamplingParams(max_tokens=6))  # beside them in the batch, reports nothing
    run(scheduler, [*greedy, *sampled, plain])
    for r in greedy:
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(r.prompt)
        assert gap(r, reference(hf, r.prompt, r.tokens), 3) < TOLERANCE
        assert all(top[0][0] == t for (_, top), t in zip(r.logprobs, r.tokens))  # greedy: the chosen is the top
    for r in sampled:  # no echo: the completion's entries only, of the model's own distribution (temperature 1)
        assert r.prompt_logprobs is None and len(r.logprobs) == len(r.tokens)
        ref = reference(hf, r.prompt, r.tokens)[len(r.prompt) - 1:]
        assert max(abs(lp - float(ref[i, t])) for i, ((lp, _), t) in enumerate(zip(r.logprobs, r.tokens))) < TOLERANCE
    assert plain.logprobs == [] and plain.prompt_logprobs is None
    assert plain.tokens == greedy[0].tokens  # asking for log-probabilities does not change what is generated


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(hf, scheduler):
    prompt = [11, 22, 33, 44, 55]
    (r,) = run(scheduler, [Request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))])
    assert r.tokens == [] and r.finish_reason == "length"
    assert gap(r, reference(hf, prompt, []), 1) < TOLERANCE
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.submit(Request(prompt, SamplingParams(max_tokens=0)))  # without echo there is nothing to do


def test_quantized_checkpoint_scores_with_its_own_dequantized_weights(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tiny_tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "float")
    tiny_tokenizer.save_pretrained(tmp_path / "float")
    dequantized, _, out, _ = quantized_checkpoint(tmp_path / "float", tmp_path / "int4", "int4", 32, True)
    scheduler = Scheduler(load_engine(out, max_batch=2, max_len=64))
    float_model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    try:
        prompt = [5, 40, 77, 12, 90, 33, 8]
        (r,) = run(scheduler, [Request(prompt, SamplingParams(max_tokens=5, top_logprobs=2, prompt_logprobs=2,
                                                              ignore_eos=True))])
    finally:
        scheduler.close()
    assert gap(r, reference(dequantized, prompt, r.tokens), 2) < TOLERANCE
    assert gap(r, reference(float_model, prompt, r.tokens), 2) > TOLERANCE  # they are not the float model's


def test_logit_bias_and_penalties_change_what_is_chosen(scheduler):
    prompt = [5, 9, 17]
    (free,) = run(scheduler, [Request(prompt, SamplingParams(max_tokens=8))])
    banned = {t: -100.0 for t in free.tokens}
    forced = Request(prompt, SamplingParams(max_tokens=8, logit_bias={42: 100.0}, top_logprobs=0))
    avoided = Request(prompt, SamplingParams(max_tokens=8, logit_bias=banned))
    run(scheduler, [forced, avoided])
    assert forced.tokens == [42] * 8 and not set(avoided.tokens) & set(free.tokens)
    assert forced.logprobs[0][0] < -1  # the reported log-probability is the model's, before the bias
    repeated = Request(prompt, SamplingParams(max_tokens=8, logit_bias={42: 5.0}))
    penalised = Request(prompt, SamplingParams(max_tokens=8, logit_bias={42: 5.0}, presence_penalty=50.0))
    run(scheduler, [repeated, penalised])
    assert repeated.tokens.count(42) > 1 and penalised.tokens.count(42) <= 1


def test_penalties_follow_openais_definition():
    logits = torch.zeros(6)
    p = SamplingParams(logit_bias={1: 2.0}, frequency_penalty=0.5, presence_penalty=0.25)
    out = adjusted(logits, p, [3, 3, 3, 4])
    assert out.tolist() == [0.0, 2.0, 0.0, -1.75, -0.75, 0.0] and logits.tolist() == [0.0] * 6
    assert adjusted(logits, SamplingParams(), [3]) is logits  # nothing asked: the same tensor, no copy


def test_the_stop_token_that_ends_a_request_is_scored_after_its_tokens(hf, scheduler):
    prompt = [5, 9, 17, 33]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, top_logprobs=1)  # seeded: the same draws twice
    (free,) = run(scheduler, [Request(prompt, params)])
    end = next(i for i, t in enumerate(free.tokens) if i and t not in free.tokens[:i])
    stopping = Scheduler(Engine(model_from_hf(hf), None, max_batch=2, max_len=96, stop_token_ids=[free.tokens[end]]))
    try:
        (r,) = run(stopping, [Request(prompt, params)])
    finally:
        stopping.close()
    assert r.finish_reason == "stop" and r.tokens == free.tokens[:end] and r.stop_token == free.tokens[end]
    assert r.logprobs == free.logprobs[: end + 1]  # one entry per token, then the stop token's
