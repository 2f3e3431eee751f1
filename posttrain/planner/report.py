"""The plain-text rendering of a `Plan`: a few aligned tables, one per question the planner answers."""

from __future__ import annotations

from posttrain.planner.memory import GB
from posttrain.planner.plan import Plan
from posttrain.planner.training import METHOD_NAMES, STRATEGY_NAMES


def table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,), indent: str = "  ") -> str:
    """Columns padded to their widest cell; the `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), indent + "  ".join("-" * w for w in widths), *map(line, rows)])


def billions(n: int | float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n else "-"


def gb(n: float) -> str:
    return f"{n / GB:.2f}"


def render(plan: Plan) -> str:
    p, a, s = plan.params, plan.arch, plan.settings
    layers = ", ".join(f"{n} {kind}" for kind, n in a["layers"].items())
    out = [f"{plan.source}  (model_type {plan.model_type})",
           f"  {a['num_layers']} layers ({layers}), hidden {a['hidden_size']}, vocab {a['vocab_size']}"
           + (", tied embeddings" if a["tie_word_embeddings"] else "")]
    out += [f"  note: {n}" for n in plan.notes]

    out += ["", "Parameters"]
    out.append(table(["", "count"], [
        ["total", f"{billions(p.total)}  ({p.total:,})"],
        ["active per token", f"{billions(p.active)}  ({p.active:,})"],
        ["embedding" + (" (tied with LM head)" if a["tie_word_embeddings"] else ""), billions(p.embedding)],
        ["LM head", billions(p.lm_head)],
        ["non-embedding", billions(p.non_embedding)],
        ["routed experts (all / active)", f"{billions(p.routed_experts)} / {billions(p.active_routed_experts)}"],
        ["MTP layers (not in total)", billions(p.mtp)],
        ["vision tower (not in total)" if not p.vision_in_total else "vision tower", billions(p.vision)],
    ]))

    g = s["group_size"]
    out += ["", f"Weight memory (GB; quantized formats: decoder linear weights only, one scale per "
                f"{'row' if g == 0 else f'{g} weights'}; embeddings, LM head, norms, routers in bf16)"]
    out.append(table(["format", "weights GB", "bytes/param", "scales GB", "read per token GB"], [
        [w.format, gb(w.bytes), f"{w.bytes_per_param:.3f}", gb(w.scale_bytes), gb(w.decode_bytes_per_token)]
        for w in plan.weights]))

    kv = plan.kv
    out += ["", f"KV cache ({kv.kv_dtype}): {kv.bytes_per_token:,} B/token = {kv.formula}"]
    if kv.linear_layers:
        out.append(f"  linear-attention state per request: {kv.state_bytes_per_request:,} B = {kv.state_formula}")
    out.append(table(["context", "batch", "KV GB", "state GB", "total GB"], [
        [f"{r['context']:,}", str(r["batch"]), gb(r["kv_bytes"]), gb(r["state_bytes"]), gb(r["total_bytes"])]
        for r in kv.table]))

    labels = list(s["bandwidths_gbs"])
    out += ["", "Decode ceiling, single stream (tokens/s = bandwidth / weight bytes read per token; KV reads and "
                "compute ignored)"]
    headers = [k if k == f"{v:g} GB/s" else f"{k} {v:g} GB/s" for k, v in s["bandwidths_gbs"].items()]
    out.append(table(["format", *headers], [
        [fmt, *[f"{next(d.tokens_per_s for d in plan.decode if d.format == fmt and d.label == k):,.1f}"
                for k in labels]]
        for fmt in dict.fromkeys(d.format for d in plan.decode)]))

    t = plan.training
    out += ["", f"Training memory per GPU (GB) on {t.gpus} x {t.gpu_mem_gb:g} GB, seq {t.seq_len} x micro-batch "
                f"{t.micro_batch}, gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}, "
                f"LoRA rank {t.lora_rank} ({billions(t.lora_params)} adapter params)",
            f"  activations: {t.activation_formula}"]
    out.append(table(["method", "strategy", "weights", "grads", "optimizer", "activations", "total", "verdict"], [
        [METHOD_NAMES[r.method], STRATEGY_NAMES[r.strategy], gb(r.weights), gb(r.gradients), gb(r.optimizer),
         gb(r.activations), gb(r.total), ("fits: " if r.fits else "NO: ") + r.advice] for r in t.rows],
        left=(0, 1, 7)))
    return "\n".join(out)
