"""The tiny world's model and tokenizer, built by the project: a few-million-parameter Qwen3 and a byte-level BPE.

The tokenizer carries Qwen3-style control tokens. `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` are special;
`<think>`, `</think>`, `<tool_call>`, ... are added tokens that are *not* special, as in real Qwen3 tokenizers:
TRL decodes completions with `skip_special_tokens=True` before rewards see them, and a special `</think>` would
vanish from the text a verifier splits on (MACHINE_NOTES.md, tiny-world trials).
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
    """A randomly initialised Qwen3 causal LM sized by `arch`, with ids matching `tokenizer`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
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
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tokenizer(tokenizer, path: Path) -> None:
    tokenizer.save_pretrained(path)
