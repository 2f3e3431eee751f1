"""Every weight tensor of a model, from its normalised `Arch`: the inventory the other figures are sums over.

A `Tensor` is one kind of weight with its shape [rows, cols] (cols = 1 for a vector), how many copies the model
holds (layers x experts) and how many of those copies one token reads (`active`: top-k routed experts per MoE
layer, every copy otherwise). Counting parameters, bytes per weight format, decode bytes per token and LoRA adapter
sizes are then all one-line sums.

Sections: "main" is the language model whose size publishers state; "mtp" are the multi-token-prediction layers
(shown apart; DeepSeek states 671B without them); "vision" is a multimodal wrapper's vision tower.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

from posttrain.planner.config import Arch, Layer

# Parts a weight-only quantizer converts (decoder linear weights) and that LoRA adapts; routers, gates, norms,
# convs, embeddings and the LM head are not in these parts.
LINEAR_PARTS = ("attention", "linear_attention", "mlp", "experts", "shared_expert")


@dataclass(frozen=True)
class Tensor:
    section: str  # "main" | "mtp" | "vision"
    part: str  # embedding, lm_head, attention, linear_attention, mlp, experts, shared_expert, router, norm, ...
    name: str
    rows: int
    cols: int = 1
    copies: int = 1
    active: int = 1
    matrix: bool = False  # a linear weight [out, in] that weight-only quantization converts

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.copies

    @property
    def active_numel(self) -> int:
        return self.rows * self.cols * self.active


class Inventory:
    """Collects tensors, merging identical entries (same section/part/name/shape/matrix) by adding copies."""

    def __init__(self) -> None:
        self._items: OrderedDict[tuple, list[int]] = OrderedDict()

    def add(self, section: str, part: str, name: str, rows: int, cols: int = 1, copies: int = 1,
            active: int | None = None, matrix: bool = False) -> None:
        if rows * cols * copies == 0:
            return
        key = (section, part, name, rows, cols, matrix)
        entry = self._items.setdefault(key, [0, 0])
        entry[0] += copies
        entry[1] += copies if active is None else active

    def linear(self, section: str, part: str, name: str, out_f: int, in_f: int, bias: bool = False,
               copies: int = 1, active: int | None = None) -> None:
        self.add(section, part, name, out_f, in_f, copies, active, matrix=True)
        if bias:
            self.add(section, part, name + ".bias", out_f, 1, copies, active)

    def tensors(self) -> list[Tensor]:
        return [Tensor(s, p, n, r, c, copies, active, m)
                for (s, p, n, r, c, m), (copies, active) in self._items.items()]


# ---- the decoder --------------------------------------------------------------------------------------------------
def _attention(inv: Inventory, arch: Arch, section: str) -> None:
    a, h = arch.attention, arch.hidden_size
    assert a is not None
    q_out = a.heads * a.head_dim * (2 if a.output_gate else 1)  # gated attention: q and its gate in one proj
    inv.linear(section, "attention", "q_proj", q_out, h, a.qkv_bias)
    inv.linear(section, "attention", "k_proj", a.kv_heads * a.head_dim, h, a.qkv_bias)
    inv.linear(section, "attention", "v_proj", a.kv_heads * a.head_dim, h, a.qkv_bias)
    inv.linear(section, "attention", "o_proj", h, a.heads * a.head_dim, a.o_bias)
    if a.qk_norm:
        inv.add(section, "norm", "q_norm", a.head_dim)
        inv.add(section, "norm", "k_norm", a.head_dim)


def _latent_attention(inv: Inventory, arch: Arch, section: str) -> None:
    m, h = arch.mla, arch.hidden_size
    assert m is not None
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        inv.linear(section, "attention", "q_proj", m.heads * qk_head, h)
    else:
        inv.linear(section, "attention", "q_a_proj", m.q_lora_rank, h, m.bias)
        inv.add(section, "norm", "q_a_layernorm", m.q_lora_rank)
        inv.linear(section, "attention", "q_b_proj", m.heads * qk_head, m.q_lora_rank)
    # the compressed latent (kv_lora_rank) and the shared rope key (qk_rope_head_dim) in one projection
    inv.linear(section, "attention", "kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h, m.bias)
    inv.add(section, "norm", "kv_a_layernorm", m.kv_lora_rank)
    inv.linear(section, "attention", "kv_b_proj", m.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    inv.linear(section, "attention", "o_proj", h, m.heads * m.v_head_dim, m.bias)


def _linear_attention(inv: Inventory, arch: Arch, section: str) -> None:
    g, h = arch.linear, arch.hidden_size
    assert g is not None
    # Qwen3-Next fuses these as in_proj_qkvz [2K + 2V, h] and in_proj_ba [2 nv, h]; Qwen3.5 splits them into
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a. Same parameters either way.
    inv.linear(section, "linear_attention", "in_proj_qkv", g.conv_dim, h)
    inv.linear(section, "linear_attention", "in_proj_z", g.value_dim, h)  # the output gate
    inv.linear(section, "linear_attention", "in_proj_b", g.value_heads, h)  # beta (write strength) per head
    inv.linear(section, "linear_attention", "in_proj_a", g.value_heads, h)  # decay input per head
    inv.add(section, "conv", "conv1d", g.conv_dim, g.conv_kernel)  # depthwise: [conv_dim, 1, kernel], no bias
    inv.add(section, "linear_state", "dt_bias", g.value_heads)
    inv.add(section, "linear_state", "A_log", g.value_heads)
    inv.add(section, "norm", "gated_norm", g.value_head_dim)  # RMSNormGated over each value head
    inv.linear(section, "linear_attention", "out_proj", h, g.value_dim)


def _mlp(inv: Inventory, arch: Arch, section: str, part: str, inter: int, bias: bool = False,
         copies: int = 1, active: int | None = None) -> None:
    h = arch.hidden_size
    inv.linear(section, part, "gate_proj", inter, h, bias, copies, active)
    inv.linear(section, part, "up_proj", inter, h, bias, copies, active)
    inv.linear(section, part, "down_proj", h, inter, bias, copies, active)


def _moe(inv: Inventory, arch: Arch, section: str) -> None:
    moe, h = arch.moe, arch.hidden_size
    assert moe is not None
    inv.add(section, "router", "router", moe.experts, h)
    _mlp(inv, arch, section, "experts", moe.expert_intermediate, copies=moe.experts, active=moe.top_k)
    if moe.shared_intermediate:
        _mlp(inv, arch, section, "shared_expert", moe.shared_intermediate)
    if moe.shared_gate:
        inv.add(section, "router", "shared_expert_gate", 1, h)


def _layer(inv: Inventory, arch: Arch, layer: Layer, section: str) -> None:
    {"attention": _attention, "mla": _latent_attention, "linear_attention": _linear_attention}[layer.mixer](
        inv, arch, section)
    if layer.mlp == "moe":
        _moe(inv, arch, section)
    else:
        _mlp(inv, arch, section, "mlp", arch.intermediate_size, arch.mlp_bias)
    inv.add(section, "norm", "input_layernorm", arch.hidden_size)
    inv.add(section, "norm", "post_attention_layernorm", arch.hidden_size)


def _mtp(inv: Inventory, arch: Arch) -> None:
    """MTP layers reuse the main embedding and LM head (DeepSeek's checkpoint stores copies of both in its MTP
    layer; they are the same weights and are not counted again). Each adds a projection of [embedding; hidden]
    (2h -> h), its norms, and one decoder layer with full attention and the MoE (or dense) MLP."""
    h = arch.hidden_size
    last = arch.layers[-1]
    mtp_layer = Layer("mla" if arch.mla else "attention", last.mlp)
    for _ in range(arch.mtp_layers):
        if arch.mtp_style == "deepseek":
            inv.linear("mtp", "mtp", "eh_proj", h, 2 * h)
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                inv.add("mtp", "norm", norm, h)
        else:
            inv.linear("mtp", "mtp", "fc", h, 2 * h)
            for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                inv.add("mtp", "norm", norm, h)
        _layer(inv, arch, mtp_layer, "mtp")


def _vision(inv: Inventory, arch: Arch) -> None:
    v = arch.vision
    assert v is not None
    s, d = "vision", v.hidden
    inv.linear(s, "patch_embed", "conv3d", d, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, bias=True)
    inv.add(s, "embedding", "pos_embed", v.num_position_embeddings, d)
    for name in ("norm1", "norm2"):  # LayerNorm: weight and bias
        inv.add(s, "norm", name, d, 2, copies=v.depth)
    inv.linear(s, "vit", "qkv", 3 * d, d, bias=True, copies=v.depth)
    inv.linear(s, "vit", "proj", d, d, bias=True, copies=v.depth)
    inv.linear(s, "vit", "fc1", v.intermediate, d, bias=True, copies=v.depth)
    inv.linear(s, "vit", "fc2", d, v.intermediate, bias=True, copies=v.depth)
    merged = d * v.spatial_merge_size ** 2  # the merger concatenates merge x merge neighbouring patches
    inv.add(s, "norm", "merger.norm", d, 2)
    inv.linear(s, "merger", "linear_fc1", merged, merged, bias=True)
    inv.linear(s, "merger", "linear_fc2", v.out_hidden, merged, bias=True)


def inventory(arch: Arch) -> list[Tensor]:
    inv = Inventory()
    inv.add("main", "embedding", "embed_tokens", arch.vocab_size, arch.hidden_size)
    if not arch.tie_word_embeddings:
        inv.add("main", "lm_head", "lm_head", arch.vocab_size, arch.hidden_size)
    for layer in arch.layers:
        _layer(inv, arch, layer, "main")
    inv.add("main", "norm", "norm", arch.hidden_size)
    if arch.mtp_layers:
        _mtp(inv, arch)
    if arch.vision:
        _vision(inv, arch)
    return inv.tensors()


# ---- counts ---------------------------------------------------------------------------------------------------------
@dataclass
class ParamCounts:
    """Parameter counts. `total`/`active` are the headline figures (the language model; the vision tower too
    when `vision_in_total`); embeddings and the LM head are shown apart (tied: one matrix, counted once, under
    `embedding`). `active` counts every non-expert weight plus top-k routed experts per MoE layer, embeddings
    and LM head included, as publishers do (Mixtral 12.9B, DeepSeek-V3 37B)."""

    total: int
    active: int
    embedding: int
    lm_head: int
    non_embedding: int  # total minus embedding and LM head
    routed_experts: int  # all routed-expert weights (0 for dense models)
    active_routed_experts: int
    mtp: int  # MTP layers, not in total
    vision: int  # the vision tower
    vision_in_total: bool
    by_part: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


# The vision tower and the headline (investigated for Qwen3.5, the multimodal wrapper among the references): the
# Qwen3.5 cards list "Number of Parameters" under the heading "Language Model" (27B; 35B in total and 3B activated),
# so the stated figures describe the text stack. The counts agree either way within 2%: text only 26.896B (-0.4%)
# and 34.661B (-1.0%), with the ~0.45B vision tower 27.357B (+1.3%) and 35.107B (+0.3%); the heading decides. Text
# only is also what llama.cpp reports for these checkpoints' text GGUFs (26.9B, 34.66B). So the vision tower stays
# out of the headline total and active counts and is shown apart; weight memory and training do load it (a served
# or fine-tuned Qwen3.5 checkpoint holds it).
VISION_IN_HEADLINE = False


def count_params(tensors: list[Tensor], vision_in_total: bool = VISION_IN_HEADLINE) -> ParamCounts:
    sections = ("main", "vision") if vision_in_total else ("main",)
    head = [t for t in tensors if t.section in sections]
    by_part: dict[str, int] = {}
    for t in head:
        by_part[t.part] = by_part.get(t.part, 0) + t.numel
    total = sum(t.numel for t in head)
    embedding = sum(t.numel for t in head if t.part == "embedding" and t.section == "main")
    lm_head = sum(t.numel for t in head if t.part == "lm_head")
    return ParamCounts(
        total=total,
        active=sum(t.active_numel for t in head),
        embedding=embedding,
        lm_head=lm_head,
        non_embedding=total - embedding - lm_head,
        routed_experts=sum(t.numel for t in head if t.part == "experts"),
        active_routed_experts=sum(t.active_numel for t in head if t.part == "experts"),
        mtp=sum(t.numel for t in tensors if t.section == "mtp"),
        vision=sum(t.numel for t in tensors if t.section == "vision"),
        vision_in_total=vision_in_total,
        by_part=by_part,
    )
