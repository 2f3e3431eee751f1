"""Read a model's `config.json` (a file, a model directory or a hub id) and normalise it into an `Arch`.

Every family the planner knows meets the arithmetic as the same few dataclasses, so `params.py` never looks at a
`model_type`. The shapes follow the transformers modeling code of each family (checked tensor by tensor in
tests/unit/test_planner.py against models built on the meta device):

- llama, mistral, qwen2, qwen3: dense GQA attention + SwiGLU MLP (qwen2: q/k/v biases; qwen3: q/k RMSNorm).
- mixtral (`num_local_experts`), qwen3_moe (`num_experts`, `moe_intermediate_size`, `decoder_sparse_step`,
  `mlp_only_layers`): routed experts, a router, top-k.
- qwen3_next, qwen3_5, qwen3_5_moe: hybrid stacks (`layer_types`, or `full_attention_interval`) of Gated DeltaNet
  linear attention and gated full attention (q_proj also emits a per-channel output gate, so it is 2x wide); the
  MoE variants add a shared expert with a sigmoid gate. Qwen3.5 nests the language model under `text_config` and
  ships a vision tower under `vision_config`.
- deepseek_v3: multi-head latent attention (q_lora_rank, kv_lora_rank, rope/nope head dims), the first
  `first_k_dense_replace` layers dense, then routed + shared experts, and `num_nextn_predict_layers` MTP layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
KNOWN_TYPES = DENSE_TYPES + ("mixtral", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                             "qwen3_5_moe_text", "deepseek_v3")
_MISSING = object()


class PlannerError(ValueError):
    """A config the planner cannot read: the message names the file and the key."""


@dataclass
class Attention:
    """Standard (GQA) attention. `output_gate`: q_proj also emits a sigmoid gate per channel (Qwen3-Next/3.5)."""

    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    output_gate: bool = False


@dataclass
class LatentAttention:
    """DeepSeek multi-head latent attention; q_lora_rank None means a plain q_proj."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False  # attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj


@dataclass
class LinearAttention:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    state_dtype: str = "float32"  # the recurrent state's dtype (`mamba_ssm_dtype` when the config gives one)

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # the causal conv runs over q, k and v
        return 2 * self.key_dim + self.value_dim


@dataclass
class MoE:
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # a [1, hidden] sigmoid gate on the shared expert (Qwen3-Next / 3.5)


@dataclass
class Vision:
    """The Qwen3.5 (Qwen3-VL-style) vision tower: conv3d patch embed, learned positions, ViT blocks, merger."""

    depth: int
    hidden: int
    intermediate: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    num_position_embeddings: int
    spatial_merge_size: int
    out_hidden: int


@dataclass
class Layer:
    mixer: str  # "attention" | "mla" | "linear_attention"
    mlp: str  # "dense" | "moe"


@dataclass
class Arch:
    source: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLP layers (0 when there are none)
    tie_word_embeddings: bool
    layers: list[Layer]
    attention: Attention | None = None
    mla: LatentAttention | None = None
    linear: LinearAttention | None = None
    moe: MoE | None = None
    mlp_bias: bool = False
    mtp_layers: int = 0
    mtp_style: str = ""  # "deepseek" (enorm, hnorm, eh_proj, shared_head.norm) | "qwen" (fc + 3 norms)
    vision: Vision | None = None
    checkpoint_dtype: str = ""
    notes: list[str] = field(default_factory=list)

    def count(self, mixer: str) -> int:
        return sum(layer.mixer == mixer for layer in self.layers)


class ConfigView:
    """Key access that fails with the file and the dotted key: `deepseek-v3.config.json: missing key 'kv_lora_rank'`."""

    def __init__(self, data: dict, source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def fail(self, key: str, what: str) -> PlannerError:
        return PlannerError(f"{self.source}: {what} '{self.prefix}{key}' (model_type {self.data.get('model_type')!r})")

    def req(self, key: str, kind: type = int) -> Any:
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            raise self.fail(key, "missing key")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(key, f"expected an integer, got {value!r} for key")
        return value

    def req_any(self, *keys: str) -> int:
        """The first of `keys` present (names differ between the published config and transformers' own
        serialisation, e.g. qwen3_moe's num_experts is saved as num_local_experts by transformers 5)."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.req(key)
        raise self.fail(keys[0], "missing key (nor " + ", ".join(f"'{k}'" for k in keys[1:]) + ")")

    def opt(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def sub(self, key: str) -> "ConfigView":
        value = self.req(key, dict)
        if not isinstance(value, dict):
            raise self.fail(key, "expected an object for key")
        return ConfigView(value, self.source, f"{self.prefix}{key}.")


# ---- loading ---------------------------------------------------------------------------------------------------
def load_config(source: str | os.PathLike) -> dict:
    """The config dict of a config.json file, a model directory (its config.json) or a hub id (config.json only,
    through huggingface_hub; offline, a hub id that is not in the local cache is an error naming it). The dict
    records where it came from under `_planner_source`, so that later errors name the file."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlannerError(f"{source}: a directory without a config.json")
    elif not path.exists():
        if str(source).count("/") != 1 or str(source).endswith(".json"):
            raise PlannerError(f"{source}: no such file or directory (nor a hub id of the form org/name)")
        path = _download_config(str(source))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlannerError(f"{path}: not a readable JSON config ({err})") from None
    if not isinstance(data, dict):
        raise PlannerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    data.setdefault("_planner_source", str(path if Path(source).exists() else source))
    return data


def _download_config(repo_id: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as err:  # offline, unknown repo, gated repo, network: all end the same way for the user
        offline = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if os.environ.get("HF_HUB_OFFLINE") in (
            "1", "true", "True", "ON", "YES") else ""
        raise PlannerError(
            f"hub id '{repo_id}': could not fetch its config.json{offline}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from None


# ---- normalising ---------------------------------------------------------------------------------------------------
def parse_arch(config: dict, source: str | None = None) -> Arch:
    """The normalised architecture of a config dict (`source` names it in errors)."""
    source = source or str(config.get("_planner_source", "config"))
    top = ConfigView(config, source)
    model_type = config.get("model_type")
    if model_type is None:
        raise PlannerError(f"{source}: missing key 'model_type'")
    if model_type not in KNOWN_TYPES:
        raise PlannerError(f"{source}: unknown model_type {model_type!r} (key 'model_type'); the planner knows "
                           f"{', '.join(KNOWN_TYPES)}")
    # Qwen3.5 wrappers keep the language model under text_config
    text = top.sub("text_config") if "text_config" in config else top
    if model_type.startswith("qwen3_5") and text is top and not model_type.endswith("_text"):
        raise PlannerError(f"{source}: missing key 'text_config' (model_type {model_type!r})")
    c = text
    hidden = c.req("hidden_size")
    # a wrapper's own tie_word_embeddings decides (transformers ties by it), else the text config's
    tie = bool(top.opt("tie_word_embeddings", c.opt("tie_word_embeddings", False)))
    arch = Arch(source=source, model_type=model_type, vocab_size=c.req("vocab_size"), hidden_size=hidden,
                intermediate_size=0, tie_word_embeddings=tie, layers=[],
                checkpoint_dtype=str(c.opt("torch_dtype", c.opt("dtype", top.opt("torch_dtype", "")))))
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        arch.notes.append(f"checkpoint stored as {quant.get('quant_method')} ({quant.get('fmt', '')}"
                          f"{', block ' + str(quant['weight_block_size']) if 'weight_block_size' in quant else ''})")
    family = model_type.removesuffix("_text")
    if family == "deepseek_v3":
        _deepseek_v3(c, arch)
    else:
        _qwen_llama(c, arch, family)
    if "vision_config" in config:
        _vision(top.sub("vision_config"), arch)
    return arch


def _gqa(c: ConfigView, hidden: int) -> Attention:
    heads = c.req("num_attention_heads")
    head_dim = c.opt("head_dim", None) or hidden // heads
    return Attention(heads=heads, kv_heads=c.opt("num_key_value_heads", heads), head_dim=head_dim)


def _qwen_llama(c: ConfigView, arch: Arch, family: str) -> None:
    n, hidden = c.req("num_hidden_layers"), arch.hidden_size
    att = _gqa(c, hidden)
    bias = bool(c.opt("attention_bias", False))
    if family == "qwen2":  # q/k/v always carry a bias, o_proj never
        att.qkv_bias, att.o_bias = True, False
    elif family != "mistral" and family != "mixtral":  # mistral/mixtral: no attention biases at all
        att.qkv_bias = att.o_bias = bias
    att.qk_norm = family in ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
    # transformers always builds the gated q_proj for these families; a config that says attn_output_gate=false
    # is honoured as vLLM does
    att.output_gate = family in ("qwen3_next", "qwen3_5", "qwen3_5_moe") and bool(c.opt("attn_output_gate", True))
    arch.attention = att
    arch.mlp_bias = family == "llama" and bool(c.opt("mlp_bias", False))

    mixers = ["attention"] * n
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        mixers = _layer_types(c, n)
        arch.linear = LinearAttention(
            key_heads=c.req("linear_num_key_heads"), value_heads=c.req("linear_num_value_heads"),
            key_head_dim=c.req("linear_key_head_dim"), value_head_dim=c.req("linear_value_head_dim"),
            conv_kernel=c.req("linear_conv_kernel_dim"), state_dtype=str(c.opt("mamba_ssm_dtype", "float32")),
        )
    mlps = ["dense"] * n
    if family == "mixtral":
        arch.moe = MoE(experts=c.req_any("num_local_experts", "num_experts"), top_k=c.req("num_experts_per_tok"),
                       expert_intermediate=c.req("intermediate_size"))
        mlps = ["moe"] * n
    elif family in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        experts = c.req_any("num_experts", "num_local_experts")
        arch.moe = MoE(experts=experts, top_k=c.req("num_experts_per_tok"),
                       expert_intermediate=c.req("moe_intermediate_size"))
        if family != "qwen3_moe":
            arch.moe.shared_intermediate = c.req("shared_expert_intermediate_size")
            arch.moe.shared_gate = True
        if family == "qwen3_5_moe":
            mlps = ["moe"] * n  # transformers' Qwen3.5-MoE decoder layer is sparse everywhere
        else:
            step, dense_only = c.opt("decoder_sparse_step", 1), set(c.opt("mlp_only_layers", []))
            mlps = ["moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "dense"
                    for i in range(n)]
    if "dense" in mlps:
        arch.intermediate_size = c.req("intermediate_size")
    arch.layers = [Layer(m, p) for m, p in zip(mixers, mlps)]
    if family in ("qwen3_5", "qwen3_5_moe"):
        arch.mtp_layers, arch.mtp_style = c.opt("mtp_num_hidden_layers", 0), "qwen"
    elif family == "qwen3_next":
        # The checkpoint ships one MTP layer (mtp.*) but the config does not say so; vLLM assumes 1 when
        # num_nextn_predict_layers is absent, and so does the planner.
        arch.mtp_layers, arch.mtp_style = c.opt("num_nextn_predict_layers", 1), "qwen"


def _layer_types(c: ConfigView, n: int) -> list[str]:
    types = c.data.get("layer_types")
    if types is None:
        interval = c.data.get("full_attention_interval")
        if interval is None:
            raise c.fail("layer_types", "missing key (nor 'full_attention_interval')")
        return ["attention" if (i + 1) % int(interval) == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise c.fail("layer_types", f"{len(types)} entries for num_hidden_layers={n} in key")
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise c.fail("layer_types", f"unknown layer types {unknown} in key")
    return ["attention" if t == "full_attention" else "linear_attention" for t in types]


def _deepseek_v3(c: ConfigView, arch: Arch) -> None:
    n = c.req("num_hidden_layers")
    arch.mla = LatentAttention(
        heads=c.req("num_attention_heads"), q_lora_rank=c.opt("q_lora_rank", None), kv_lora_rank=c.req("kv_lora_rank"),
        qk_nope_head_dim=c.req("qk_nope_head_dim"), qk_rope_head_dim=c.req("qk_rope_head_dim"),
        v_head_dim=c.req("v_head_dim"), bias=bool(c.opt("attention_bias", False)),
    )
    arch.moe = MoE(experts=c.req_any("n_routed_experts", "num_local_experts"), top_k=c.req("num_experts_per_tok"),
                   expert_intermediate=c.req("moe_intermediate_size"),
                   shared_intermediate=c.req("moe_intermediate_size") * c.opt("n_shared_experts", 0))
    first_dense, freq = c.opt("first_k_dense_replace", 0), c.opt("moe_layer_freq", 1)
    # DeepSeek's reference code: a layer is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    arch.layers = [Layer("mla", "moe" if i >= first_dense and i % freq == 0 else "dense") for i in range(n)]
    if any(layer.mlp == "dense" for layer in arch.layers):
        arch.intermediate_size = c.req("intermediate_size")
    arch.mtp_layers, arch.mtp_style = c.opt("num_nextn_predict_layers", 0), "deepseek"


def _vision(v: ConfigView, arch: Arch) -> None:
    if v.data.get("deepstack_visual_indexes"):
        raise v.fail("deepstack_visual_indexes", "deepstack mergers are not modelled; non-empty key")
    arch.vision = Vision(
        depth=v.req("depth"), hidden=v.req("hidden_size"), intermediate=v.req("intermediate_size"),
        in_channels=v.opt("in_channels", 3), patch_size=v.req("patch_size"),
        temporal_patch_size=v.opt("temporal_patch_size", 2), num_position_embeddings=v.req("num_position_embeddings"),
        spatial_merge_size=v.opt("spatial_merge_size", 2), out_hidden=v.req("out_hidden_size"),
    )
