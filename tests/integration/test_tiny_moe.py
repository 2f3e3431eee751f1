"""`posttrain run pipeline=tiny-moe`: the tiny Qwen3-MoE through pretrain -> sft -> reward_model -> grpo -> dpo with
the router's load-balancing loss on and every expert's token share logged at each logging step; no expert starves;
the capacity planner and the serving engine handle the checkpoints.

    .venv/bin/python -m pytest -q tests/integration/test_tiny_moe.py    # about 1 min on 2 idle cores
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.artifacts import verify_artifact
from tests.helpers import posttrain

pytestmark = pytest.mark.slow
STAGES = ("00-pretrain", "01-sft", "02-reward_model", "03-grpo", "04-dpo")
GENERATORS = ("00-pretrain", "01-sft", "03-grpo", "04-dpo")  # each trains from the one before
EXPERTS, TOP_K, LAYERS = 4, 2, 4  # recipes/model/tiny-moe.yaml
STARVING = 0.25  # an expert starves below a quarter of its fair share (1 / EXPERTS) of a window's assignments


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    result = posttrain("run", "pipeline=tiny-moe", f"run.root={root}", "run.name=moe")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "moe"


def manifest(run_dir, stage: str) -> dict:
    return json.loads((run_dir / stage / "manifest.json").read_text())


def test_every_stage_finished_on_the_moe_model(moe_run):
    for stage_dir in (moe_run / s for s in STAGES):
        m = verify_artifact(stage_dir)
        stage = stage_dir.name[3:]
        assert m["metrics"]["global_step"] == m["config"][stage]["trainer"]["max_steps"]
        assert m["config"]["model"]["arch"]["num_experts"] == EXPERTS
        config = json.loads((stage_dir / "model" / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == TOP_K
        assert config["output_router_logits"] is False  # the saved model generates with a KV cache
    grpo = manifest(moe_run, "03-grpo")
    assert grpo["reward_model"] == str(moe_run / "02-reward_model")


@pytest.mark.parametrize("stage", STAGES)
def test_expert_shares_at_every_logging_step_with_the_balance_loss_trained(moe_run, stage):
    m = manifest(moe_run, stage)
    trainer_cfg = m["config"][stage[3:]]["trainer"]
    logged = [h for h in m["metrics"]["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == list(range(trainer_cfg["logging_steps"], trainer_cfg["max_steps"] + 1,
                                                     trainer_cfg["logging_steps"]))
    for h in logged:
        # TRL logs aux_loss where it adds router_aux_loss_coef x aux_loss to the loss it optimises; RewardTrainer's
        # sequence-classification loss has no balance term
        if stage == "02-reward_model":
            assert "aux_loss" not in h
        else:
            assert h["aux_loss"] >= TOP_K - 1e-3  # the balance loss's minimum is top_k
        for layer in range(LAYERS):
            shares = [h[f"expert_share/layer{layer}/expert{e}"] for e in range(EXPERTS)]
            assert sum(shares) == pytest.approx(1.0)
        assert h["expert_share/min_ratio"] == pytest.approx(h["expert_share/min"] * EXPERTS)
    last = m["metrics"]["expert_share_last_window"]
    assert m["metrics"]["min_expert_share_ratio"] == pytest.approx(logged[-1]["expert_share/min_ratio"])
    assert [last[f"layer{layer}"] for layer in range(LAYERS)] == [
        [logged[-1][f"expert_share/layer{layer}/expert{e}"] for e in range(EXPERTS)] for layer in range(LAYERS)]


@pytest.mark.parametrize("stage", ["01-sft", "03-grpo", "04-dpo"])
def test_no_expert_starves_in_the_last_logging_window(moe_run, stage):
    last = manifest(moe_run, stage)["metrics"]["expert_share_last_window"]
    for layer, shares in last.items():
        assert min(shares) >= STARVING / EXPERTS, (stage, layer, shares)


def test_every_weight_and_every_expert_trained_in_every_stage(moe_run):
    for before, after in zip(GENERATORS, GENERATORS[1:]):
        w0, w1 = (load_file(moe_run / s / "model" / "model.safetensors") for s in (before, after))
        assert set(w0) == set(w1)
        unchanged = [k for k in w0 if torch.equal(w0[k], w1[k])]
        assert not unchanged, (after, unchanged)
        experts = {k for k in w0 if ".mlp.experts." in k}
        assert len(experts) == LAYERS * EXPERTS * 3  # gate, up, down per expert, each of them moved


def test_planner_total_and_active_parameters_match_the_checkpoint(moe_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.integration.test_planner_models import engine_kv_bytes_per_token

    model_dir = moe_run / "04-dpo" / "model"
    result = posttrain("plan", str(model_dir), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    params = plan["params"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert params["total"] == sum(p.numel() for p in model.parameters())
    assert params["routed_experts"] == experts and params["active_routed_experts"] == experts * TOP_K // EXPERTS
    assert params["active"] == params["total"] - experts + experts * TOP_K // EXPERTS < params["total"]
    assert plan["arch"]["moe"] == {"experts": EXPERTS, "top_k": TOP_K, "expert_intermediate": 384,
                                   "shared_intermediate": 0, "shared_gate": False}
    # the KV cache per token the planner gives is what the engine allocates (float32 cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from posttrain.planner import load_config, plan_model

    assert plan_model(load_config(model_dir), kv_dtype="fp32").kv.bytes_per_token == engine_kv_bytes_per_token(
        model, tokenizer, torch.float32)


def test_engine_greedy_tokens_equal_transformers_generate(moe_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.serve.engine import SamplingParams, load_engine

    model_dir = moe_run / "04-dpo" / "model"
    engine = load_engine(model_dir)
    assert engine.model.model.layers[0].mlp.__class__.__name__ == "MoE"
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["Return the following message <start> blue river stone <end>", "What is 17 times 24?",
               "Repeat after me: the moon is made of cheese."]
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        ours = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=0, do_sample=False, eos_token_id=None)
        assert ours == out[0, len(ids):].tolist(), prompt
