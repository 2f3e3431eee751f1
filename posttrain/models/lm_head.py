"""The language-model head of SFT, GRPO and DPO on CPU: logits for the labelled positions only, in one product.

TRL's trainers compute their log-probabilities through a fused head (`trl.trainer.utils.add_fused_lm_head`) that
never builds the `[tokens, vocabulary]` logits. On a GPU it scores only the labelled positions, with Triton
kernels. Elsewhere it scores *every* position (prompt and padding included, so that tile shapes stay fixed for
XLA-style compilers), tile by tile in Python, and runs its backward GEMMs in float32 even under bf16 autocast. On
SmolLM2-135M (a 49,152-token vocabulary, 576 wide) on a 2-core CPU, that head was about 40% of an SFT step, where
fewer than half of the positions are labelled (the assistant's tokens; a GRPO batch labels its completions only).

`add_compact_lm_head` patches the model's forward once more, after TRL's: `fused_lm_head=True` then runs the
backbone, takes the hidden states of the labelled positions, and projects only those through the head under the
ambient autocast, returning TRL's own `FusedCausalLMOutput` (loss, per-token log-probabilities, entropy, top-1
hits, mean logit, log of the summed squared probabilities, label mask), so TRL's loss and metrics code runs
unchanged. The logits of a batch's labelled positions are built whole: for 8 rows of 512 tokens, about 800 MB in
float32 for SmolLM2. What it does not cover (MoE router losses, pre-shifted labels under sequence parallelism,
scaled or soft-capped logits, an LM head kept in float32) goes to TRL's head, untouched.

A recipe keeps TRL's head everywhere with `<stage>.lm_head: trl`; `auto` (the default) uses this one on CPU.
"""

from __future__ import annotations

import functools
import logging
import types

log = logging.getLogger("posttrain")


def add_compact_lm_head(model, temperature: float = 1.0, entropy_grad: bool = False) -> bool:
    """Patch `model` (the module TRL gave a fused head) so that `fused_lm_head=True` projects labelled positions
    only, the logits divided by `temperature`; the entropy carries a gradient only with `entropy_grad` (GRPO's
    entropy bonus). Returns False, patching nothing, for models whose logits are scaled, soft-capped or come with
    router losses: TRL's head keeps those."""
    import torch
    from trl.trainer.utils import FusedCausalLMOutput

    text_config = model.config.get_text_config()
    if (getattr(text_config, "final_logit_softcapping", None) is not None
            or any(getattr(text_config, name, None) not in (None, 1.0)
                   for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"))
            or getattr(text_config, "output_router_logits", False)):
        return False
    trl_forward = model.forward

    def spread(values, mask):  # [labelled] -> [batch, positions], zero where the label is -100
        return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)

    @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head or shift_labels is not None or kwargs.get("output_router_logits"):
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        labels = labels[:, 1:].to(hidden.device)
        mask = labels != -100
        targets = labels[mask]
        logits = self.get_output_embeddings()(hidden[mask]).float() / temperature  # [labelled, vocabulary]
        log_p = torch.log_softmax(logits, dim=-1)
        picked = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(log_p.exp() * log_p).sum(-1)
        with torch.no_grad():  # metrics and weights, as in TRL's head
            is_top1 = logits.argmax(-1) == targets
            mean_logits = logits.mean(-1)
            log_sum_sq = torch.logsumexp(2 * log_p, dim=-1)
        log_probs = spread(picked, mask)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=spread(entropy, mask),
                                   log_sum_sq_probs=spread(log_sum_sq, mask), mean_logits=spread(mean_logits, mask),
                                   is_top1=spread(is_top1, mask), label_mask=mask)

    model.forward = types.MethodType(forward, model)
    return True


def use_compact_lm_heads(trainer, stage: str, choice: str) -> bool:
    """Give a TRL trainer's policy (and its reference model, if it has one) the compact head, when `choice` is
    `auto` and the trainer runs on CPU; True when the policy got it. `choice: trl` keeps TRL's head, and so does a
    GRPO config that keeps the head in float32 (`cast_lm_head_to_fp32`). The temperature and the entropy bonus are
    read where GRPOTrainer keeps them for its own head (SFT and DPO have neither: 1.0, no bonus)."""
    from peft import PeftModel

    if (choice != "auto" or trainer.accelerator.device.type != "cpu"
            or getattr(trainer.args, "cast_lm_head_to_fp32", False)):
        return False
    temperature = getattr(trainer, "temperature", 1.0)
    entropy_grad = bool(getattr(trainer, "entropy_coef", 0.0)) or bool(getattr(trainer, "use_adaptive_entropy", False))
    policy = trainer.model.get_base_model() if isinstance(trainer.model, PeftModel) else trainer.model
    patched = add_compact_lm_head(policy, temperature, entropy_grad)
    if getattr(trainer, "ref_model", None) is not None:
        add_compact_lm_head(trainer.ref_model, temperature)
    if patched:
        log.info("%s: the loss projects the labelled tokens only through the LM head (CPU; %s.lm_head: trl keeps "
                 "TRL's head)", stage, stage)
    return patched
