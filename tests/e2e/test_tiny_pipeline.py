"""The tiny pipeline end to end (fewer steps than `make demo`): every artifact, the scorecard, skip on rerun."""

from __future__ import annotations

import importlib.util
import json

import pytest
from safetensors.torch import load_file

from posttrain.artifacts import manifest_sha256, verify_artifact
from posttrain.data.tiny_world import eval_rows
from posttrain.serve.gguf_check import greedy_agreement
from tests.helpers import posttrain

pytestmark = pytest.mark.slow
MANIFEST_KEYS = {"stage", "parent", "config", "config_hash", "datasets", "metrics", "weights", "packages",
                 "git_revision", "started_at", "finished_at"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    result = posttrain("run", "pipeline=tiny-ci", f"run.root={root}", "run.name=ci")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "ci", result


STAGES = ("00-pretrain", "01-sft", "02-reward_model", "03-grpo", "04-dpo")


def test_every_stage_wrote_a_complete_manifest(tiny_run):
    run_dir, _ = tiny_run
    pretrain, sft = run_dir / "00-pretrain", run_dir / "01-sft"
    for stage_dir in (run_dir / d for d in STAGES):
        stage = stage_dir.name[3:]
        manifest = verify_artifact(stage_dir)
        assert MANIFEST_KEYS <= set(manifest)
        assert manifest["stage"] == stage
        assert manifest["datasets"] and manifest["datasets"][0]["content_sha256"]
        checks = manifest["datasets"][0]["check"]  # the start-up data check against the card
        assert checks and all(c["ok"] and c["tokens"]["max"] > 0 for c in checks), checks
        assert all(o["exact"] == 0 for c in checks for o in c["overlap"].values())
        assert manifest["metrics"]["global_step"] == manifest["config"][stage]["trainer"]["max_steps"]
        assert not (stage_dir / "checkpoints").exists()
    assert json.loads((pretrain / "manifest.json").read_text())["parent"] is None
    sft_manifest = json.loads((sft / "manifest.json").read_text())
    assert sft_manifest["parent"]["manifest_sha256"] == manifest_sha256(pretrain)
    assert 0 < sft_manifest["metrics"]["assistant_token_fraction"] < 1


def test_grpo_trains_on_the_sft_model_with_the_reward_model_as_input(tiny_run):
    run_dir, _ = tiny_run
    grpo = json.loads((run_dir / "03-grpo" / "manifest.json").read_text())
    assert grpo["parent"]["manifest_sha256"] == manifest_sha256(run_dir / "01-sft")  # not the reward model
    assert grpo["reward_model"] == str(run_dir / "02-reward_model")
    rm = json.loads((run_dir / "02-reward_model" / "manifest.json").read_text())
    assert rm["metrics"]["held_out_pairs"] == 40 and 0 <= rm["metrics"]["pairwise_accuracy"] <= 1
    assert set(rm["metrics"]["pairwise_accuracy_by_family"]) == {"echo", "arith", "qa"}


def test_grpo_logged_every_completion_with_each_reward(tiny_run):
    run_dir, _ = tiny_run
    rows = [json.loads(line) for line in (run_dir / "03-grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 16  # 4 steps x 16 completions
    assert {r["step"] for r in rows} == {0, 1, 2, 3}
    for r in rows:
        assert set(r["rewards"]) == {"math_verifier", "think_format", "reward_model"}
        assert r["rewards"]["math_verifier"] in (0.0, 1.0) and r["rewards"]["think_format"] in (0.0, 1.0)
        expected = r["rewards"]["math_verifier"] + 0.1 * r["rewards"]["think_format"] + 0.1 * r["rewards"]["reward_model"]
        assert abs(r["reward"] - expected) < 1e-6
    curve = json.loads((run_dir / "03-grpo" / "manifest.json").read_text())["metrics"]["reward_curve"]
    assert [c["step"] for c in curve] == [2, 4]
    assert all("rewards/math_verifier/mean" in c for c in curve)
    seconds = json.loads((run_dir / "03-grpo" / "manifest.json").read_text())["metrics"]["step_seconds"]
    assert set(seconds) == {"generation", "scoring", "update_and_rest"}
    assert seconds["generation"] > 0 and seconds["scoring"] > 0 and seconds["update_and_rest"] > 0


def test_grpo_made_high_advantage_completions_more_likely(tiny_run):
    """The policy-gradient effect itself: completions of the first batch that got a positive advantage gained
    log-probability relative to those that got a negative one, between the SFT and the GRPO weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = tiny_run
    rows = [json.loads(line) for line in (run_dir / "03-grpo" / "completions.jsonl").read_text().splitlines()]
    first = [r for r in rows if r["step"] == 0 and abs(r["advantage"]) > 1e-3]
    assert any(r["advantage"] > 0 for r in first) and any(r["advantage"] < 0 for r in first)
    tok = AutoTokenizer.from_pretrained(run_dir / "01-sft" / "model")

    def logprob(model, row):
        prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tok(row["completion"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p_ids) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(c_ids)[:, None]).sum().item()

    sft = AutoModelForCausalLM.from_pretrained(run_dir / "01-sft" / "model").eval()
    grpo = AutoModelForCausalLM.from_pretrained(run_dir / "03-grpo" / "model").eval()
    delta = {id(r): logprob(grpo, r) - logprob(sft, r) for r in first}
    up = [delta[id(r)] for r in first if r["advantage"] > 0]
    down = [delta[id(r)] for r in first if r["advantage"] < 0]
    assert sum(up) / len(up) > sum(down) / len(down), (up, down)


def test_dpo_trains_on_grpo_against_it_and_reports_the_likelihood_shift(tiny_run):
    """DPO's parent (and reference) is the GRPO model; its weights moved, and on held-out pairs the implicit reward
    favours the chosen replies: chosen log-probability rose relative to rejected, measured against the parent."""
    import torch

    run_dir, _ = tiny_run
    dpo = json.loads((run_dir / "04-dpo" / "manifest.json").read_text())
    assert dpo["parent"]["manifest_sha256"] == manifest_sha256(run_dir / "03-grpo")
    assert dpo["reference"] == str(run_dir / "03-grpo" / "model") and dpo["lora"] is False
    assert dpo["datasets"][0]["id"] == "tiny_world/safety_pairs"
    grpo_w = load_file(run_dir / "03-grpo/model/model.safetensors")
    dpo_w = load_file(run_dir / "04-dpo/model/model.safetensors")
    assert sum(not torch.equal(grpo_w[k], dpo_w[k]) for k in grpo_w) == len(grpo_w)
    shift = dpo["metrics"]["likelihood_shift"]
    assert shift["held_out_pairs"] == 40 and shift["beta"] == 0.3
    assert shift["chosen_logp_per_token"]["shift"] > shift["rejected_logp_per_token"]["shift"], shift
    assert shift["implicit_reward_margin"] > 0 and shift["implicit_reward_accuracy"] > 0.5, shift
    assert set(shift["implicit_reward_accuracy_by_kind"]) == {"harmful/repeat", "harmful/ask", "benign/repeat",
                                                              "benign/ask"}


def test_scorecard_has_a_row_per_generator_with_every_suite(tiny_run):
    run_dir, result = tiny_run
    card = json.loads((run_dir / "scorecard.json").read_text())
    assert [r["checkpoint"] for r in card["rows"]] == ["base", "sft", "grpo", "dpo", "dpo-int8", "dpo-int4-gptq",
                                                       "dpo-gguf-q4_k_m"]
    assert set(card["likelihood_shift"]) == {"dpo"}
    for row in card["rows"]:
        assert 0.0 <= row["echo"] <= 1.0 and row["echo_n"] == 20 and row["size_mb"] > 0
        assert len(row["echo_examples"]) == 3
        assert 0.0 <= row["arith"] <= 1.0 and row["arith_n"] == 20
        assert 0.0 <= row["arith_pass@1"] <= 1.0 and row["arith_samples"] == 2
        assert 0.0 <= row["safety"] <= 1.0 and row["safety_n"] == 20
        assert 0.0 <= row["over_refusal"] <= 1.0 and row["over_refusal_n"] == 20
    markdown = (run_dir / "scorecard.md").read_text()
    assert all(f"| {label} |" in markdown for label in ("base", "sft", "grpo", "dpo", "dpo-int8", "dpo-int4-gptq"))
    assert "| dpo-int4-gptq | int4 g128 gptq |" in markdown  # the quantization table
    assert "Likelihood shift of dpo against its reference: chosen log-prob/token" in markdown
    assert "Base model: built by the pretrain stage (source tiny" in markdown  # the header names the weights
    assert card["base_model"]["files"] and card["base_model"]["root_stage"] == "pretrain"
    header = ("| checkpoint | echo [95% CI] (n) | arith greedy [95% CI] (n) | arith pass@1 [95% CI] (k=2, T=1.0) "
              "| safe replies [95% CI] (n) | benign answered [95% CI] (n) | size MB | TTFT ms | decode tok/s |")
    assert header in result.stdout  # printed at the end of the run
    # every row with an n has its interval, around its score; every child has its paired change against its parent
    for row in card["rows"]:
        for key in ("echo", "arith", "arith_pass@1", "safety", "over_refusal"):
            low, high = row[f"{key}_ci"]
            assert 0.0 <= low <= row[key] <= high <= 1.0
    pairs = {(c["checkpoint"], c["parent"]) for c in card["changes"]}
    assert {("sft", "base"), ("grpo", "sft"), ("dpo", "grpo"), ("dpo-int8", "dpo")} <= pairs
    assert "## Changes against the parent checkpoint" in markdown


def test_every_row_was_measured_through_the_server_and_the_report_has_its_plots(tiny_run):
    run_dir, result = tiny_run
    card = json.loads((run_dir / "scorecard.json").read_text())
    assert card["backend"] == "posttrain"
    for row in card["rows"]:
        latency = row["latency"]
        assert latency["ttft_ms"] > 0 and latency["requests"] == 8
        # the base model of this short run may stream only tokens that decode to no text until its last chunk,
        # which leaves no interval to time; every trained checkpoint writes text
        assert latency["decode_tok_s"] > 0 or (row["checkpoint"] == "base" and latency["decode_tok_s"] is None)
    page = (run_dir / "report.html").read_text()
    # scorecard bars, quantization, latency, and a curve per training stage plus GRPO rewards and DPO log-probs
    assert page.count("data:image/png;base64,") >= 3 + 5 + 2
    assert f"report: {run_dir / 'report.html'}" in result.stdout


def test_quantized_copies_of_dpo_are_smaller_and_close(tiny_run):
    """Both quantize stages read dpo (not each other), shrink it, and keep held-out perplexity within 5%."""
    run_dir, _ = tiny_run
    for stage_dir, fmt, method in ((run_dir / "05-quantize-int8", "int8", "rtn"),
                                   (run_dir / "06-quantize-int4-gptq", "int4", "gptq")):
        manifest = verify_artifact(stage_dir)
        metrics = manifest["metrics"]
        assert manifest["parent"]["manifest_sha256"] == manifest_sha256(run_dir / "04-dpo")
        assert (metrics["fmt"], metrics["method"]) == (fmt, method)
        assert metrics["size_bytes"] < 0.5 * metrics["parent_size_bytes"]
        assert abs(metrics["perplexity"]["change"]) < 0.05
        assert len(metrics["layer_errors"]) == 4 * 7 and 0 < metrics["mean_of_spread"] < 0.3
        assert {"int8", "int4 g128", "int4 g32", "fp8"} <= set(metrics["format_errors"])
        config = json.loads((stage_dir / "model" / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    gptq = json.loads((run_dir / "06-quantize-int4-gptq" / "manifest.json").read_text())["metrics"]
    assert gptq["calibration"]["sequences"] > 10 and gptq["group_size"] == 128


def test_sft_changed_weights_and_lowered_heldout_echo_loss(tiny_run):
    """Weights moved, and the held-out echo answers became more likely (teacher-forced NLL on assistant tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.chat.render import tokenize_with_assistant_mask
    from posttrain.data.tiny_world import make_echo, take_split

    run_dir, _ = tiny_run
    base_w = load_file(run_dir / "00-pretrain/model/model.safetensors")
    sft_w = load_file(run_dir / "01-sft/model/model.safetensors")
    assert set(base_w) == set(sft_w)
    assert sum(not torch.equal(base_w[k], sft_w[k]) for k in base_w) == len(base_w)

    rows = take_split(make_echo, 40, "test", 0, "echo")

    def heldout_nll(stage_dir):
        model = AutoModelForCausalLM.from_pretrained(stage_dir / "model").eval()
        tok = AutoTokenizer.from_pretrained(stage_dir / "model")
        total, count = 0.0, 0
        for row in rows:
            enc = tokenize_with_assistant_mask(tok, row["messages"])
            ids = torch.tensor([enc["input_ids"]])
            labels = torch.where(torch.tensor([enc["assistant_masks"]]) == 1, ids, -100)
            with torch.no_grad():
                loss = model(input_ids=ids, labels=labels).loss
            n = int((labels[0, 1:] != -100).sum())
            total, count = total + loss.item() * n, count + n
        return total / count

    base_nll, sft_nll = heldout_nll(run_dir / "00-pretrain"), heldout_nll(run_dir / "01-sft")
    assert sft_nll < base_nll - 0.3, (base_nll, sft_nll)


def test_rerun_skips_finished_stages(tiny_run):
    run_dir, _ = tiny_run
    before = {d: json.loads((run_dir / d / "manifest.json").read_text())["finished_at"] for d in STAGES}
    # evaluate=false: the stages' config hashes leave out pipeline.evaluate, so this checks the skip without
    # scoring every checkpoint again (test_eval_rescores_... covers eval on a finished run)
    result = posttrain("run", "pipeline=tiny-ci", f"run.root={run_dir.parent}", "run.name=ci", "pipeline.evaluate=false")
    assert result.returncode == 0, result.stderr[-3000:]
    for stage in ("pretrain", "sft", "reward_model", "grpo", "dpo", "quantize:int8", "quantize:int4-gptq",
                  "quantize:gguf-q4_k_m"):
        assert f"{stage}: up to date" in result.stderr
    after = {d: json.loads((run_dir / d / "manifest.json").read_text())["finished_at"] for d in before}
    assert before == after


def test_eval_rescores_chosen_checkpoints_without_retraining(tiny_run):
    """`posttrain eval` on a finished run: only the named checkpoints, the same greedy scores, no stage reruns; the
    scorecard keeps the other checkpoints' rows (the same eval config and seed; tests/unit/test_eval_earlier_rows.py
    has the cases that replace them)."""
    run_dir, _ = tiny_run
    before = json.loads((run_dir / "scorecard.json").read_text())
    manifests = {d: (run_dir / d / "manifest.json").read_text() for d in STAGES}
    # no pipeline=tiny-ci: eval rescores with the eval config the run recorded (the same suites and prompt counts
    # as its scorecard), and any eval.<key> overrides on top
    result = posttrain("eval", f"run.root={run_dir.parent}", "run.name=ci", "eval.checkpoints=[dpo,dpo-int8]")
    assert "the run's recorded eval config" in result.stderr
    assert result.returncode == 0, result.stderr[-3000:]
    after = json.loads((run_dir / "scorecard.json").read_text())
    labels = [r["checkpoint"] for r in before["rows"]]
    assert [r["checkpoint"] for r in after["rows"]] == labels
    kept = [label for label in labels if label not in ("dpo", "dpo-int8")]
    assert f"keeping the last scorecard's rows of {', '.join(kept)} " in result.stderr
    assert [(c["checkpoint"], c["key"]) for c in after["changes"]] == [(c["checkpoint"], c["key"])
                                                                       for c in before["changes"]]
    old = {r["checkpoint"]: r for r in before["rows"]}
    for row in after["rows"]:  # greedy replies: the same, up to one prompt of 20 whose reply a different batch
        # composition (fp32 rounding of other batch shapes) could flip
        for suite in ("echo", "arith", "safety", "over_refusal"):
            assert abs(row[suite] - old[row["checkpoint"]][suite]) <= 1 / 20 + 1e-9, (row["checkpoint"], suite)
            assert row[f"{suite}_n"] == old[row["checkpoint"]][f"{suite}_n"] == 20, (row["checkpoint"], suite)
    assert manifests == {d: (run_dir / d / "manifest.json").read_text() for d in STAGES}
    assert "running" not in result.stderr  # no stage ran
    bad = posttrain("eval", f"run.root={run_dir.parent}", "run.name=ci", "eval.checkpoints=[nonesuch]")
    assert bad.returncode == 2 and "nonesuch" in bad.stderr and "dpo-int8" in bad.stderr


def test_planner_counts_every_generator_checkpoint_exactly(tiny_run):
    """Issue 7: from each checkpoint's config.json alone, the planner gives the loaded model's exact parameter count
    and the KV bytes per token the engine's cache allocates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.integration.test_planner_models import check_against

    run_dir, _ = tiny_run
    for stage in ("00-pretrain", "01-sft", "03-grpo", "04-dpo"):
        model_dir = run_dir / stage / "model"
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        check_against(model, AutoTokenizer.from_pretrained(model_dir), model_dir)


def test_gguf_copy_of_dpo_carries_its_template_and_loads_back(tiny_run):
    """quantize:gguf-q4_k_m writes one GGUF file llama.cpp's Q4_K_M mix, with the chat template; transformers' loader
    reads it back with held-out perplexity close to dpo's."""
    import gguf

    run_dir, _ = tiny_run
    stage_dir = run_dir / "07-quantize-gguf-q4_k_m"
    manifest = verify_artifact(stage_dir)
    metrics = manifest["metrics"]
    assert manifest["parent"]["manifest_sha256"] == manifest_sha256(run_dir / "04-dpo")
    assert (metrics["fmt"], metrics["gguf_type"]) == ("gguf", "q4_k_m")
    assert set(metrics["block_types"]) == {"Q4_K", "Q6_K"}  # the tiny model's rows of 256 and 768 fit Q4_K's blocks
    assert metrics["size_bytes"] < 0.5 * metrics["parent_size_bytes"]
    assert abs(metrics["perplexity"]["change"]) < 0.05 and 0 < metrics["mean_of_spread"] < 0.2
    fields = gguf.GGUFReader(stage_dir / "model" / "model.gguf").fields
    template = (stage_dir / "model" / "chat_template.jinja").read_text()
    assert fields["tokenizer.chat_template"].contents() == template


needs_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                    reason="needs llama-cpp-python: run `make llamacpp` (about 7 to 15 minutes)")


@needs_llamacpp
def test_llamacpp_replies_as_our_engine_on_the_gguf_weights(tiny_run):
    run_dir, _ = tiny_run
    model_dir = run_dir / "07-quantize-gguf-q4_k_m" / "model"
    prompts = [r["messages"] for r in eval_rows("arith", 5, 0) + eval_rows("echo", 5, 0)]
    records = greedy_agreement(model_dir / "model.gguf", model_dir, prompts)
    assert all(r["prompt_ids_equal"] for r in records)
    assert sum(r["agree"] for r in records) >= 9, [(r["posttrain"], r["llamacpp"]) for r in records]


@needs_llamacpp
def test_eval_scores_the_gguf_copy_through_llamacpp_beside_dpo_through_ours(tiny_run):
    """serve.backend=llamacpp: the GGUF checkpoint through llama.cpp's server, the others through ours (last in
    this file: it rescores these two rows of the scorecard)."""
    run_dir, _ = tiny_run
    result = posttrain("eval", "pipeline=tiny-ci", f"run.root={run_dir.parent}", "run.name=ci", "serve.backend=llamacpp",
                       "eval.checkpoints=[dpo,dpo-gguf-q4_k_m]", "eval.latency.requests=2")
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.loads((run_dir / "scorecard.json").read_text())
    rows = {r["checkpoint"]: r for r in card["rows"]}
    assert (rows["dpo"]["backend"], rows["dpo-gguf-q4_k_m"]["backend"]) == ("posttrain", "llamacpp")
    # llama.cpp's server takes no ignore_eos: a reply that ends after one token leaves no decode interval to time
    assert rows["dpo"]["latency"]["decode_tok_s"] > 0
    for row in rows.values():
        assert row["latency"]["ttft_ms"] > 0
        assert row["arith_samples"] > 1 and 0 <= row["arith_pass@1"] <= 1  # n choices: one request each on llama.cpp
    assert abs(rows["dpo-gguf-q4_k_m"]["echo"] - rows["dpo"]["echo"]) <= 0.15
    assert "| server |" in (run_dir / "scorecard.md").read_text()
