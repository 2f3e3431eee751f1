"""One SFT step and one GRPO step on a randomly initialised Qwen3 of about 0.5B parameters, timed, on the GPU.

Part of scripts/gpu_check.sh: it shows the training path (TRL's SFTTrainer and GRPOTrainer, bf16 on CUDA; GRPO's
rollouts through vLLM colocated on the same GPU when vLLM is installed, else through transformers' generate) runs
on the device at a real model's size, and how long a step and its memory take. The tokenizer is the tiny world's
(its chat template and control tokens); the model keeps Qwen3's 151,936-row embedding, so its size is real.

    python scripts/gpu_train_step.py --json out.json              # on a GPU box
    python scripts/gpu_train_step.py --device cpu --small          # a tiny model on CPU: checks the script itself
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_decode import QWEN3_05B  # noqa: E402  (the same ~0.5B config the decode benchmark uses)

SMALL = dict(QWEN3_05B, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def build(model_dir: Path, small: bool) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from posttrain.data.tiny_world import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(**(SMALL if small else QWEN3_05B), bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters -> {model_dir}", flush=True)


def peak_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None


def sft_step(model_dir: Path, out: Path, cpu: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from posttrain.data.tiny_world import sft_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = sft_rows("train", {"echo": 8, "arith": 8}, 0)
    dataset = Dataset.from_list([{"messages": r["messages"]} for r in rows])
    args = SFTConfig(output_dir=str(out / "sft"), max_steps=1, per_device_train_batch_size=8, max_length=256,
                     bf16=not cpu, use_cpu=cpu, report_to=[], save_strategy="no", logging_steps=1,
                     activation_checkpointing=True, assistant_only_loss=False)
    dtype = torch.float32 if cpu else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return {"step_s": round(seconds, 2), "loss": loss, "peak_gb": peak_gb(), "device": str(model.device)}


def grpo_step(model_dir: Path, out: Path, cpu: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.data.tiny_world import make_arith, take_split
    from rewards import REWARDS

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    use_vllm = not cpu and importlib.util.find_spec("vllm") is not None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = take_split(make_arith(0.0), 8, "train", 0, "arith")
    dataset = Dataset.from_list([{"prompt": r["messages"][:1], "answer": r["answer"]} for r in rows])
    args = GRPOConfig(output_dir=str(out / "grpo"), max_steps=1, per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=64, bf16=not cpu, use_cpu=cpu, report_to=[], save_strategy="no",
                      logging_steps=1, use_vllm=use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                      beta=0.0, loss_type="dapo")
    dtype = torch.float32 if cpu else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                          reward_funcs=[REWARDS["math_verifier"]])
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    return {"step_s": round(seconds, 2), "loss": logged["loss"], "reward": logged.get("reward"),
            "rollouts": "vllm colocate" if use_vllm else "transformers generate", "peak_gb": peak_gb(),
            "device": str(model.device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (checks the script, not the device)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import torch

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("gpu_train_step: no CUDA device (use --device cpu --small to check the script)", file=sys.stderr)
        return 5
    results: dict = {"model": "Qwen3 ~0.5B (random)" if not args.small else "Qwen3 2-layer (random)"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = Path(tmp) / "model", Path(tmp) / "out"
        build(model_dir, args.small)
        for name, step in (("sft", sft_step), ("grpo", grpo_step)):
            try:
                results[name] = step(model_dir, out, cpu)
            except Exception as err:  # report each step's failure and go on to the next
                results[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
            print(f"{name}: {results[name]}", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in results[k] for k in ("sft", "grpo")) else 1


if __name__ == "__main__":
    sys.exit(main())
