"""The tiny world's model, built by the project: a few-million-parameter Qwen3 (its byte-level BPE tokenizer is
trained on the tiny world's text in posttrain.data.tiny_world).

With `arch.num_experts > 0` the model is a Qwen3-MoE instead (`model=tiny-moe`): top-k routed SwiGLU experts in
every `decoder_sparse_step`-th layer, trained with the router's load-balancing loss (TRL adds it; see build_tiny_model).

The tokenizer carries Qwen3-style control tokens. `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` are special;
`<think>`, `</think>`, `<tool_call>`, ... are added tokens that are *not* special, as in real Qwen3 tokenizers:
TRL decodes completions with `skip_special_tokens=True` before rewards see them, and a special `</think>` would
vanish from the text a verifier splits on.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

from posttrain.config_schema import TinyArch  # noqa: F401 (the model's callers take it from here too)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef", "norm_topk_prob",
              "decoder_sparse_step")
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def tiny_chat_template() -> str:
    return resources.files("posttrain.chat").joinpath("templates/tiny.jinja").read_text()


def build_tiny_model(arch: TinyArch, tokenizer, seed: int = 0):
    """A randomly initialised Qwen3 causal LM sized by `arch` (Qwen3-MoE when `arch.num_experts > 0`), with ids
    matching `tokenizer`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch.num_experts > 0 and not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(f"model.arch.num_experts_per_tok={arch.num_experts_per_tok} must be in "
                         f"1..num_experts={arch.num_experts}")
    # TinyArch's fields are the config's own names: the dense ones for both, the expert ones for Qwen3-MoE only
    knobs = {f.name: getattr(arch, f.name) for f in dataclasses.fields(TinyArch)}  # a TinyArch or its recipe block
    experts = {name: knobs.pop(name) for name in MOE_FIELDS}
    common = dict(knobs, bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if arch.num_experts > 0:
        # The load-balancing loss is trained without output_router_logits=True in the config: TRL's SFT, GRPO and DPO
        # trainers see a config that has the flag and a non-zero router_aux_loss_coef, request the router logits on
        # every training forward and add coef x aux_loss to their loss (their `aux_loss_enabled`). Left on in the
        # saved config, the flag breaks `generate` with a KV cache (transformers computes the aux loss on every decode
        # step against the whole attention mask: transformers#30731), which GRPO's sampling uses.
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **experts, output_router_logits=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.generation_config.eos_token_id = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tokenizer(tokenizer, path: Path) -> None:
    tokenizer.save_pretrained(path)
