"""SmolLM2-135M-Instruct as the pipeline uses it: the whole `pipeline=smollm2` chain cut to a few steps a stage,
eval's check of the served context, and the memory of serving one checkpoint after another in one process.

    .venv/bin/python -m pytest -q -s tests/integration/test_smollm2_pipeline.py    # -s prints the measured figures
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.artifacts import sha256_json
from posttrain.data.dolly import load_dolly
from tests.integration.test_smollm2 import (DOLLY, GSM8K, HH, REPO, SHARED, THREADS, needs_smollm2, smollm2,
                                             trains_on_shared)

__all__ = ["smollm2"]  # the fixture, shared with test_smollm2.py


# --- serving one checkpoint after another in one process (what eval does) -------------------------------------------
SERVE_FOUR = """
import glob, json, logging, os, sys
import openai
from posttrain.config_schema import ServeCfg
from posttrain.serve.server import background_server

def descendants(pid):
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out

def rss():  # resident bytes now (not the peak) of this process and every process under it (the engine's)
    total = 0
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * 4096
        except OSError:
            pass
    return total

logging.basicConfig(level=logging.INFO)
after = []
for i in range(4):
    with background_server(ServeCfg(model=sys.argv[1], port=0, api_key="k", max_batch=32, max_len=2048)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k")
        reply = client.chat.completions.create(model=server.name, max_tokens=8,
                                               messages=[{"role": "user", "content": "Say hi."}])
        assert reply.choices[0].message.content
    after.append(rss())
print(json.dumps(after))
"""


@needs_smollm2
@pytest.mark.slow
def test_serving_four_checkpoints_in_turn_holds_no_more_memory_than_one(smollm2, capfd):
    """Eval serves each checkpoint in turn from one process. Each SmolLM2 server's engine process holds ~540 MB of
    fp32 weights plus its cache, so four engines that outlived their servers would hold 1.5 GB more after the fourth
    than after the first; the resident memory of the evaluating process and every process under it (the engine's
    forkserver, any engine process left) stays within 300 MB of the first's. The server's start-up line states
    weights and cache beside the planner's estimate."""
    _, location = smollm2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(THREADS)}
    result = subprocess.run([sys.executable, "-c", SERVE_FOUR, str(location)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    after = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"smollm2: resident MB after each of 4 servers: {[round(a / 1e6) for a in after]}")
    assert max(after[1:]) <= after[0] + 300e6, after
    line = next(x for x in result.stderr.splitlines() if "serve: memory:" in x)
    print(f"smollm2: {line}")
    served, planned = (float(x.replace(",", "")) for x in re.findall(r"weights ([\d,]+) MB", line))
    assert abs(served / planned - 1) < 0.10, line


# --- the whole real-model pipeline, a handful of steps per stage -----------------------------------------------------
# One run of `pipeline=smollm2` with its step counts cut, read by every test below: the chain's wiring (each
# checkpoint and the base model scored on each suite) and what each training stage did to SmolLM2's weights.
# - SFT: 3 steps of 2 rows on the Dolly rows and 8 GSM8K solutions (the recipe's top 15 layers), a loss logged at
#   each; 2 Dolly rows held out rather than the recipe's 8 (SFT measures their perplexity before and after: the 8
#   long rows took 22 s of the run).
# - Reward model: 2 steps on 8 HH-RLHF pairs, 2 held out.
# - GRPO: one step of 2 GSM8K prompts x 4 samples. No gradient accumulation: with the recipe's 4 micro-batches a step
#   would want 8 prompts, and 2 prompts gave no optimizer step at all (global_step 0, which the pipeline test before
#   this one did not notice). No warm-up: the recipe's 2 warm-up steps make the one step's learning rate 0, and the
#   weights stayed put although some group's rewards differed.
# - DPO: 2 LoRA steps on 2 training HH-RLHF pairs in one batch, so the second step's logged margin shows what the
#   first did to the same pairs; its held-out pairs are the reward model's 2, and its likelihood shift reads the first
#   (dpo.shift_pairs: each held-out pair is a reference and a policy pass of ~500 tokens); pairs cut at 256 tokens.
# - int4 GPTQ calibrates on 2 rows.
# - Eval asks one prompt a suite (the served context for the longest prompts is checked below), replies cut at 16
#   tokens, on a KV cache of 8 rows rather than 64 (zeroing and growing 64 rows took ~4 s of each checkpoint's ~15 s).
# Profiled with py-spy at one thread: these cuts took the run from 267 s in CI to 161 s alone, 208 s in CI (2fc31a1);
# a faster GPTQ loop, HH-RLHF checks that tokenize the training rows only and eval sending its suites together, to
# 140 s alone and 150 s in CI beside the other worker (3bb5030).
HELD_OUT = 2  # Dolly rows held out (data.held_out): the last 2 of the 49
SMOKE = ["sft.trainer.max_steps=3", "sft.trainer.save_steps=3", "sft.trainer.logging_steps=1",
         "sft.trainer.max_length=256", "sft.trainer.per_device_train_batch_size=2", "data.gsm8k.n=8",
         "reward_model.trainer.max_steps=2", "reward_model.trainer.save_steps=2", "reward_model.pairs.n_train=8",
         "reward_model.pairs.n_eval=2", "reward_model.trainer.per_device_train_batch_size=2",
         "reward_model.trainer.gradient_accumulation_steps=1", "reward_model.trainer.warmup_steps=0",
         "reward_model.trainer.max_length=256",
         "grpo.trainer.max_steps=1", "grpo.trainer.save_steps=1", "grpo.prompts.n=2",
         "grpo.trainer.per_device_train_batch_size=8", "grpo.trainer.gradient_accumulation_steps=1",
         "grpo.trainer.max_completion_length=32", "grpo.trainer.warmup_steps=0",
         "dpo.pairs.n_train=2", "dpo.trainer.max_steps=2", "dpo.trainer.save_steps=2",
         "dpo.trainer.per_device_train_batch_size=2", "dpo.trainer.gradient_accumulation_steps=1",
         "dpo.trainer.learning_rate=5e-4", "dpo.trainer.warmup_steps=0", "dpo.trainer.max_length=256",
         "dpo.trainer.logging_steps=1", "+dpo.trainer.activation_checkpointing=false", "dpo.shift_pairs=1",
         "quantize.calibration_rows=2", "quantize.calibration_length=128", "quantize.eval_rows=2",
         f"data.held_out={HELD_OUT}",
         "serve.max_batch=8", "eval.concurrency=8",
         "eval.n_prompts={gsm8k: 1, math500: 1, pku_saferlhf: 1, hh_harmful: 1, benign: 1}", "eval.max_new_tokens=16",
         "eval.latency.requests=1", "eval.latency.max_tokens=8"]
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # recipes/pipeline/smollm2.yaml: grpo and dpo


@pytest.fixture(scope="module")
def smoke(smollm2, tmp_path_factory):
    """(the run directory, the base model directory) of the cut-down `posttrain run pipeline=smollm2`."""
    _, base_dir = smollm2  # converted already, so the stages only read the cache
    root = tmp_path_factory.mktemp("smollm2")
    command = [sys.executable, "-m", "posttrain.cli", "run", "pipeline=smollm2", f"run.root={root}",
               "run.name=smoke", *SMOKE]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(THREADS)}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(f"smollm2: the cut-down pipeline took {time.perf_counter() - started:.0f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"smollm2: {next(line for line in result.stderr.splitlines() if 'finished in' in line)}")
    return root / "smoke", base_dir


def stage(run: Path, name: str) -> tuple[Path, dict]:
    stage_dir = next(run.glob(f"*-{name}"))
    return stage_dir, json.loads((stage_dir / "manifest.json").read_text())


def changed(before: Path, after: Path) -> tuple[list[str], list[str]]:
    """(the weight names whose tensors differ between two model directories, all names); both hold the same names."""
    from safetensors import safe_open

    with safe_open(before / "model.safetensors", "pt") as a, safe_open(after / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())  # merged: no lora_A / lora_B left over
        return [k for k in a.keys() if not a.get_tensor(k).equal(b.get_tensor(k))], list(a.keys())


@trains_on_shared(GSM8K, "the GSM8K, MATH-500, Dolly, PKU-SafeRLHF and HH-RLHF rows")
def test_smollm2_pipeline_runs_every_stage_and_scores_every_checkpoint(smoke):
    """`posttrain run pipeline=smollm2` (recipes/pipeline/smollm2.yaml) cut to a few steps a stage and one prompt
    per eval suite: every stage of the real-model chain runs on SmolLM2's tokenizer, chat template and shapes
    (GRPO's roll-outs on the engine, int4 on 576-wide layers, every eval suite through the server),
    and the scorecard has each checkpoint on each suite."""
    run, _ = smoke
    scorecard = json.loads((run / "scorecard.json").read_text())
    rows = {row["checkpoint"]: row for row in scorecard["rows"]}
    print(f"smollm2: scorecard {[(c, {s: r.get(s) for s in scorecard['suites']}) for c, r in rows.items()]}")
    assert {"base", "sft", "grpo", "dpo", "dpo-int4-gptq"} <= set(rows), sorted(rows)
    assert rows["base"]["artifact"] == str(smoke[1]) and rows["sft"]["parent"] == "base"
    assert {c["parent"] for c in scorecard["changes"] if c["checkpoint"] == "sft"} == {"base"}
    assert scorecard["eval_config"]["gsm8k"]["max_calculations"] == 2
    assert list(scorecard["suites"]) == ["gsm8k", "math500", "pku_saferlhf", "hh_harmful", "benign"]
    for checkpoint, row in rows.items():
        for suite in scorecard["suites"]:
            assert row[f"{suite}_n"] == 1 and 0 <= row[suite] <= 1, (checkpoint, suite)
    # DPO's measures: the hh_harmful replies kept, and each checkpoint's judged by the run's reward model against its
    # parent's (dpo against grpo is item 4's win rate), with an interval around the win rate
    judged = {j["checkpoint"]: j for j in scorecard["judged"] if j["suite"] == "hh_harmful"}
    assert judged["dpo"]["parent"] == "grpo" and judged["dpo"]["n"] == 1, judged
    assert judged["dpo"]["judge"] == str(stage(run, "reward_model")[0])
    assert 0 <= judged["dpo"]["low"] <= judged["dpo"]["win_rate"] <= judged["dpo"]["high"] <= 1
    assert all(len(row["hh_harmful_replies"]) == len(row["benign_replies"]) == 1 for row in rows.values())
    assert "Judged against the parent" in (run / "scorecard.md").read_text()
    assert (run / "report.html").is_file()
    assert stage(run, "grpo")[1]["metrics"]["rollout_backend"] == "posttrain"


@trains_on_shared(DOLLY, "the Dolly rows")
def test_sft_on_dolly_and_gsm8k_solutions_moves_the_top_15_layers_only(smoke):
    """recipes/pipeline/smollm2.yaml's SFT: the top 15 of SmolLM2's 30 layers and the final norm train on the Dolly
    training rows plus the last GSM8K solutions (8 here), annotations stripped; the embeddings (tied to the LM head)
    and the lower 15 layers keep their weights. The startup check read the GSM8K rows against their card."""
    run, base_dir = smoke
    stage_dir, manifest = stage(run, "sft")
    assert manifest["stage"] == "sft" and not (stage_dir / "adapter").exists()
    metrics = manifest["metrics"]
    print(f"smollm2: sft losses {[round(h['loss'], 3) for h in metrics['log_history'] if 'loss' in h]}")
    assert metrics["global_step"] == 3
    assert 0 < metrics["assistant_token_fraction"] < 1
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    moved, names = changed(base_dir, stage_dir / "model")
    trained = [n for n in names if n == "model.norm.weight" or (n.startswith("model.layers.")
                                                                 and int(n.split(".")[2]) >= 15)]
    assert len(trained) == 15 * 9 + 1  # each layer: 7 projections and 2 norms
    assert sorted(moved) == sorted(trained), (sorted(set(trained) - set(moved))[:4],
                                              sorted(set(moved) - set(trained))[:4])

    # The data holds out the last HELD_OUT of the 49 Dolly rows (data.held_out; the recipe's 8): SFT trains on the
    # others and the GSM8K solutions, and measures the Dolly perplexity on the held-out rows before and after.
    train_record, held_record = manifest["datasets"]
    solutions = train_record["gsm8k_solutions"]
    assert train_record["rows"] == 49 - HELD_OUT and held_record["rows"] == HELD_OUT
    assert held_record["role"] == "perplexity"
    assert solutions["rows"] == 8 and "1 to 2 calculations" in solutions["id"]
    assert metrics["rows"] + metrics["rows_dropped_by_max_length"] == 49 - HELD_OUT + 8  # past max_length 256 drop
    assert [c["dataset"] for c in train_record["check"]] == ["databricks-dolly-15k", "gsm8k"]
    assert all(c["ok"] and c["overlap"]["gsm8k:test"]["exact"] == 0 for c in train_record["check"][1:])
    held = metrics["held_out_perplexity"]
    print(f"smollm2: sft held-out perplexity {held}")
    assert held["held_out_rows"] == HELD_OUT and 1 < held["parent"] < 100 and 1 < held["trained"] < 100
    assert held["parent"] != held["trained"]


@trains_on_shared(DOLLY, "the Dolly rows")
def test_int4_calibrates_on_training_rows_and_measures_perplexity_on_the_held_out_ones(smoke):
    """Quantize's calibration rows are SFT's training rows; its perplexity rows are the first quantize.eval_rows (2
    here) of the rows the data holds out (HELD_OUT here, 8 in the recipe), which SFT measured and did not train on.
    Before data.held_out, 7 of the 8 perplexity rows were among the 48 calibration rows, and SFT had trained on all
    8."""
    run, _ = smoke
    _, sft = stage(run, "sft")
    _, manifest = stage(run, "quantize-int4-gptq")
    calibration, held_out = manifest["datasets"]
    assert calibration["role"] == "calibration"
    assert calibration["content_sha256"] == sft["datasets"][0]["content_sha256"]
    rows, _ = load_dolly(str(DOLLY), None)
    assert held_out["rows"] == 2
    assert held_out["content_sha256"] == sha256_json([r["messages"] for r in rows[-HELD_OUT:][:2]])
    perplexity = manifest["metrics"]["perplexity"]
    print(f"smollm2: int4 held-out perplexity {perplexity}")
    assert perplexity["held_out_rows"] == 2 and math.isfinite(perplexity["change"])


@trains_on_shared(GSM8K, "the GSM8K rows")
def test_grpo_on_gsm8k_prompts_scores_completions_with_the_math_verifier(smoke):
    run, _ = smoke
    stage_dir, manifest = stage(run, "grpo")
    assert manifest["stage"] == "grpo" and manifest["metrics"]["global_step"] == 1
    rows = [json.loads(line) for line in (stage_dir / "completions.jsonl").read_text().splitlines()]
    assert rows and {r["step"] for r in rows} == {0}
    questions = {json.loads(line)["question"] for line in GSM8K.open()}
    assert len({r["prompt"] for r in rows}) == 2 and {r["prompt"] for r in rows} <= questions
    assert all(r["rewards"]["math_verifier"] in (0.0, 1.0) and r["completion"] for r in rows)
    print(f"smollm2: math_verifier rewards {[r['rewards']['math_verifier'] for r in rows]}; "
          f"first completion {rows[0]['completion'][:120]!r}")

    # A step was taken: the weights moved (zero-advantage steps leave them put, so only require any change when
    # some group had a spread of rewards), and only the LoRA targets (merged) moved.
    spread = any(abs(r["advantage"]) > 1e-6 for r in rows)
    moved, _ = changed(stage(run, "sft")[0] / "model", stage_dir / "model")
    assert bool(moved) == spread, (len(moved), spread)
    assert all(any(f".{t}." in k for t in LORA_TARGETS) for k in moved), moved[:4]


@trains_on_shared(HH, "the HH-RLHF pairs")
def test_lora_dpo_on_hh_rlhf_pairs_moves_the_adapters_and_reports_the_shift(smoke):
    """recipes/dpo/hh_rlhf.yaml on SmolLM2 (from the GRPO model, its reference): 2 training pairs (chosen = the less
    harmful reply) in one batch, 2 LoRA steps; the held-out pairs are the reward model's (2 here: the same file,
    n_eval and data seed), whole conversations that no stage trained on."""
    run, _ = smoke
    stage_dir, manifest = stage(run, "dpo")
    assert manifest["stage"] == "dpo" and manifest["lora"] is True and manifest["metrics"]["global_step"] == 2
    record = manifest["datasets"][0]
    assert record["card"] == "data_cards/hh-rlhf.md" and record["rows"] == 2 and record["held_out"] >= 2
    assert record["dropped_by_max_length"] == 0  # both prompts (231 and 196 tokens) fit max_length 256
    _, reward_model = stage(run, "reward_model")
    assert record["held_out"] == reward_model["datasets"][0]["held_out"]
    assert record["conversations"]["held_out"] == reward_model["datasets"][0]["conversations"]["held_out"]
    shift = manifest["metrics"]["likelihood_shift"]
    print(f"smollm2: likelihood shift {json.dumps(shift)}")
    assert shift["held_out_pairs"] == 1  # dpo.shift_pairs
    for key in ("chosen_logp_per_token", "rejected_logp_per_token"):
        assert math.isfinite(shift[key]["shift"]) and shift[key]["reference"] < 0
    losses = [h["loss"] for h in manifest["metrics"]["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # One batch holds both training pairs, so the second step's logged margin (policy vs reference, measured before
    # that step's update) shows what the first step's update did to the same pairs: 0 at step 1, then above 0.
    margins = [h["rewards/margins"] for h in manifest["metrics"]["log_history"] if "rewards/margins" in h]
    assert len(margins) == 2 and margins[0] == 0 and margins[1] > 0, margins

    # Merged adapters: the attention projections moved, nothing else did.
    moved, names = changed(stage(run, "grpo")[0] / "model", stage_dir / "model")
    adapted = [k for k in names if any(f".{t}." in k for t in LORA_TARGETS)]
    assert adapted and set(moved) == set(adapted), (sorted(set(adapted) ^ set(moved))[:4])


MATH500 = SHARED / "data" / "math500" / "math500_test.json"


@trains_on_shared(MATH500, "the MATH-500 problems")
def test_a_serving_context_too_short_for_an_eval_suite_fails_before_serving(smollm2):
    """Issue 8's run served MATH-500 with serve.max_len=512 after an hour of training, and failed on a prompt: the
    longest of the 500 problems renders to 400+ tokens through SmolLM2's template. Now eval checks every suite
    against the served context first, naming the suite."""
    from types import SimpleNamespace

    from posttrain.config_schema import ServeCfg
    from posttrain.evaluation.scorecard import check_context
    from posttrain.evaluation.suites import build_suite

    _, location = smollm2
    suite = build_suite("math500", 500, 0, path=str(MATH500), max_new_tokens=192)
    eval_cfg = SimpleNamespace(max_new_tokens=None)
    with pytest.raises(ValueError, match=r"eval suite math500: its longest prompt is \d{3} tokens and replies may "
                                         r"take 192 \(max_new_tokens\), over the served context of 512"):
        check_context([suite], location, eval_cfg, ServeCfg(max_len=512))
    check_context([suite], location, eval_cfg, ServeCfg(max_len=2048))  # the smollm2 recipe's context: fits
