"""A float Hugging Face checkpoint -> one `.gguf` file that llama.cpp and transformers' `gguf_file=` loader read.

`export_gguf(src_dir, out_path, fmt)` writes, with the `gguf` package's writer:

- the architecture's hyper-parameters, for the two families the pipeline produces: Qwen3 (the tiny world) and
  Llama (SmolLM2). Llama's q and k rows are permuted to llama.cpp's interleaved rotary layout, as its own
  converter does; Qwen3 uses the half-split layout transformers uses, so its rows are written as they are;
- the tokenizer: the byte-level BPE vocabulary with each token's type (control for special added tokens,
  user-defined for the other added tokens, unused for padding ids up to the config's vocab_size), the merges,
  the bos/eos/pad ids, llama.cpp's name for the pre-tokenizer, and the model's own chat template;
- the weights in the format's mix of block types, chosen tensor by tensor as llama.cpp's `llama-quantize` chooses
  them from a float file (GGUF_FORMATS below), so that a file written here and one made by `llama-quantize` from
  our f32 export hold the same types. Q8_0, Q4_0, Q4_1 and Q5_0 blocks come from the `gguf` package's encoders,
  Q4_K and Q6_K from `posttrain.quant.k_quants` (the package has no K-quant encoder).

The file is written beside its target under a hidden temporary name and renamed once complete, so `out_path`
either does not exist or is a finished file.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from posttrain.quant import k_quants
from posttrain.quant.export import source_shards

log = logging.getLogger("posttrain")
Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class GgufFormat:
    base: Q  # the type of most 2-D weights
    file_type: gguf.LlamaFileType
    k_mix: bool = False  # Q4_K_M: Q6_K for output, half the attn_v and ffn_down


GGUF_FORMATS = {
    "f32": GgufFormat(Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": GgufFormat(Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": GgufFormat(Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": GgufFormat(Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": GgufFormat(Q.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q4_k_m": GgufFormat(Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M, k_mix=True),
}
ARCHITECTURES = {"Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA}
# When a row length is not a multiple of a block type's block, llama-quantize falls back to this type.
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}
OWN_ENCODERS = {Q.Q4_K: k_quants.quantize_q4_k, Q.Q6_K: k_quants.quantize_q6_k}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """The layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K: the first and last eighth, and every third."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], fmt: str, n_layers: int, tied: bool) -> Q:
    """The block type llama-quantize gives tensor `name` (GGUF name, numpy shape [rows, cols]) in format `fmt`."""
    spec = GGUF_FORMATS[fmt]
    if len(shape) < 2:
        return Q.F32  # norms and biases stay in float32
    if spec.base in (Q.F32, Q.F16):
        return spec.base
    base, cols = spec.base, shape[-1]
    role = name.split(".")[-2]
    if role == "output" or (tied and role == "token_embd"):
        # The output projection (or the embedding it shares) keeps more bits: Q6_K unless Q8_0 was asked for.
        chosen = Q.Q8_0 if base == Q.Q8_0 or cols % gguf.GGML_QUANT_SIZES[base][0] else Q.Q6_K
    elif spec.k_mix and role in ("attn_v", "ffn_down") and use_more_bits(int(name.split(".")[1]), n_layers):
        chosen = Q.Q6_K
    else:
        chosen = base
    if cols % gguf.GGML_QUANT_SIZES[chosen][0]:
        chosen = FALLBACK.get(chosen, chosen)
        if cols % gguf.GGML_QUANT_SIZES[chosen][0]:
            chosen = Q.F16  # no block type fits a row this long
    return chosen


def encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    """Float32 rows -> the bytes (or float array) GGUFWriter stores for block type `qtype`."""
    if qtype in OWN_ENCODERS:
        return OWN_ENCODERS[qtype](data)
    return gguf.quants.quantize(data.astype(np.float32), qtype)


def llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """q or k rows from transformers' half-split rotary layout to llama.cpp's interleaved pairs, per head."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def pre_tokenizer_name(tokenizer_json: Path) -> str:
    """llama.cpp's name for the pre-tokenizer in `tokenizer_json`: its regex split must be the same as ours."""
    pre = json.loads(tokenizer_json.read_text()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # the GPT-2 split, what the tiny world's tokenizer uses
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # each digit alone, then the GPT-2 split (SmolLM and SmolLM2)
    if kinds == ["Split", "ByteLevel"] and "\\p{N}" in json.dumps(steps[0].get("pattern")):
        return "qwen2"  # Qwen2/2.5/3's own split
    raise ValueError(f"{tokenizer_json}: pre-tokenizer {kinds} has no llama.cpp equivalent this exporter knows "
                     "(gpt-2, smollm, qwen2); llama.cpp would split text differently from transformers")


def add_tokenizer(writer: gguf.GGUFWriter, src_dir: Path, vocab_size: int) -> None:
    """Vocabulary, token types, merges, special ids and the chat template of the tokenizer in `src_dir`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"{src_dir}: tokenizer ids reach {max(vocab.values())}, beyond the config's vocab_size "
                         f"{vocab_size}")
    by_id = {i: token for token, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(pre_tokenizer_name(src_dir / "tokenizer.json"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(src_dir, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise ValueError(f"{src_dir}: the tokenizer has no BPE merges; llama.cpp cannot tokenize without them")
    special.chat_template = tokenizer.chat_template
    if not special.chat_template:
        raise ValueError(f"{src_dir}: the tokenizer has no chat template; the GGUF would not know how to chat")
    special.add_special_token.setdefault("bos", tokenizer.bos_token is not None and
                                         bool(getattr(tokenizer, "add_bos_token", False)))
    special.add_to_gguf(writer, quiet=True)


def add_hparams(writer: gguf.GGUFWriter, config: dict, arch: gguf.MODEL_ARCH, fmt: str) -> None:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError(f"rope scaling {rope or config.get('rope_scaling')} is not exported to GGUF here")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(config.get("_name_or_path") or arch.name.lower())
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(GGUF_FORMATS[fmt].file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gguf_tensors(src_dir: Path, config: dict, arch: gguf.MODEL_ARCH):
    """(GGUF name, float32 array) for each checkpoint tensor, Llama's q/k permuted; lm_head dropped when tied."""
    n_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layers)
    tied = bool(config.get("tie_word_embeddings"))
    for shard in source_shards(src_dir):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                if tied and key == "lm_head.weight":
                    continue
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise KeyError(f"{shard}: tensor {key!r} has no GGUF name for architecture {arch.name}")
                data = f.get_tensor(key).float().numpy()  # bf16 and fp16 checkpoints too
                if arch == gguf.MODEL_ARCH.LLAMA and key.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = config["num_attention_heads"] if "q_proj" in key else config["num_key_value_heads"]
                    data = llama_permute(data, heads)
                yield name, data


def tensor_record(name: str, data: np.ndarray, qtype: Q, encoded: np.ndarray) -> dict:
    """What one tensor costs in the file: its block type, bytes, and for 2-D weights the error of its decoding."""
    record = {"name": name, "type": qtype.name, "params": int(data.size), "bytes": int(encoded.nbytes)}
    if data.ndim == 2:
        decoded = gguf.quants.dequantize(encoded, qtype).astype(np.float64).reshape(data.shape)
        diff = data.astype(np.float64) - decoded
        record.update(rel_error=float(np.linalg.norm(diff) / max(np.linalg.norm(data), 1e-30)),
                      of_spread=float(np.sqrt(np.mean(diff ** 2)) / max(float(data.std()), 1e-30)),
                      max_abs=float(np.abs(diff).max()))
    return record


def export_gguf(src_dir: str | Path, out_path: str | Path, fmt: str) -> list[dict]:
    """Write the float checkpoint in `src_dir` as a GGUF file `out_path` -> a `tensor_record` per tensor."""
    src_dir, out_path = Path(src_dir), Path(out_path)
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; expected one of {sorted(GGUF_FORMATS)}")
    if out_path.exists():
        raise FileExistsError(f"GGUF target {out_path} already exists; refusing to overwrite it")
    config = json.loads((src_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src_dir} is already quantized; export GGUF from its float parent")
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{src_dir}: architecture {architecture} has no GGUF export here; supported: "
                         f"{sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[architecture]
    writer_path = out_path.parent / f".{out_path.name}.partial-{uuid.uuid4().hex[:8]}"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(writer_path, gguf.MODEL_ARCH_NAMES[arch])
    records = []
    try:
        add_hparams(writer, config, arch, fmt)
        add_tokenizer(writer, src_dir, config["vocab_size"])
        tied = bool(config.get("tie_word_embeddings"))
        for name, data in gguf_tensors(src_dir, config, arch):
            qtype = tensor_type(name, data.shape, fmt, config["num_hidden_layers"], tied)
            encoded = encode(data, qtype)
            writer.add_tensor(name, encoded, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
            records.append(tensor_record(name, data, qtype, encoded))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.rename(writer_path, out_path)  # the commit point
    except BaseException:
        writer.close()
        writer_path.unlink(missing_ok=True)
        raise
    return records
