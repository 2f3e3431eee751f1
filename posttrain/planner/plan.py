"""`plan_model(config) -> Plan`: every figure of the capacity planner for one config, and `verdict_line`.

    from posttrain.planner import load_config, plan_model, verdict_line
    plan = plan_model(load_config("Qwen/Qwen3-0.6B"), gpus=1, gpu_mem_gb=24)
    log.info(verdict_line(plan, method="lora", strategy="ddp"))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from posttrain.planner.config import Arch, parse_arch
from posttrain.planner.memory import (DEFAULT_BANDWIDTHS, GB, DecodeRow, KVReport, WeightRow, decode_ceilings,
                                      dtype_bytes, kv_report, weight_rows)
from posttrain.planner.params import ParamCounts, count_params, inventory
from posttrain.planner.training import METHOD_NAMES, METHODS, STRATEGIES, STRATEGY_NAMES, TrainingReport, \
    training_report


@dataclass
class Plan:
    source: str
    model_type: str
    arch: dict  # the normalised architecture (layers summarised)
    params: ParamCounts
    weights: list[WeightRow]
    kv: KVReport
    decode: list[DecodeRow]
    training: TrainingReport
    settings: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _arch_summary(arch: Arch) -> dict:
    summary = {
        "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size, "num_layers": len(arch.layers),
        "tie_word_embeddings": arch.tie_word_embeddings,
        "layers": {f"{m}+{p}": sum((layer.mixer, layer.mlp) == (m, p) for layer in arch.layers)
                   for m, p in sorted({(layer.mixer, layer.mlp) for layer in arch.layers})},
        "mtp_layers": arch.mtp_layers, "checkpoint_dtype": arch.checkpoint_dtype,
    }
    for name in ("attention", "mla", "linear", "moe", "vision"):
        value = getattr(arch, name)
        if value is not None:
            summary[name] = asdict(value)
    return summary


def plan_model(config: dict, *, source: str | None = None, group_size: int = 128, kv_dtype: str = "bf16",
               contexts: tuple[int, ...] | list[int] = (4096, 32768), batches: tuple[int, ...] | list[int] = (1, 8),
               bandwidths: dict[str, float] | None = None, gpus: int = 8, gpu_mem_gb: float = 80.0,
               seq_len: int = 4096, micro_batch: int = 1, lora_rank: int = 16, gradient_checkpointing: bool = True,
               usable_fraction: float = 0.9) -> Plan:
    """All planner figures for a config dict (from `load_config`). Raises PlannerError for a config it cannot
    read and ValueError for bad settings."""
    if group_size < 0:
        raise ValueError(f"group_size must be >= 0 (0: one scale per row), got {group_size}")
    dtype_bytes(kv_dtype, "kv_dtype")  # validates before any arithmetic
    if any(c < 1 for c in contexts) or any(b < 1 for b in batches):
        raise ValueError(f"contexts and batches must be positive, got {list(contexts)} and {list(batches)}")
    bandwidths = dict(DEFAULT_BANDWIDTHS if bandwidths is None else bandwidths)
    if not bandwidths or any(bw <= 0 for bw in bandwidths.values()):
        raise ValueError(f"bandwidths must be positive GB/s, got {bandwidths}")
    arch = parse_arch(config, source)
    tensors = inventory(arch)
    params = count_params(tensors)
    weights = weight_rows(tensors, group_size)
    notes = list(arch.notes)
    if params.mtp:
        notes.append(f"{arch.mtp_layers} MTP layer(s): {params.mtp / 1e9:.2f}B parameters shown apart, not in the "
                     f"total and not loaded (they share the main embedding and LM head)")
    if params.vision:
        notes.append(f"vision tower: {params.vision / 1e9:.3f}B parameters, not in the headline total (the card "
                     f"states the language model), loaded in bf16 in weight memory and training")
    return Plan(
        source=arch.source, model_type=arch.model_type, arch=_arch_summary(arch), params=params, weights=weights,
        kv=kv_report(arch, kv_dtype, list(contexts), list(batches)),
        decode=decode_ceilings(weights, bandwidths),
        training=training_report(arch, tensors, gpus, gpu_mem_gb, seq_len, micro_batch, lora_rank, group_size,
                                 gradient_checkpointing, usable_fraction),
        settings={"group_size": group_size, "kv_dtype": kv_dtype, "contexts": list(contexts),
                  "batches": list(batches), "bandwidths_gbs": bandwidths, "gpus": gpus, "gpu_mem_gb": gpu_mem_gb,
                  "seq_len": seq_len, "micro_batch": micro_batch, "lora_rank": lora_rank,
                  "gradient_checkpointing": gradient_checkpointing, "usable_fraction": usable_fraction},
        notes=notes,
    )


def verdict_line(plan: Plan, method: str | None = None, strategy: str | None = None) -> str:
    """One line for a stage to log at start-up. With method and strategy: that row's verdict; without: the
    lightest-to-heaviest search for the first (method, strategy) that fits, full fine-tuning first."""
    t, p = plan.training, plan.params
    head = (f"{plan.source}: {p.total / 1e9:.2f}B params ({p.active / 1e9:.2f}B active), "
            f"{t.gpus}x{t.gpu_mem_gb:g} GB, seq {t.seq_len} x micro-batch {t.micro_batch}")
    if method is not None or strategy is not None:
        if method not in METHODS or strategy not in STRATEGIES:
            raise ValueError(f"method must be one of {METHODS} and strategy one of {STRATEGIES}, "
                             f"got {method!r}, {strategy!r}")
        row = t.row(method, strategy)
        verdict = "fits" if row.fits else "DOES NOT FIT"
        return (f"{head}: {METHOD_NAMES[method]} {STRATEGY_NAMES[strategy]} {verdict} "
                f"({row.total / GB:.1f} GB/GPU; {row.advice})")
    for m in METHODS:
        for s in STRATEGIES:
            row = t.row(m, s)
            if row.fits:
                return f"{head}: {METHOD_NAMES[m]} fits with {STRATEGY_NAMES[s]} ({row.total / GB:.1f} GB/GPU)"
    return f"{head}: nothing fits; {t.row('qlora', 'zero3').advice}"
