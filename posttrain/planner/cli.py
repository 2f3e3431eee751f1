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
import re
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


UNITS = {"k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3, "p": 1e6, "ki": 2**10 / 1e9, "mi": 2**20 / 1e9,
         "gi": 2**30 / 1e9, "ti": 2**40 / 1e9}  # prefix of B (or B/s) -> how many GB one is
BANDWIDTH_RANGE_GB_S = (1.0, 100_000.0)  # a laptop's DRAM to well beyond any accelerator's HBM
MEMORY_RANGE_GB = (1.0, 4_096.0)


def quantity_gb(text: str, per_second: bool, valid: tuple[float, float]) -> float:
    """'900', '900GB/s', '3.35 TB/s', '141GiB' -> GB (per second for a bandwidth); a bare number is GB(/s). Values
    outside `valid` are refused: a bandwidth of 1e12 GB/s is a unit mistake, not a machine.

    >>> quantity_gb("2TB/s", True, BANDWIDTH_RANGE_GB_S), quantity_gb("141GiB", False, MEMORY_RANGE_GB)
    (2000.0, 151.397597184)
    """
    unit = "B/s" if per_second else "B"
    number = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
    match = re.fullmatch(number + r"\s*(?:([kmgtpKMGTP]i?)" + re.escape(unit) + ")?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a number of GB{'/s' if per_second else ''} or a quantity with "
                                         f"units (900, 3.35TB/s, 141GiB), got {text!r}")
    value = float(match.group(1)) * (UNITS[match.group(2).lower()] if match.group(2) else 1.0)
    low, high = valid
    shown = f"{value:g} GB{'/s' if per_second else ''}"
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text!r} is {shown}, outside any real machine's range ({low:g} to "
                                         f"{high:g} GB{'/s' if per_second else ''}); a bare number is in GB"
                                         f"{'/s' if per_second else ''}, or give units ({'2TB/s' if per_second else '80GB'})")
    return value


def bandwidth_list(text: str) -> dict[str, float]:
    values = [quantity_gb(v, True, BANDWIDTH_RANGE_GB_S) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one bandwidth")
    return {f"{v:g} GB/s": v for v in values}


def memory_gb(text: str) -> float:
    return quantity_gb(text, False, MEMORY_RANGE_GB)


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
                        help="memory bandwidths for the decode ceiling, comma-separated, in GB/s or with units "
                             "(3.35TB/s) (default "
                             + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_BANDWIDTHS.items()) + ")")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs for training (default 8)")
    parser.add_argument("--gpu-mem", type=memory_gb, default=80.0,
                        help="memory per GPU, in GB or with units (141GB, 96GiB) (default 80)")
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
