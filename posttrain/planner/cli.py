"""`posttrain plan <config.json | model directory | hub id>`: the capacity planner, from the config alone.

    posttrain plan ../shared/data/reference/configs/deepseek-v3.config.json
    posttrain plan Qwen/Qwen3-0.6B --gpus 1 --gpu-mem 24 --lora-rank 16 --json
    posttrain plan runs/demo/04-dpo/model --context 512 --batch 1,16 --kv-dtype fp32

Prints parameters (total, active, embeddings and LM head apart), weight memory per format, the KV cache and the
linear-attention state, decode-speed ceilings and training memory with a verdict per row. No weights are read; a
hub id fetches config.json only. Exit code 2 for a config or setting it cannot use.
"""

from __future__ import annotations

import argparse
import json
import sys

from posttrain.planner.config import PlannerError, load_config
from posttrain.planner.memory import DEFAULT_BANDWIDTHS, DTYPE_BYTES
from posttrain.planner.plan import plan_model
from posttrain.planner.report import render


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def bandwidth_list(text: str) -> dict[str, float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GB/s figures, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one bandwidth")
    return {f"{v:g} GB/s": v for v in values}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain plan", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a config.json, a model directory holding one, or a hub id (org/name)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    parser.add_argument("--group-size", type=int, default=128,
                        help="quantization group size along the input dim; 0: one scale per output row (default 128)")
    parser.add_argument("--kv-dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="KV-cache dtype (default bf16)")
    parser.add_argument("--context", type=int_list, default=[4096, 32768],
                        help="context lengths, comma-separated (default 4096,32768)")
    parser.add_argument("--batch", type=int_list, default=[1, 8], help="batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--bandwidth", type=bandwidth_list, default=None,
                        help="memory bandwidths in GB/s for the decode ceiling, comma-separated (default "
                             + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_BANDWIDTHS.items()) + ")")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs for training (default 8)")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="memory per GPU in GB (default 80)")
    parser.add_argument("--seq-len", type=int, default=4096, help="training sequence length (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=1, help="training micro-batch per GPU (default 1)")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA / QLoRA rank (default 16)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="estimate activations without gradient checkpointing")
    return parser


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a bad option (2, after argparse printed the usage)
        return int(exit_.code or 0)
    try:
        config = load_config(args.source)
        plan = plan_model(
            config, group_size=args.group_size, kv_dtype=args.kv_dtype, contexts=args.context, batches=args.batch,
            bandwidths=args.bandwidth, gpus=args.gpus, gpu_mem_gb=args.gpu_mem, seq_len=args.seq_len,
            micro_batch=args.micro_batch, lora_rank=args.lora_rank,
            gradient_checkpointing=not args.no_gradient_checkpointing,
        )
    except (PlannerError, ValueError) as err:  # PlannerError names the file and key; ValueError a bad setting
        print(f"posttrain plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
