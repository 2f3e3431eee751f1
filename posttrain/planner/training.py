"""Training memory per GPU: full fine-tuning, LoRA and QLoRA under DDP and ZeRO-1/2/3, with a verdict per row.

Bytes per trained parameter, bf16 mixed precision with AdamW (the ZeRO paper's accounting): bf16 weights 2,
bf16 gradients 2, and the optimizer's fp32 master weights 4 + first moment 4 + second moment 4 = 12; 16 in all.
ZeRO-1 shards the optimizer states over the N data-parallel GPUs, ZeRO-2 also the gradients, ZeRO-3 also the
weights; DDP replicates everything.

LoRA freezes the base (bf16, 2 B/param, no gradients or optimizer states; only ZeRO-3 shards it) and trains
adapters A [r, in] and B [out, r] on every decoder linear weight (attention and linear-attention projections,
the dense MLP, the shared expert, and each routed expert's own adapters): r x (in + out) parameters per matrix,
16 B each as above. QLoRA is the same with the base in NF4 (the planner's nf4 weight bytes, group-size scales
included, embeddings / LM head / norms in bf16).

Activations per GPU (bf16, micro-batch b, sequence s, hidden h, vocab V), the tensors autograd keeps:
    one layer's working set  W = 2·s·b·(4h + mixer width + MLP width)
        4h: the two norms' inputs and outputs; attention: q (with its gate) + k + v + attention output;
        MLA: q_a + q + kv_a + kv_b output + attention output; Gated DeltaNet: qkv + z + b + a projections, the conv
        output and the core output; MLP: gate, up and activation outputs (3·I; MoE: 3·(top_k·I_expert +
        I_shared) + router logits)
    gradient checkpointing (default): L·2·s·b·h (each layer's saved input) + max W (one layer recomputed at a time)
    without it: the sum of W over layers
    plus the logits: s·b·V·6 (bf16 logits and their fp32 copy in the loss)
FlashAttention-style kernels are assumed (no s² attention matrix). A row fits when its total is at most
`usable_fraction` (default 0.9) of the GPU memory: the rest goes to the CUDA context, NCCL buffers and allocator
fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.planner.config import Arch, Layer
from posttrain.planner.memory import GB, tensor_bytes
from posttrain.planner.params import LINEAR_PARTS, Tensor

METHODS = ("full", "lora", "qlora")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STRATEGY_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
METHOD_NAMES = {"full": "full FT", "lora": "LoRA", "qlora": "QLoRA"}
WEIGHT_B, GRAD_B, OPTIM_B = 2, 2, 12  # per trained parameter: bf16 weight, bf16 gradient, fp32 master + m + v


@dataclass
class TrainRow:
    method: str
    strategy: str
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    activations: float
    total: float
    fits: bool
    advice: str = ""


@dataclass
class TrainingReport:
    gpus: int
    gpu_mem_gb: float
    usable_fraction: float
    seq_len: int
    micro_batch: int
    gradient_checkpointing: bool
    lora_rank: int
    trainable_params: int  # full fine-tuning: every resident parameter
    lora_params: int
    base_bytes_bf16: float
    base_bytes_nf4: float
    activation_bytes: float
    activation_formula: str
    rows: list[TrainRow]

    def row(self, method: str, strategy: str) -> TrainRow:
        return next(r for r in self.rows if (r.method, r.strategy) == (method, strategy))


def lora_params(tensors: list[Tensor], rank: int) -> int:
    return sum(rank * (t.rows + t.cols) * t.copies for t in tensors
               if t.section == "main" and t.matrix and t.part in LINEAR_PARTS)


# ---- activations ----------------------------------------------------------------------------------------------------
def _mixer_width(arch: Arch, layer: Layer) -> int:
    if layer.mixer == "mla":
        m = arch.mla
        assert m is not None
        return ((m.q_lora_rank or 0) + m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
                + m.kv_lora_rank + m.qk_rope_head_dim + m.heads * (m.qk_nope_head_dim + m.v_head_dim)
                + m.heads * m.v_head_dim)
    if layer.mixer == "linear_attention":
        g = arch.linear
        assert g is not None
        return g.conv_dim + g.value_dim + 2 * g.value_heads + g.conv_dim + g.value_dim
    a = arch.attention
    assert a is not None
    return a.heads * a.head_dim * (3 if a.output_gate else 2) + 2 * a.kv_heads * a.head_dim


def _mlp_width(arch: Arch, layer: Layer) -> int:
    if layer.mlp == "moe":
        moe = arch.moe
        assert moe is not None
        return 3 * (moe.top_k * moe.expert_intermediate + moe.shared_intermediate) + moe.experts
    return 3 * arch.intermediate_size


def activation_bytes(arch: Arch, seq_len: int, micro_batch: int, checkpointing: bool) -> tuple[float, str]:
    sb, h = seq_len * micro_batch, arch.hidden_size
    working = [2 * sb * (4 * h + _mixer_width(arch, layer) + _mlp_width(arch, layer)) for layer in arch.layers]
    logits = 6 * sb * arch.vocab_size
    n = len(arch.layers)
    if checkpointing:
        total = n * 2 * sb * h + max(working) + logits
        formula = (f"checkpointed: {n} layers x 2·s·b·h + max layer working set {max(working) / GB:.2f} GB + "
                   f"logits 6·s·b·V {logits / GB:.2f} GB (s={seq_len}, b={micro_batch})")
    else:
        total = sum(working) + logits
        formula = (f"no checkpointing: sum of {n} layer working sets {sum(working) / GB:.2f} GB + logits 6·s·b·V "
                   f"{logits / GB:.2f} GB (s={seq_len}, b={micro_batch})")
    return float(total), formula


# ---- rows ------------------------------------------------------------------------------------------------------------
def _row(method: str, strategy: str, base: float, trained: int, acts: float, gpus: int) -> TrainRow:
    """`base`: bytes of frozen weights (0 for full FT, whose weights are the trained ones)."""
    stage = STRATEGIES.index(strategy)  # 0 ddp .. 3 zero3

    def shard(x: float, from_stage: int) -> float:
        return x / gpus if stage >= from_stage else x

    weights = shard(base, 3) + shard(WEIGHT_B * trained, 3)
    grads = shard(GRAD_B * trained, 2)
    optim = shard(OPTIM_B * trained, 1)
    total = weights + grads + optim + acts
    return TrainRow(method, strategy, weights, grads, optim, acts, total, fits=False)


def _min_gpus(zero3: TrainRow, usable: float, gpus: int) -> int:
    """Fewest GPUs on which a ZeRO-3 row fits: everything but the activations shards over the GPUs."""
    sharded = (zero3.weights + zero3.gradients + zero3.optimizer) * gpus
    return max(1, math.ceil(sharded / (usable - zero3.activations)))


def training_report(arch: Arch, tensors: list[Tensor], gpus: int, gpu_mem_gb: float, seq_len: int,
                    micro_batch: int, lora_rank: int, group_size: int, checkpointing: bool = True,
                    usable_fraction: float = 0.9) -> TrainingReport:
    if gpus < 1 or gpu_mem_gb <= 0 or seq_len < 1 or micro_batch < 1 or lora_rank < 1:
        raise ValueError("gpus, gpu_mem, seq_len, micro_batch and lora_rank must be positive")
    loaded = [t for t in tensors if t.section in ("main", "vision")]
    trainable = sum(t.numel for t in loaded)
    adapters = lora_params(tensors, lora_rank)
    bf16 = sum(tensor_bytes(t, "bf16", group_size) for t in loaded)
    nf4 = sum(tensor_bytes(t, "nf4", group_size) for t in loaded)
    acts, formula = activation_bytes(arch, seq_len, micro_batch, checkpointing)
    usable = gpu_mem_gb * GB * usable_fraction
    rows = []
    for method, base, trained in (("full", 0.0, trainable), ("lora", bf16, adapters), ("qlora", nf4, adapters)):
        for strategy in STRATEGIES:
            row = _row(method, strategy, base, trained, acts, gpus)
            row.fits = row.total <= usable
            rows.append(row)
    report = TrainingReport(gpus, gpu_mem_gb, usable_fraction, seq_len, micro_batch, checkpointing, lora_rank,
                            trainable, adapters, bf16, nf4, acts, formula, rows)
    for row in rows:
        row.advice = _advice(report, row, usable)
    return report


def _advice(report: TrainingReport, row: TrainRow, usable: float) -> str:
    """What would make a row fit: a higher ZeRO stage, else a lighter method, and more GPUs for this method."""
    if row.fits:
        return f"{(usable - row.total) / GB:.1f} GB to spare of {usable / GB:.1f} usable"
    options = []
    stages = STRATEGIES[STRATEGIES.index(row.strategy) + 1:]
    better = next((s for s in stages if report.row(row.method, s).fits), None)
    if better:
        options.append(f"{STRATEGY_NAMES[better]} fits")
    else:
        for method in METHODS[METHODS.index(row.method) + 1:]:
            fitting = next((s for s in STRATEGIES if report.row(method, s).fits), None)
            if fitting:
                options.append(f"{METHOD_NAMES[method]} with {STRATEGY_NAMES[fitting]} fits")
                break
        zero3 = report.row(row.method, "zero3")
        if zero3.activations >= usable:
            options.append("activations alone exceed a GPU: lower --micro-batch or --seq-len")
        else:
            n = _min_gpus(zero3, usable, report.gpus)
            options.append(f"{METHOD_NAMES[row.method]} with ZeRO-3 fits on {n} GPUs of {report.gpu_mem_gb:g} GB")
    return f"needs {row.total / GB:.1f} GB of {usable / GB:.1f} usable; " + "; or ".join(options)
