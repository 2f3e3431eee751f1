"""GRPO's roll-outs on the project's engine: a `rollout_func` for TRL's GRPOTrainer.

Each generation batch the trainer hands over its prompts (already repeated `num_generations` times); the engine
renders them through the chat template exactly as TRL does, samples every completion in one KV-cached batch with the
trainer's sampling parameters, and returns the token ids and each token's log-probability under the logits divided
by the temperature (what TRL recomputes as the sampling log-probabilities).

The engine holds the trainer's own weights, not a copy through disk:
- full fine-tuning: the engine's modules hold the very tensors the optimizer updates in place, so every roll-out
  sees the current weights with nothing to sync;
- LoRA: each adapted linear gets one engine-owned weight, base + the adapters' delta (peft's `get_delta_weight`),
  rewritten in place after each optimizer step (`sync`); every other tensor is shared.

Why not TRL's `generate` path: transformers' generate runs far more Python per decoded token (cache objects, logits
processors, stopping criteria) than the engine's static-cache step, which on a 2-core CPU is a large share of a small
model's step (`scripts/bench_rollout.py` measures both on the same settings).
"""

from __future__ import annotations

import logging

import torch

from posttrain.serve.engine import Engine, SamplingParams, model_from_hf

log = logging.getLogger("posttrain")


def lora_layers(model) -> dict:
    """name (in the base model) -> peft LoRA layer, for every adapted module of `model` (empty without peft)."""
    if not hasattr(model, "get_base_model"):
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def merged_weight(layer) -> torch.Tensor:
    """A LoRA layer's effective weight: its base weight plus each active adapter's delta."""
    weight = layer.get_base_layer().weight.detach()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def engine_state(model) -> tuple[dict, list[tuple[torch.Tensor, object]]]:
    """The tensors an engine over `model` (a transformers causal LM, or a peft model around one) runs on, by
    checkpoint name, and the (engine-owned weight, LoRA layer) pairs that `sync` rewrites."""
    layers = lora_layers(model)
    base = model.get_base_model() if layers else model
    state = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        if ".modules_to_save." in key or ".original_module." in key:
            raise ValueError(f"rollout.backend=posttrain: peft modules_to_save ({key}) is not supported")
        state[key.replace(".base_layer.", ".")] = tensor.detach()
    merged = []
    for name, layer in layers.items():
        weight = merged_weight(layer).clone()
        state[f"{name}.weight"] = weight
        merged.append((weight, layer))
    return state, merged


class EngineRollout:
    """`rollout_func(prompts, trainer)` for GRPOTrainer, generating on the engine over the trainer's weights."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.engine: Engine | None = None  # built at the first call, over the trainer's (peft-wrapped) model
        self.merged: list = []
        self.synced_step: int | None = None
        self.max_position = 0

    def attach(self, model) -> None:
        """Build the engine over `model`'s tensors (the trainer's model, unwrapped)."""
        state, self.merged = engine_state(model)
        hf_model = model.get_base_model() if self.merged else model
        self.engine = Engine(model_from_hf(hf_model, state), self.tokenizer, max_batch=1)
        self.max_position = hf_model.config.max_position_embeddings
        log.info("rollout: the engine runs the trainer's weights (%s)",
                 f"{len(self.merged)} LoRA layers merged and synced after each step" if self.merged
                 else "shared tensors, updated in place by the optimizer")

    @torch.no_grad()
    def sync(self) -> None:
        """Write each LoRA layer's current effective weight into the engine (in place; no disk, no new tensor)."""
        for weight, layer in self.merged:
            weight.copy_(merged_weight(layer))

    def render(self, prompts: list, trainer) -> list[list[int]]:
        """Prompt token ids, rendered as GRPOTrainer renders them for its own generation."""
        if isinstance(prompts[0], list):  # conversational: lists of messages
            return self.tokenizer.apply_chat_template(
                conversation=prompts, chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True, tokenize=True, return_dict=True,
                **(getattr(trainer, "chat_template_kwargs", None) or {}))["input_ids"]
        return self.tokenizer(text=prompts)["input_ids"]

    def params(self, trainer, n: int) -> list[SamplingParams]:
        for name, neutral in (("min_p", None), ("repetition_penalty", 1.0)):
            if getattr(trainer, name, neutral) not in (neutral, 0.0):
                raise ValueError(f"rollout.backend=posttrain does not apply {name} "
                                 f"(={getattr(trainer, name)}); unset it or use rollout.backend=trl")
        # no per-row seeds: the rows are drawn together from torch's global generator, which the trainer seeds
        # (as transformers' generate does)
        return [SamplingParams(max_tokens=trainer.max_completion_length, temperature=trainer.temperature,
                               top_p=trainer.top_p if trainer.top_p is not None else 1.0,
                               top_k=trainer.top_k or 0, logprobs=True,
                               stop_token_ids=list(trainer.eos_token_ids)) for _ in range(n)]

    def __call__(self, prompts: list, trainer) -> dict:
        if self.engine is None:
            self.attach(trainer.accelerator.unwrap_model(trainer.model))
        step = trainer.state.global_step
        if step != self.synced_step:
            self.sync()
            self.synced_step = step
        prompt_ids = [list(p) for p in self.render(prompts, trainer)]
        params = self.params(trainer, len(prompt_ids))
        needed = max(map(len, prompt_ids)) + trainer.max_completion_length
        if needed > self.max_position:
            raise ValueError(f"a prompt of {needed - trainer.max_completion_length} tokens + max_completion_length "
                             f"{trainer.max_completion_length} exceed the model's {self.max_position} positions")
        # one batch for the whole generation batch; the cache grows in blocks and is kept between steps
        self.engine.max_batch = max(self.engine.max_batch, len(prompt_ids))
        outs = self.engine.generate(prompt_ids, params)
        completion_ids = [o.token_ids + ([o.stop_token_id] if o.stop_token_id is not None else []) for o in outs]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [o.logprobs for o in outs]}
