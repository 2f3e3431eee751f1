"""The tiny world's model and tokenizer, built by the project: a few-million-parameter Qwen3 and a byte-level BPE.

With `arch.num_experts > 0` the model is a Qwen3-MoE instead (`model=tiny-moe`): top-k routed SwiGLU experts in
every `decoder_sparse_step`-th layer, trained with the router's load-balancing loss (TRL adds it; see build_tiny_model).

The tokenizer carries Qwen3-style control tokens. `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` are special;
`<think>`, `</think>`, `<tool_call>`, ... are added tokens that are *not* special, as in real Qwen3 tokenizers:
TRL decodes completions with `skip_special_tokens=True` before rewards see them, and a special `</think>` would
vanish from the text a verifier splits on.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def tiny_chat_template() -> str:
    return resources.files("posttrain.chat").joinpath("templates/tiny.jinja").read_text()


@dataclass
class TinyArch:
    """Qwen3 config knobs for the tiny model (hidden 256 x 4 layers is about 3M parameters)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    # Mixture of experts (Qwen3-MoE). 0 experts = the dense Qwen3 above; the knobs below are then unused.
    num_experts: int = 0
    num_experts_per_tok: int = 2  # top-k experts each token is routed to
    moe_intermediate_size: int = 256  # one expert's SwiGLU width (intermediate_size stays for dense layers)
    router_aux_loss_coef: float = 0.01  # weight of the load-balancing loss TRL adds to every stage's loss
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0; the others keep a dense MLP


def build_tiny_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """Train a byte-level BPE on the tiny world's text and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from posttrain.data.tiny_world import tokenizer_corpus

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),  # the non-special added tokens take the last ids
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tok.add_tokens(ADDED_TOKENS, special_tokens=False)
    tok.chat_template = tiny_chat_template()
    tok.model_max_length = TinyArch.max_position_embeddings
    if len(tok) > vocab_size:
        raise ValueError(f"tiny tokenizer has {len(tok)} tokens, more than vocab_size={vocab_size}")
    return tok


def build_tiny_model(arch: TinyArch, tokenizer, seed: int = 0):
    """A randomly initialised Qwen3 causal LM sized by `arch` (Qwen3-MoE when `arch.num_experts > 0`), with ids
    matching `tokenizer`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch.num_experts > 0 and not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(f"model.arch.num_experts_per_tok={arch.num_experts_per_tok} must be in "
                         f"1..num_experts={arch.num_experts}")
    common = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    if arch.num_experts > 0:
        # The load-balancing loss is trained without output_router_logits=True in the config: TRL's SFT, GRPO and DPO
        # trainers see a config that has the flag and a non-zero router_aux_loss_coef, request the router logits on
        # every training forward and add coef x aux_loss to their loss (their `aux_loss_enabled`). Left on in the
        # saved config, the flag breaks `generate` with a KV cache (transformers computes the aux loss on every decode
        # step against the whole attention mask: transformers#30731), which GRPO's sampling uses.
        config = Qwen3MoeConfig(
            **common,
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            router_aux_loss_coef=arch.router_aux_loss_coef,
            norm_topk_prob=arch.norm_topk_prob,
            decoder_sparse_step=arch.decoder_sparse_step,
            output_router_logits=False,
        )
        model = Qwen3MoeForCausalLM(config)
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
