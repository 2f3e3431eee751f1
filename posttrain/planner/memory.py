"""Serving-side figures: weight memory per format, KV cache and linear-attention state, decode-speed ceilings.

Weight formats (bytes per weight of a quantized matrix; each row of a matrix [out, in] is cut into groups of
`group_size` consecutive input columns, each group with one scale; `group_size=0` means one scale per row):

    format   weight   scale per group   why that scale dtype
    fp32     4        -                 (everything fp32)
    bf16     2        -                 (everything bf16)
    fp8      1        fp32 (4)          as DeepSeek-V3's and compressed-tensors' FP8 checkpoints
    int8     1        bf16 (2)          as GPTQ/AWQ-style exports keep their scales in 16 bits
    int4     0.5      bf16 (2)          symmetric (no zero points); g128: 0.5 + 2/128 = 0.515625 B/weight
    nf4      0.5      fp32 (4)          bitsandbytes absmax, without double quantization (the project's QLoRA)

Only the decoder's linear weights are quantized; embeddings, the LM head, routers, norms, biases, convolution and
Gated DeltaNet state parameters stay in bf16 (norms and the other vectors are tiny and precision-sensitive; the
embedding and head are conventionally left unquantized by GPTQ/AWQ/bitsandbytes too). The vision tower, when the
model has one, is loaded in bf16 alongside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.planner.config import Arch
from posttrain.planner.params import Tensor

FORMATS = ("fp32", "bf16", "fp8", "int8", "int4", "nf4")
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "nf4": 0.5}
SCALE_BYTES = {"fp32": 0, "bf16": 0, "fp8": 4, "int8": 2, "int4": 2, "nf4": 4}
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}
# Default decode-ceiling bandwidths (GB/s): H100 SXM HBM3, A100 80GB SXM HBM2e, and a laptop / desktop CPU
# (dual-channel DDR5, or an entry Apple M-series chip, is about 100 GB/s).
DEFAULT_BANDWIDTHS = {"H100": 3350.0, "A100": 2039.0, "laptop/CPU": 100.0}
GB = 1e9  # every memory figure is in GB = 10^9 bytes, bandwidth in GB/s = 10^9 bytes/s


def dtype_bytes(name: str, what: str = "dtype") -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"{what} '{name}' is not one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def scale_groups(t: Tensor, group_size: int) -> int:
    """Scales one copy of a quantized matrix carries: rows x ceil(cols / group_size) (one per row at 0)."""
    return t.rows * (1 if group_size == 0 else math.ceil(t.cols / group_size))


def tensor_bytes(t: Tensor, fmt: str, group_size: int, active: bool = False) -> float:
    """Bytes of all copies (or of the copies one token reads) of `t` stored in format `fmt`."""
    copies = t.active if active else t.copies
    if fmt in ("fp32", "bf16"):
        return WEIGHT_BYTES[fmt] * t.rows * t.cols * copies
    if not t.matrix or t.section == "vision":
        return 2.0 * t.rows * t.cols * copies
    return (WEIGHT_BYTES[fmt] * t.rows * t.cols + SCALE_BYTES[fmt] * scale_groups(t, group_size)) * copies


@dataclass
class WeightRow:
    format: str
    bytes: float  # resident weights: the language model plus the vision tower, MTP layers not loaded
    bytes_per_param: float  # bytes / resident parameters
    quantized_params: int  # parameters stored in the format (the rest in bf16)
    scale_bytes: float
    decode_bytes_per_token: float  # weights one decode step reads (see decode_bytes)


def resident(tensors: list[Tensor]) -> list[Tensor]:
    """What a server loads: the main stack and the vision tower; MTP layers only with speculative decoding."""
    return [t for t in tensors if t.section in ("main", "vision")]


def decode_bytes(tensors: list[Tensor], fmt: str, group_size: int) -> float:
    """Weight bytes one single-stream decode step reads: every dense weight, the top-k routed experts of each MoE
    layer (the active copies), one row of the input embedding (a lookup, not a matmul; the LM head is read whole,
    and a tied head is the embedding matrix, so that one is read whole too). The vision tower is not run."""
    tied = not any(t.part == "lm_head" for t in tensors)
    total = 0.0
    for t in tensors:
        if t.section != "main":
            continue
        if t.part == "embedding" and not tied:
            total += t.cols * (4 if fmt == "fp32" else 2)  # one row of [vocab, hidden], kept in bf16 (fp32)
        else:
            total += tensor_bytes(t, fmt, group_size, active=True)
    return total


def weight_rows(tensors: list[Tensor], group_size: int) -> list[WeightRow]:
    loaded = resident(tensors)
    n = sum(t.numel for t in loaded)
    rows = []
    for fmt in FORMATS:
        size = sum(tensor_bytes(t, fmt, group_size) for t in loaded)
        quantized = [t for t in loaded if t.matrix and t.section != "vision"] if fmt not in ("fp32", "bf16") else []
        rows.append(WeightRow(
            format=fmt, bytes=size, bytes_per_param=size / n,
            quantized_params=sum(t.numel for t in quantized),
            scale_bytes=float(sum(SCALE_BYTES[fmt] * scale_groups(t, group_size) * t.copies for t in quantized)),
            decode_bytes_per_token=decode_bytes(tensors, fmt, group_size),
        ))
    return rows


# ---- KV cache and linear-attention state --------------------------------------------------------------------------
@dataclass
class KVReport:
    kv_dtype: str
    layers_with_kv: int  # full-attention (or MLA) layers; linear-attention layers keep no per-token cache
    bytes_per_token: int  # over all those layers, keys and values (MLA: the compressed latent)
    formula: str
    linear_layers: int
    conv_state_bytes: int  # per request, all linear-attention layers
    recurrent_state_bytes: int  # per request, all linear-attention layers
    state_formula: str
    table: list[dict]  # one row per (context, batch): kv_bytes, state_bytes, total_bytes

    @property
    def state_bytes_per_request(self) -> int:
        return self.conv_state_bytes + self.recurrent_state_bytes


def kv_report(arch: Arch, kv_dtype: str, contexts: list[int], batches: list[int]) -> KVReport:
    b = dtype_bytes(kv_dtype, "kv_dtype")
    if arch.mla is not None:
        # MLA caches the compressed latent (kv_lora_rank) and the shared rope key (qk_rope_head_dim) per layer, as
        # vLLM and SGLang do; transformers' eager cache stores the decompressed per-head keys and values instead
        # (heads x (qk_nope + qk_rope + v_head) per layer), far larger.
        m, layers = arch.mla, arch.count("mla")
        width = m.kv_lora_rank + m.qk_rope_head_dim
        per_token = layers * width * b
        formula = f"{layers} MLA layers x ({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} rope) x {b} B"
    else:
        a, layers = arch.attention, arch.count("attention")
        assert a is not None
        per_token = layers * 2 * a.kv_heads * a.head_dim * b
        formula = f"{layers} full-attention layers x 2 (k, v) x {a.kv_heads} kv heads x {a.head_dim} head_dim x {b} B"
    conv = recurrent = 0
    state_formula = "no linear-attention layers"
    linear_layers = arch.count("linear_attention")
    if arch.linear is not None and linear_layers:
        g = arch.linear
        sb = dtype_bytes(g.state_dtype, f"{arch.source}: mamba_ssm_dtype")
        # The causal conv needs the last kernel-1 inputs of q, k and v (transformers keeps `kernel` columns, one
        # more than needed); the delta-rule state is one [key_head_dim, value_head_dim] matrix per value head.
        conv = linear_layers * g.conv_dim * (g.conv_kernel - 1) * b
        recurrent = linear_layers * g.value_heads * g.key_head_dim * g.value_head_dim * sb
        state_formula = (f"{linear_layers} linear layers x [conv {g.conv_dim} x {g.conv_kernel - 1} x {b} B + "
                         f"recurrent {g.value_heads} x {g.key_head_dim} x {g.value_head_dim} x {sb} B "
                         f"({g.state_dtype})]")
    table = [{"context": c, "batch": n, "kv_bytes": per_token * c * n, "state_bytes": (conv + recurrent) * n,
              "total_bytes": per_token * c * n + (conv + recurrent) * n} for c in contexts for n in batches]
    return KVReport(kv_dtype, layers, per_token, formula, linear_layers, conv, recurrent, state_formula, table)


# ---- decode ceiling -------------------------------------------------------------------------------------------------
@dataclass
class DecodeRow:
    format: str
    bandwidth_gbs: float
    label: str
    bytes_per_token: float
    tokens_per_s: float


def decode_ceilings(weights: list[WeightRow], bandwidths: dict[str, float]) -> list[DecodeRow]:
    """Single-stream decode ceiling: bandwidth / weight bytes read per token. KV-cache reads (bytes_per_token x
    context per step) and compute are ignored, so real decoding is slower, more so at long context."""
    return [DecodeRow(w.format, bw, label, w.decode_bytes_per_token, bw * GB / w.decode_bytes_per_token)
            for w in weights for label, bw in bandwidths.items()]
