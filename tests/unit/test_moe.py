"""Mixture of experts: the tiny MoE model, the router callback's expert shares, and the load-balancing loss in what
TRL's SFT and DPO trainers optimise (GRPO's: tests/integration/test_tiny_moe.py, which sees `aux_loss` logged).

    .venv/bin/python -m pytest -q tests/unit/test_moe.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models.tiny import TinyArch, build_tiny_model
from posttrain.moe import (MoeRouterCallback, balance_loss, expert_shares, find_routers, min_share_ratio,
                           share_logs)

# a small MoE for speed: 2 layers of 4 experts, 2 per token
SMALL_MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.3)


@pytest.fixture(scope="module")
def moe_model(tiny_tokenizer):
    return build_tiny_model(TinyArch(**SMALL_MOE), tiny_tokenizer, seed=0)


def padded_batch(tokenizer, texts: list[str]) -> dict:
    return tokenizer(texts, padding=True, return_tensors="pt")


class FakeState:
    def __init__(self) -> None:
        self.log_history = [{"loss": 1.0, "step": 5}]


# --- pure arithmetic -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts, shares, ratio", [
    ({0: [1.0, 1.0, 1.0, 1.0]}, {0: [0.25, 0.25, 0.25, 0.25]}, 1.0),
    ({0: [6.0, 2.0], 1: [1.0, 3.0]}, {0: [0.75, 0.25], 1: [0.25, 0.75]}, 0.5),
    ({0: [4.0, 0.0, 4.0, 0.0]}, {0: [0.5, 0.0, 0.5, 0.0]}, 0.0),  # two dead experts
    ({0: [2.0, 2.0], 1: [0.0, 0.0]}, {0: [0.5, 0.5]}, 1.0),  # a layer that saw no token is left out
])
def test_expert_shares_and_min_share_ratio(counts, shares, ratio):
    assert expert_shares(counts) == shares
    assert min_share_ratio(shares) == pytest.approx(ratio)
    logs = share_logs(shares)
    assert logs["expert_share/min_ratio"] == pytest.approx(ratio)
    assert {k for k in logs if "/layer" in k} == {f"expert_share/layer{l}/expert{e}" for l, row in shares.items()
                                                  for e in range(len(row))}


def test_balance_loss_per_layer_sees_what_the_layer_average_hides():
    """Two layers, each sending every token to its own two experts with confident probabilities: transformers'
    loss (fractions and probabilities averaged over layers first) is at its balanced value, top_k = 2; per layer it
    is twice that."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    big = 8.0
    layer0 = torch.tensor([[big, big, 0.0, 0.0]]).repeat(6, 1)  # 6 tokens -> experts 0, 1
    layer1 = torch.tensor([[0.0, 0.0, big, big]]).repeat(6, 1)  # -> experts 2, 3
    averaged = load_balancing_loss_func((layer0, layer1), 4, 2)
    per_layer = balance_loss([layer0, layer1], 2)
    assert averaged == pytest.approx(2.0, abs=2e-3)
    assert per_layer == pytest.approx(4.0, abs=2e-3)


def test_balance_loss_matches_transformers_one_layer_at_a_time_and_one_sequence_at_a_time():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 5, 4, generator=g) for _ in range(3)]  # 3 layers, batch 2 x seq 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    by_layer = torch.stack([load_balancing_loss_func((x,), 4, 2, mask) for x in logits]).mean()
    assert balance_loss(logits, 2, mask) == pytest.approx(by_layer.item(), rel=1e-5)
    by_sequence = torch.stack([
        torch.stack([load_balancing_loss_func((x.reshape(2, 5, 4)[b],), 4, 2, mask[b:b + 1]) for b in range(2)]).mean()
        for x in logits]).mean()
    assert balance_loss(logits, 2, mask, per_sequence=True) == pytest.approx(by_sequence.item(), rel=1e-5)


# --- the model -----------------------------------------------------------------------------------------------------
def test_dense_default_is_the_tiny_qwen3_and_the_callback_does_nothing_on_it(tiny_tokenizer):
    from transformers import Qwen3ForCausalLM

    model = build_tiny_model(TinyArch(), tiny_tokenizer)
    assert type(model) is Qwen3ForCausalLM
    assert sum(p.numel() for p in model.parameters()) == 3_672_832  # unchanged by the MoE knobs
    callback = MoeRouterCallback()
    assert callback.attach(model) == 0 and not callback.handles
    logs, state = {"loss": 1.0}, FakeState()
    model(**padded_batch(tiny_tokenizer, ["plain text"]))
    callback.on_log(None, state, None, logs=logs)
    assert logs == {"loss": 1.0} and state.log_history == [{"loss": 1.0, "step": 5}] and callback.metrics() == {}


def test_moe_arch_builds_qwen3_moe_with_the_recipe_knobs(moe_model):
    from transformers import Qwen3MoeForCausalLM

    assert type(moe_model) is Qwen3MoeForCausalLM
    c = moe_model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
    assert c.router_aux_loss_coef == 0.3 and c.norm_topk_prob and not c.output_router_logits
    assert sorted(find_routers(moe_model)) == [0, 1]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        build_tiny_model(TinyArch(**{**SMALL_MOE, "num_experts_per_tok": 5}), None)


# --- the callback --------------------------------------------------------------------------------------------------
def test_callback_counts_each_tokens_top_k_experts_leaving_padding_out(moe_model, tiny_tokenizer):
    callback = MoeRouterCallback()
    assert callback.attach(moe_model) == 2
    batch = padded_batch(tiny_tokenizer, ["What is 17 times 24?", "Return the following message <start> hi <end>"])
    out = moe_model(**batch, output_router_logits=True)
    real = batch["attention_mask"].reshape(-1).bool()
    expected = {}
    for layer, logits in enumerate(out.router_logits):  # the counts are the top-2 of each real token
        expected[layer] = torch.bincount(logits[real].topk(2, dim=-1).indices.reshape(-1), minlength=4).double()
        assert torch.equal(callback.counts[layer], expected[layer])
    assert expected[0].sum() == 2 * real.sum()
    with torch.no_grad():  # sampling / reference passes are not counted
        moe_model(**batch)
    logs, state = {"loss": 1.0}, FakeState()
    callback.on_log(None, state, None, logs=logs)
    for layer in (0, 1):
        row = [logs[f"expert_share/layer{layer}/expert{e}"] for e in range(4)]
        assert sum(row) == pytest.approx(1.0)
        assert row == pytest.approx((expected[layer] / expected[layer].sum()).tolist())
    assert state.log_history[-1] == {"loss": 1.0, "step": 5, **{k: v for k, v in logs.items() if k != "loss"}}
    metrics = callback.metrics()
    assert metrics["min_expert_share_ratio"] == pytest.approx(logs["expert_share/min_ratio"])
    assert set(metrics["expert_share_last_window"]) == {"layer0", "layer1"} and metrics["expert_share_windows"] == 1
    assert all(c.sum() == 0 for c in callback.counts.values())  # a fresh window
    callback.on_log(None, state, None, logs={})  # nothing trained since: nothing logged, the last window kept
    assert callback.metrics() == metrics
    callback.detach()


def test_train_end_turns_router_logits_off_so_the_saved_model_generates(moe_model, tiny_tokenizer):
    model = copy.deepcopy(moe_model)
    model.config.output_router_logits = True  # what TRL's SFTTrainer leaves behind
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.padding_side = "left"
    batch = padded_batch(tokenizer, ["What is 2 times 3? And what is 4 times 5?", "Who is Ada?"])  # padded
    # transformers computes the aux loss on each decode step: [2 new tokens] against a [2 x length] mask
    with pytest.raises(RuntimeError, match="size of tensor"):
        model.generate(**batch, max_new_tokens=3, do_sample=False)
    callback = MoeRouterCallback()
    callback.on_train_begin(None, None, None, model=model)
    callback.on_train_end(None, None, None, model=model)
    assert not model.config.output_router_logits and not callback.handles
    assert model.generate(**batch, max_new_tokens=3, do_sample=False).shape[1] == batch["input_ids"].shape[1] + 3


# --- the load-balancing loss is in what the trainers optimise -------------------------------------------------------
def expected_aux(model, batch: dict) -> torch.Tensor:
    """The per-layer, per-sequence balance loss of the model on this batch, from its router logits."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    return balance_loss(list(out.router_logits), 2, batch["attention_mask"], per_sequence=True)


def router_grads(model, loss) -> list[torch.Tensor]:
    routers = list(find_routers(model).values())
    return torch.autograd.grad(loss, [r.weight for r in routers])


def test_sft_loss_includes_the_balance_loss_with_its_gradient(moe_model, tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = ["What is 17 times 24? 408", "Return the following message <start> hi there <end> hi there",
             "Who is Ada? A person.", "Repeat after me: fine."]
    enc = tiny_tokenizer(texts)
    dataset = Dataset.from_dict({"input_ids": enc["input_ids"]})

    def trainer_for(model, coef):
        args = SFTConfig(output_dir=str(tmp_path / str(coef)), per_device_train_batch_size=4, max_steps=1,
                         use_cpu=True, bf16=False, report_to=[], activation_checkpointing=False,
                         router_aux_loss_coef=coef, dataloader_num_workers=0)
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer)

    on_model, off_model = copy.deepcopy(moe_model), copy.deepcopy(moe_model)
    on, off = trainer_for(on_model, None), trainer_for(off_model, 0.0)  # None: the config's coefficient, 0.3
    assert on.aux_loss_enabled and on.router_aux_loss_coef == 0.3 and not off.aux_loss_enabled
    callback = MoeRouterCallback()
    callback.attach(on_model)
    batch = on._prepare_inputs(next(iter(on.get_train_dataloader())))
    loss_on = on.compute_loss(on_model, dict(batch))
    loss_off = off.compute_loss(off_model, dict(batch))
    aux = expected_aux(on_model, batch)
    assert aux > 2.0  # top_k is the balanced minimum
    assert (loss_on - loss_off).item() == pytest.approx(0.3 * aux.item(), rel=1e-4)
    grad_on, grad_off = router_grads(on_model, loss_on), router_grads(off_model, loss_off)
    assert all(g.abs().sum() > 0 for g in router_grads(on_model, expected_aux(on_model, batch)))
    assert not all(torch.allclose(a, b) for a, b in zip(grad_on, grad_off))
    callback.detach()


def test_dpo_loss_includes_the_balance_loss(moe_model, tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    pairs = [{"prompt": [{"role": "user", "content": f"Repeat after me: claim {i}"}],
              "chosen": [{"role": "assistant", "content": "I would rather not."}],
              "rejected": [{"role": "assistant", "content": f"claim {i}"}]} for i in range(4)]

    def trainer_for(model, coef):
        args = DPOConfig(output_dir=str(tmp_path / f"dpo{coef}"), per_device_train_batch_size=4, max_steps=1,
                         use_cpu=True, bf16=False, report_to=[], activation_checkpointing=False, max_length=64,
                         router_aux_loss_coef=coef, dataloader_num_workers=0)
        return DPOTrainer(model=model, ref_model=copy.deepcopy(moe_model), args=args,
                          train_dataset=Dataset.from_list(pairs), processing_class=tiny_tokenizer)

    on_model, off_model = copy.deepcopy(moe_model), copy.deepcopy(moe_model)
    on, off = trainer_for(on_model, None), trainer_for(off_model, 0.0)
    assert on.aux_loss_enabled and not off.aux_loss_enabled
    callback = MoeRouterCallback()
    callback.attach(on_model)
    batch = on._prepare_inputs(next(iter(on.get_train_dataloader())))
    loss_on = on.compute_loss(on_model, dict(batch))
    loss_off = off.compute_loss(off_model, dict(batch))
    assert on._metrics["train"]["aux_loss"] and not off._metrics["train"]["aux_loss"]
    logged_aux = on._metrics["train"]["aux_loss"][-1]  # TRL's record of the aux loss it added (the callback's)
    assert logged_aux > 2.0
    assert (loss_on - loss_off).item() == pytest.approx(0.3 * logged_aux, rel=1e-4)
    callback.detach()
