"""SmolLM2-135M-Instruct as the pipeline uses it: the whole `pipeline=smollm2` chain cut to a few steps a stage,
eval's check of the served context, and the memory of serving one checkpoint after another in one process.

    .venv/bin/python -m pytest -q -s tests/integration/test_smollm2_pipeline.py    # -s prints the measured figures
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.integration.test_smollm2 import GSM8K, REPO, SHARED, THREADS, needs_smollm2, smollm2, trains_on_shared

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
@trains_on_shared(GSM8K, "the GSM8K, MATH-500, Dolly and PKU-SafeRLHF rows")
def test_smollm2_pipeline_runs_every_stage_and_scores_every_checkpoint(tmp_path):
    """`posttrain run pipeline=smollm2` (recipes/pipeline/smollm2.yaml) with its step counts cut to one or two per
    stage and two prompts per eval suite: every stage of the real-model chain runs on SmolLM2's tokenizer, chat
    template and shapes (GRPO's roll-outs on the engine, int4 on 576-wide layers, MATH-500 prompts of 400+ tokens
    through the server), and the scorecard has each checkpoint on each suite."""
    command = [sys.executable, "-m", "posttrain.cli", "run", "pipeline=smollm2", f"run.root={tmp_path}",
               "run.name=smoke", "sft.trainer.max_steps=2", "sft.trainer.save_steps=2",
               "reward_model.trainer.max_steps=2", "reward_model.trainer.save_steps=2",
               "grpo.trainer.max_steps=1", "grpo.trainer.save_steps=1", "grpo.prompts.n=2",
               "grpo.trainer.per_device_train_batch_size=8", "grpo.trainer.max_completion_length=32",
               "dpo.trainer.max_steps=2", "dpo.trainer.save_steps=2", "quantize.calibration_rows=8",
               "quantize.eval_rows=2", "eval.n_prompts={gsm8k: 2, math500: 2, pku_saferlhf: 2}",
               "eval.gsm8k.max_new_tokens=24", "eval.math500.max_new_tokens=24", "eval.latency.requests=1",
               "eval.latency.max_tokens=8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(THREADS)}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(f"smollm2: the cut-down pipeline took {time.perf_counter() - started:.0f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "smoke"
    scorecard = json.loads((run / "scorecard.json").read_text())
    rows = {row["checkpoint"]: row for row in scorecard["rows"]}
    print(f"smollm2: scorecard {[(c, {s: r.get(s) for s in scorecard['suites']}) for c, r in rows.items()]}")
    assert {"sft", "grpo", "dpo", "dpo-int4-gptq"} <= set(rows), sorted(rows)
    assert list(scorecard["suites"]) == ["gsm8k", "math500", "pku_saferlhf"]
    for checkpoint, row in rows.items():
        for suite in scorecard["suites"]:
            assert row[f"{suite}_n"] == 2 and 0 <= row[suite] <= 1, (checkpoint, suite)
    assert (run / "report.html").is_file()
    grpo = json.loads(next(run.glob("*-grpo/manifest.json")).read_text())
    assert grpo["metrics"]["rollout_backend"] == "posttrain"


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
