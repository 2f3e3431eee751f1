"""The engine's own decoder for the families we train: Qwen3, Qwen2, Llama (SmolLM2) and Qwen3-MoE.

Plain PyTorch in the style of gpt-fast: a static KV cache per layer and one `forward` used by both prefill (many
tokens per row) and decode (one token per row). Why not transformers' model with a cache: per decode token it
runs several times more Python (cache objects, mask builders, output dataclasses), and on a 2-core CPU that
overhead is a large share of a small model's step (about 10-14 ms per token for 24 layers, measured on 2 cores).

Module names follow the checkpoints on disk (`model.layers.0.self_attn.q_proj`, `lm_head`, MoE experts as
`mlp.experts.<j>.gate_proj`), so a state dict loads without renaming and quantization swaps a named `nn.Linear`
for a fused quantized module (`posttrain.quant.linear.swap_linears`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.quant.linear import fuse_outputs

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe")


@dataclass
class ModelArgs:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotation
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # mixture of experts (Qwen3-MoE); sparse_layers lists the layers whose MLP is routed
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        family = config.model_type
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not one the engine runs; expected one of {FAMILIES}")
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{family} config has use_sliding_window=True; the engine has no sliding-window attention")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r}: the engine's MLP is SwiGLU (silu)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        args = cls(
            family=family,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rms_eps=config.rms_norm_eps,
            max_position=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
            o_bias=family != "qwen2" and bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )
        if family == "qwen3_moe":
            args.num_experts = config.num_experts
            args.experts_per_token = config.num_experts_per_tok
            args.moe_intermediate_size = config.moe_intermediate_size
            args.norm_topk_prob = config.norm_topk_prob
            args.sparse_layers = [
                i for i in range(config.num_hidden_layers)
                if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
            ]
        return args


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling, computed exactly as transformers does for this config."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} in the model config is not known to transformers")
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 and cast back before the weight, as transformers does (bit-exact logits)
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, S, heads, D]; cos/sin: [B, S, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """Preallocated keys and values for `max_batch` rows of `max_len` positions: [rows, kv_heads, max_len, D]."""

    def __init__(self, max_batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        shape = (max_batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, flat_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # flat_index: [B * S * kv_heads] rows of the cache seen as [rows * kv_heads * max_len, D];
        # k, v: [B, S, kv_heads, D]. One index_copy_ per tensor: far cheaper than advanced-index assignment.
        d = k.shape[-1]
        self.k.view(-1, d).index_copy_(0, flat_index, k.reshape(-1, d))
        self.v.view(-1, d).index_copy_(0, flat_index, v.reshape(-1, d))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, kvh, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, h * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kvh * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kvh * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_eps)
            self.k_norm = RMSNorm(d, args.rms_eps)
        self.head_dim, self.qk_norm = d, args.qk_norm
        self.qkv_proj: nn.Module | None = None  # q, k and v in one module: Transformer.fuse_projections
        self.qkv_sizes = (h * d, kvh * d, kvh * d)
        self.cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, rows, flat_index, length: int):
        # x: [B, S, hidden]; mask: [B, 1, S, length] (True = attend); rows: the cache rows (slice or [B])
        bsz, seq, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.view(bsz, seq, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.cache.update(flat_index, k.to(self.cache.k.dtype), v.to(self.cache.v.dtype))
        keys, values = self.cache.k[rows, :, :length], self.cache.v[rows, :, :length]  # [B, kv_heads, length, D]
        if seq == 1:
            out = decode_attention(q, keys, values, mask).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                enable_gqa=keys.shape[1] != q.shape[2]
            ).transpose(1, 2)
        return self.o_proj(out.reshape(bsz, seq, -1))


def decode_attention(q, keys, values, mask):
    """Attention of one new token per row, grouped-query: q [B, 1, heads, D], keys/values [B, kv_heads, L, D].

    Plain matmuls in fp32: torch's fused CPU attention with a mask costs more per call than the whole product at
    one query, and a bf16 batched matmul has no fast path on AVX2 CPUs (measured: ~1.7 ms per call at L ~ 100,
    against ~0.03 ms in fp32); the keys and values of one row are small enough to widen every step.
    Under torch.compile the two products are written as broadcast multiply-and-sum instead, which Inductor fuses
    with the mask and softmax into a few loops: on SmolLM2-135M that replaced 60 bmm calls per token (~16 us each)
    and took ~7 % off a batch-1 step. Eagerly that form would materialise [B, kv_heads, group, L, D], so bmm."""
    bsz, _, heads, d = q.shape
    kv_heads = keys.shape[1]
    q = q.float().view(bsz, kv_heads, heads // kv_heads, d)  # query heads grouped under the kv head they share
    if torch.compiler.is_compiling():
        scores = (q[:, :, :, None] * keys.float()[:, :, None]).sum(-1) * d**-0.5  # [B, kv_heads, group, L]
    else:
        scores = (q @ keys.float().transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~mask[:, :, 0, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if torch.compiler.is_compiling():
        out = (probs[..., None] * values.float()[:, :, None]).sum(-2)  # [B, kv_heads, group, D]
    else:
        out = probs @ values.float()
    return out.view(bsz, 1, heads, d).to(keys.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one module: Transformer.fuse_projections

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE). Only the chosen experts run, so decode reads k experts' weights."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args.hidden_size, args.num_experts)
        self.experts = nn.ModuleList(
            MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.top_k, self.norm_topk_prob = args.experts_per_token, args.norm_topk_prob

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [tokens, hidden]
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            token, slot = torch.where(chosen == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_eps)
        if layer in args.sparse_layers:
            self.mlp = MoE(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)

    def forward(self, x, cos, sin, mask, rows, flat_index, length):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, rows, flat_index, length)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, inv_freq: torch.Tensor, rope_scale: float = 1.0):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale
        self.max_batch = self.max_len = 0
        self.kv_dtype: torch.dtype | None = None

    def setup_cache(self, max_batch: int, max_len: int, kv_dtype: torch.dtype | None = None,
                    keep: bool = False) -> None:
        """(Re)allocate every layer's KV cache for `max_batch` rows of `max_len` positions, and the rotary table.
        kv_dtype: the cache's dtype (default: the weights'); keep: copy what the old cache holds into the new one
        (the same rows, a longer cache: a running batch's cache grows without losing its keys)."""
        if max_len > self.args.max_position:
            raise ValueError(f"cache length {max_len} exceeds the model's max_position_embeddings {self.args.max_position}")
        dtype, device = self.model.norm.weight.dtype, self.model.norm.weight.device
        kv_dtype = kv_dtype or self.kv_dtype or dtype
        if (max_batch, max_len, kv_dtype) == (self.max_batch, self.max_len, self.kv_dtype):
            return
        if keep and (max_batch != self.max_batch or max_len < self.max_len):
            raise ValueError(f"a kept cache only grows longer: {self.max_batch} x {self.max_len} -> "
                             f"{max_batch} x {max_len}")
        for block in self.model.layers:
            old = block.self_attn.cache
            block.self_attn.cache = None  # the old cache goes before the new one is made, unless it is kept
            new = KVCache(max_batch, max_len, self.args.num_kv_heads, self.args.head_dim, kv_dtype, device)
            if keep and old is not None:
                new.k[:, :, :self.max_len] = old.k
                new.v[:, :, :self.max_len] = old.v
            block.self_attn.cache = new
            del old
        self.max_batch, self.max_len, self.kv_dtype = max_batch, max_len, kv_dtype
        freqs = torch.arange(max_len, device=device, dtype=torch.float)[:, None] * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D], computed as transformers does, then cast
        self.register_buffer("rope_cos", (emb.cos() * self.rope_scale).to(dtype), persistent=False)
        self.register_buffer("rope_sin", (emb.sin() * self.rope_scale).to(dtype), persistent=False)
        self.register_buffer("slots", torch.arange(max_len, device=device), persistent=False)
        heads = torch.arange(self.args.num_kv_heads, device=device)
        self.register_buffer("head_offsets", heads * max_len, persistent=False)

    def fuse_projections(self) -> int:
        """Merge each layer's q/k/v projections into one module, and each MLP's gate/up, where the linears can share
        one (`posttrain.quant.linear.fuse_outputs`: own-kernel modules of one layout); returns how many merged.
        The merged module holds the weights; the separate ones are dropped. Only for an inference copy: names such
        as q_proj no longer resolve afterwards (a roll-out engine that receives weights by name is never fused)."""
        fused = 0
        for module in list(self.modules()):
            if isinstance(module, Attention) and module.qkv_proj is None:
                merged = fuse_outputs([module.q_proj, module.k_proj, module.v_proj])
                if merged is not None:
                    module.qkv_proj, fused = merged, fused + 1
                    del module.q_proj, module.k_proj, module.v_proj
            elif isinstance(module, MLP) and module.gate_up_proj is None:
                merged = fuse_outputs([module.gate_proj, module.up_proj])
                if merged is not None:
                    module.gate_up_proj, fused = merged, fused + 1
                    del module.gate_proj, module.up_proj
        return fused

    def cache_bytes(self) -> int:
        """Bytes the KV caches hold now (all layers, keys and values)."""
        caches = [block.self_attn.cache for block in self.model.layers if block.self_attn.cache is not None]
        return sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in caches)

    def kv_bytes_per_token(self) -> int:
        """Bytes the KV cache holds per position of one row, over all layers (keys and values)."""
        return self.cache_bytes() // (self.max_batch * self.max_len)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, rows: slice | torch.Tensor, length: int,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, pos: [B, S] (pos = cache position = rotary position); rows: the cache rows these sequences
        own, a slice (the cache is then read as a view) or a LongTensor [B] (read as a gathered copy); length:
        cache positions to attend over (> every pos); last: [B] index into S of the position whose logits are
        wanted (then returns [B, vocab], else [B, S, vocab])."""
        x = self.model.embed_tokens(tokens)
        row_ids = torch.arange(self.max_batch, device=pos.device)[rows] if isinstance(rows, slice) else rows
        cos, sin = self.rope_cos[pos][:, :, None], self.rope_sin[pos][:, :, None]  # [B, S, 1, D]
        mask = (self.slots[None, None, :length] <= pos[:, :, None])[:, None]  # [B, 1, S, length]
        # where each new key goes in the cache seen as [rows * kv_heads * max_len, D]: [B * S * kv_heads]
        flat_index = ((row_ids[:, None, None] * self.args.num_kv_heads * self.max_len) + self.head_offsets
                      + pos[:, :, None]).reshape(-1)
        for block in self.model.layers:
            x = block(x, cos, sin, mask, rows, flat_index, length)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]  # the LM head only where needed
        logits = self.lm_head(self.model.norm(x))
        return logits[:, 0] if last is not None else logits


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
