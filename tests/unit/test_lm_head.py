"""The compact LM head (SFT, GRPO and DPO on CPU) gives TRL's fused head's loss, per-token log-probabilities,
metrics and gradients, at any temperature, while projecting the labelled positions only."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.lm_head import add_compact_lm_head


def causal_lm(tied: bool = True, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                        tie_word_embeddings=tied, **config))


def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 9), generator=generator)
    attention = torch.ones_like(ids)
    attention[2, 6:] = 0  # a padded row
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    labels[2, 6:] = -100
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


OUTPUTS = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")  # every field DPO's metrics read


def fused_and_compact(temperature: float = 1.0, **config):
    from trl.trainer.utils import add_fused_lm_head

    fused, compact = causal_lm(**config), causal_lm(**config)
    compact.load_state_dict(fused.state_dict())
    for model in (fused, compact):
        add_fused_lm_head(model, temperature=temperature, outputs=OUTPUTS)
    return fused, compact


@pytest.mark.parametrize("tied, temperature", [(True, 1.0), (False, 1.0), (True, 0.7)])
def test_loss_log_probs_metrics_and_gradients_match_trls_fused_head(tied, temperature):
    fused, compact = fused_and_compact(temperature, tied=tied)
    assert add_compact_lm_head(compact, temperature)
    inputs = batch()
    projected = []
    compact.get_output_embeddings().register_forward_hook(lambda module, args, out: projected.append(args[0].shape))
    out_f = fused(**inputs, fused_lm_head=True)
    out_c = compact(**inputs, fused_lm_head=True)
    out_f.loss.backward()
    out_c.loss.backward()

    labelled = int((inputs["labels"][:, 1:] != -100).sum())
    assert projected == [torch.Size([labelled, 32])]  # labelled positions only: 3 x 8 shifted positions in all
    assert labelled < 3 * 8
    torch.testing.assert_close(out_c.loss, out_f.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_c.log_probs, out_f.log_probs, rtol=1e-5, atol=1e-5)
    for name in ("entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(out_c, name), getattr(out_f, name), rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(out_c.is_top1, out_f.is_top1) and torch.equal(out_c.label_mask, out_f.label_mask)
    grads_f = dict(fused.named_parameters())
    for name, p in compact.named_parameters():
        torch.testing.assert_close(p.grad, grads_f[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    # num_items_in_batch (gradient accumulation) divides the summed loss as in TRL's head
    n = fused(**inputs, fused_lm_head=True, num_items_in_batch=50).loss
    torch.testing.assert_close(compact(**inputs, fused_lm_head=True, num_items_in_batch=50).loss, n)


def test_the_entropy_carries_a_gradient_only_when_asked():
    """GRPO's entropy bonus differentiates the entropy; everywhere else it is a metric."""
    fused, compact = fused_and_compact()
    plain = causal_lm()
    add_compact_lm_head(compact, entropy_grad=True)
    out_f, out_c = fused(**batch(), fused_lm_head=True), compact(**batch(), fused_lm_head=True)
    out_f.entropy.sum().backward()
    out_c.entropy.sum().backward()
    grads_f = dict(fused.named_parameters())
    for name, p in compact.named_parameters():
        torch.testing.assert_close(p.grad, grads_f[name].grad, rtol=1e-3, atol=1e-6, msg=name)
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(plain)
    add_compact_lm_head(plain)
    assert not plain(**batch(), fused_lm_head=True).entropy.requires_grad


def test_the_plain_forward_and_generation_are_untouched():
    plain = causal_lm()
    fused, compact = fused_and_compact()
    add_compact_lm_head(compact)
    inputs = batch()
    torch.testing.assert_close(compact(**inputs).loss, plain(**inputs).loss)
    prompt = inputs["input_ids"][:1, :4]
    assert torch.equal(compact.generate(prompt, max_new_tokens=3, do_sample=False),
                       plain.generate(prompt, max_new_tokens=3, do_sample=False))


def test_soft_capped_logits_stay_with_trls_head():
    from trl.trainer.utils import add_fused_lm_head

    model = causal_lm()
    model.config.final_logit_softcapping = 30.0
    add_fused_lm_head(model)
    before = model.forward
    assert add_compact_lm_head(model) is False and model.forward is before


def test_a_trainer_on_cpu_gets_the_compact_head_for_its_policy_and_reference_unless_the_recipe_keeps_trls():
    from types import SimpleNamespace

    from posttrain.models.lm_head import use_compact_lm_heads

    def trainer():
        policy, reference = fused_and_compact()
        return SimpleNamespace(model=policy, ref_model=reference, args=SimpleNamespace(),
                               accelerator=SimpleNamespace(device=torch.device("cpu")))

    kept = trainer()
    forwards = (kept.model.forward, kept.ref_model.forward)
    assert use_compact_lm_heads(kept, "dpo", "trl") is False
    assert (kept.model.forward, kept.ref_model.forward) == forwards

    cpu = trainer()
    projected = []
    for model in (cpu.model, cpu.ref_model):
        model.get_output_embeddings().register_forward_hook(lambda m, args, out: projected.append(len(args[0])))
    assert use_compact_lm_heads(cpu, "dpo", "auto") is True
    cpu.model(**batch(), fused_lm_head=True)
    cpu.ref_model(**batch(), fused_lm_head=True)
    labelled = int((batch()["labels"][:, 1:] != -100).sum())
    assert projected == [labelled, labelled]  # TRL's head would project all 3 x 8 positions, in tiles
