"""GRPO roll-outs on the engine (`posttrain.serve.rollout`): the log-probabilities the engine reports for its own
samples equal the ones the trainer recomputes from its model (fp32, within 1e-4 per token), for full fine-tuning
and for LoRA, before and after an optimizer step; LoRA weights reach the engine in place, without a copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.serve.sampling import SamplingParams, sample_rows
from posttrain.serve.rollout import EngineRollout, engine_state
from tests.unit.test_engine import VOCAB, tiny_hf

EOS = 3
TEMPERATURE = 0.8


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # roll-outs draw from torch's global generator, as the trainer's own generation does


class IdTokenizer:
    """Text prompts are space-separated token ids; enough tokenizer for the engine and the roll-out."""

    eos_token_id = EOS

    def __call__(self, text):
        return {"input_ids": [[int(t) for t in s.split()] for s in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def fake_trainer(model, step: int = 0, **overrides):
    """The attributes of a GRPOTrainer that a rollout_func reads."""
    fields = dict(model=model, state=SimpleNamespace(global_step=step),
                  accelerator=SimpleNamespace(unwrap_model=lambda m: m), max_completion_length=12,
                  temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                  eos_token_ids=[EOS], chat_template=None, chat_template_kwargs={})
    return SimpleNamespace(**{**fields, **overrides})


def recomputed_logprobs(model, prompt_ids, completion_ids) -> list[list[float]]:
    """What TRL's GRPOTrainer computes: the model's logits over prompt + completion, divided by the temperature,
    log-softmaxed, read at each completion token."""
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids):
            logits = model(torch.tensor([prompt + completion]), use_cache=False).logits[0, len(prompt) - 1:-1]
            lp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
            out.append(lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist())
    return out


def prompts(n: int = 8, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(t) for t in torch.randint(4, VOCAB, (int(k),), generator=g).tolist())
            for k in torch.randint(2, 20, (n,), generator=g)]


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def lora_model(family: str):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_hf(family), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # peft starts B at zero (no change); give the adapters a real effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_logprobs_of_its_samples_equal_the_trainers_full_weights(family):
    model = tiny_hf(family)
    rollout = EngineRollout(IdTokenizer())
    out = rollout(prompts(), fake_trainer(model))
    assert len(out["completion_ids"]) == 8 and all(out["completion_ids"])
    assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert max_gap(out["logprobs"], recomputed_logprobs(model, out["prompt_ids"], out["completion_ids"])) < 1e-4

    # an optimizer step changes the shared tensors in place: the next roll-out samples from the new weights
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    out = rollout(prompts(seed=2), fake_trainer(model, step=1))
    assert max_gap(out["logprobs"], recomputed_logprobs(model, out["prompt_ids"], out["completion_ids"])) < 1e-4


def test_lora_weights_are_merged_into_the_engine_and_synced_after_each_step():
    model = lora_model("llama")
    rollout = EngineRollout(IdTokenizer())
    out = rollout(prompts(), fake_trainer(model))
    assert len(rollout.merged) == 2 * 2  # q_proj and v_proj of 2 layers
    assert max_gap(out["logprobs"], recomputed_logprobs(model, out["prompt_ids"], out["completion_ids"])) < 1e-4

    engine_weights = [w.data_ptr() for w, _ in rollout.merged]
    with torch.no_grad():  # an optimizer step on the adapters
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn_like(p))
    stale = rollout(prompts(seed=3), fake_trainer(model, step=0))  # same step: no sync, the old weights sample
    assert max_gap(stale["logprobs"], recomputed_logprobs(model, stale["prompt_ids"], stale["completion_ids"])) > 1e-3
    out = rollout(prompts(seed=3), fake_trainer(model, step=1))
    assert max_gap(out["logprobs"], recomputed_logprobs(model, out["prompt_ids"], out["completion_ids"])) < 1e-4
    assert [w.data_ptr() for w, _ in rollout.merged] == engine_weights  # rewritten in place


def test_engine_state_shares_every_tensor_but_the_adapted_ones():
    model = lora_model("qwen3")
    state, merged = engine_state(model)
    params = {p.data_ptr() for p in model.parameters()}
    adapted = {w.data_ptr() for w, _ in merged}
    assert not any(".lora_" in k or ".base_layer." in k for k in state)
    assert {k for k, v in state.items() if v.data_ptr() not in params} == {
        k for k, v in state.items() if v.data_ptr() in adapted}
    assert len(adapted) == 4


def test_stop_token_ends_a_completion_and_is_returned_with_its_logprob():
    model = tiny_hf("llama")
    with torch.no_grad():  # make the stop token likely, so some completions end on it
        model.lm_head.weight[EOS] += 3 * model.lm_head.weight.std()
        model.model.embed_tokens.weight[EOS] = model.lm_head.weight[EOS]
    out = EngineRollout(IdTokenizer())(prompts(16), fake_trainer(model, max_completion_length=24))
    stopped = [c for c in out["completion_ids"] if c[-1] == EOS]
    assert stopped and all(EOS not in c[:-1] for c in out["completion_ids"])
    assert all(len(c) == 24 for c in out["completion_ids"] if c[-1] != EOS)
    assert max_gap(out["logprobs"], recomputed_logprobs(model, out["prompt_ids"], out["completion_ids"])) < 1e-4


def test_sampling_options_the_engine_does_not_apply_are_refused():
    rollout = EngineRollout(IdTokenizer())
    with pytest.raises(ValueError, match="repetition_penalty"):
        rollout(prompts(2), fake_trainer(tiny_hf("llama"), repetition_penalty=1.2))


def test_rows_drawn_together_follow_each_rows_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, generator=g) * 2
    assert sample_rows(logits, SamplingParams(temperature=0.7, top_k=1)).tolist() == logits.argmax(-1).tolist()
    assert sample_rows(logits, SamplingParams(temperature=0.7, top_p=1e-6)).tolist() == logits.argmax(-1).tolist()
    draws = sample_rows(logits.repeat_interleave(20000, 0), SamplingParams(temperature=0.7)).view(4, 20000)
    freq = torch.stack([torch.bincount(row, minlength=6) for row in draws]).float() / 20000
    assert (freq - torch.softmax(logits / 0.7, -1)).abs().max() < 0.02
    top2 = sample_rows(logits.repeat_interleave(2000, 0), SamplingParams(temperature=1.0, top_k=2)).view(4, 2000)
    assert all(set(row.tolist()) <= set(logits[i].topk(2).indices.tolist()) for i, row in enumerate(top2))
