"""A killed stage resumes from its last checkpoint; bad input fails clearly and leaves no finished artifact; SFT's
partial training (train_top_layers) moves only what it names."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from posttrain.artifacts import verify_artifact
from tests.helpers import popen, posttrain

pytestmark = pytest.mark.slow
CI = ("pipeline=tiny-ci", "pretrain.trainer.max_steps=4", "pretrain.trainer.save_steps=2")


def test_sigkill_during_sft_then_rerun_resumes_from_last_checkpoint(tmp_path):
    args = (*CI, f"run.root={tmp_path}", "run.name=k", "sft.trainer.max_steps=30", "sft.trainer.save_steps=4",
            "pipeline.stages=[pretrain,sft]", "pipeline.evaluate=false")
    ckpt_root = tmp_path / "k" / "01-sft" / "checkpoints"
    proc = popen("run", *args, log=tmp_path / "first.log")
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = [p for p in ckpt_root.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
            if done:
                time.sleep(0.5)  # let the checkpoint finish its last file
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed:\n" + (tmp_path / "first.log").read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    sft_dir = tmp_path / "k" / "01-sft"
    assert not (sft_dir / "manifest.json").exists(), "a killed stage must not look finished"
    complete = [p for p in ckpt_root.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    steps_at_kill = max(int(p.name.split("-")[1]) for p in complete)
    pretrain_finished = json.loads((tmp_path / "k" / "00-pretrain" / "manifest.json").read_text())["finished_at"]

    result = posttrain("run", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pretrain: up to date" in result.stderr
    assert "sft: resuming from" in result.stderr
    manifest = verify_artifact(sft_dir)
    resumed = int(manifest["resumed_from"].rsplit("-", 1)[1])
    assert resumed == steps_at_kill  # the newest complete checkpoint left by the killed run
    assert manifest["metrics"]["global_step"] == 30
    assert json.loads((tmp_path / "k" / "00-pretrain" / "manifest.json").read_text())["finished_at"] == pretrain_finished

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_dir / "model")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    result = posttrain("stage=pretrain", *CI[1:], f"run.root={root}", "run.name=b", "data.pretrain_rows=200")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "b" / "00-pretrain"


def test_tampered_parent_weights_are_named_and_nothing_is_finished(pretrained, tmp_path):
    import shutil

    parent = tmp_path / "00-pretrain"
    shutil.copytree(pretrained, parent)
    weights = parent / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = posttrain("stage=sft", f"parent={parent}", f"run.root={tmp_path}", "run.name=t", "sft.trainer.max_steps=2")
    assert result.returncode == 2
    assert f"{weights}: sha256" in result.stderr and "does not match" in result.stderr
    assert not list(tmp_path.glob("t/*/manifest.json"))


def test_bad_dataset_row_is_named_and_nothing_is_finished(pretrained, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [{"instruction": "Say hi", "context": "", "response": "hi", "category": "open_qa"}] * 3
    rows.append({"instruction": "Say hi", "context": "", "response": 42, "category": "open_qa"})
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    result = posttrain("stage=sft", f"parent={pretrained}", "data=dolly", f"data.path={bad}", f"run.root={tmp_path}",
                       "run.name=d", "sft.trainer.max_steps=2")
    assert result.returncode == 2
    assert f"{bad}: row 4: field 'response' must be a string, got int" in result.stderr
    assert not list(tmp_path.glob("d/*/manifest.json"))


def test_sft_train_top_layers_moves_only_the_top_layers_and_refuses_lora_beside_it(pretrained, tmp_path):
    import torch
    from safetensors.torch import load_file

    result = posttrain("stage=sft", f"parent={pretrained}", f"run.root={tmp_path}", "run.name=top",
                       "sft.trainer.max_steps=3", "sft.train_top_layers=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sft: training the top 1 of 4 decoder layers" in result.stderr
    before = load_file(pretrained / "model" / "model.safetensors")
    after = load_file(tmp_path / "top" / "01-sft" / "model" / "model.safetensors")
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all(name.startswith(("model.layers.3.", "model.norm.", "lm_head.")) for name in moved), moved
    assert any(name.startswith("model.layers.3.") for name in moved)
    metrics = verify_artifact(tmp_path / "top" / "01-sft")["metrics"]
    assert metrics["global_step"] == 3

    both = posttrain("stage=sft", f"parent={pretrained}", f"run.root={tmp_path}", "run.name=both", "sft=lora",
                     "sft.train_top_layers=1")
    assert both.returncode == 2
    assert "posttrain: error: sft.train_top_layers and sft.lora / sft.qlora are two ways to train part of the model" \
        in both.stderr
    assert not (tmp_path / "both").exists()


def test_eval_prompts_in_training_data_stop_the_stage_at_its_data_check(pretrained, tmp_path):
    from tests.conftest import shared_path

    gsm8k = shared_path("data", "gsm8k")
    train = (gsm8k / "train.jsonl").read_text().splitlines()[:6]
    leaked = json.loads((gsm8k / "test.jsonl").read_text().splitlines()[7])
    leaked["question"] = "  " + leaked["question"].lower()  # the same prompt after normalisation
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(train[:3] + [json.dumps(leaked)] + train[3:]) + "\n")
    result = posttrain("stage=grpo", f"parent={pretrained}", "grpo=gsm8k", f"grpo.prompts.path={prompts}",
                       "grpo.trainer.max_steps=1", f"run.root={tmp_path}", "run.name=g")
    assert result.returncode == 2
    assert f"grpo: {prompts} breaks its data card (gsm8k)" in result.stderr
    assert "1 prompts are eval prompts of gsm8k:test (after normalisation) (rows 4)" in result.stderr
    assert "data check" in result.stderr and "rows      7, a sample of the 7,473-row train split" in result.stderr
    assert not list(tmp_path.glob("g/*/manifest.json"))


def test_misspelled_recipe_key_fails_before_anything_is_written(tmp_path):
    result = posttrain("run", "pipeline=tiny-ci", f"run.root={tmp_path}", "run.name=m", "+sft.trainer.learnin_rate=1")
    assert result.returncode == 2
    assert "sft.trainer.learnin_rate" in result.stderr and "learning_rate" in result.stderr
    assert not (tmp_path / "m").exists()


def test_wandb_offline_run_files_land_in_the_run_directory(tmp_path):
    result = posttrain("stage=pretrain", *CI[1:], "pretrain.trainer.max_steps=2", "data.pretrain_rows=100",
                       "tracking=wandb", f"run.root={tmp_path}", "run.name=w", WANDB_API_KEY="", WANDB_MODE="")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "w").rglob("*"))[:20]
    assert list(runs[0].glob("*.wandb"))


def test_grpo_with_wandb_logs_the_completions_table_offline(pretrained, tmp_path):
    result = posttrain("stage=grpo", f"parent={pretrained}", "tracking=wandb", f"run.root={tmp_path}", "run.name=g",
                       "grpo.prompts.n=8", "grpo.trainer.max_steps=1", "grpo.trainer.per_device_train_batch_size=8",
                       "grpo.trainer.num_generations=4", "grpo.trainer.max_completion_length=8",
                       WANDB_API_KEY="", WANDB_MODE="")
    assert result.returncode == 0, result.stderr[-3000:]
    stage_dir = tmp_path / "g" / "01-grpo"
    rows = [json.loads(line) for line in (stage_dir / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(set(r["rewards"]) == {"math_verifier"} for r in rows)  # the tiny recipe's one reward
    runs = list((tmp_path / "g" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = list(runs[0].rglob("completions*.table.json"))
    assert tables, sorted(str(p.relative_to(runs[0])) for p in runs[0].rglob("*"))[:40]
    table = json.loads(tables[0].read_text())
    assert "completion" in table["columns"] and len(table["data"]) == 8


def test_reward_model_on_pku_saferlhf_rows_records_the_preference_and_held_out_pairs(pretrained, tmp_path):
    from tests.conftest import shared_path

    pku = shared_path("data", "pku_saferlhf", "pku_saferlhf_test_sample_transcribed.jsonl")
    result = posttrain("stage=reward_model", f"parent={pretrained}", "reward_model=pku_saferlhf",
                       f"reward_model.pairs.path={pku}", "reward_model.pairs.preference=better",
                       "reward_model.trainer.max_steps=2", "reward_model.trainer.gradient_accumulation_steps=1",
                       "reward_model.trainer.max_length=256", f"run.root={tmp_path}", "run.name=p")
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = verify_artifact(tmp_path / "p" / "01-reward_model")
    record = manifest["datasets"][0]
    assert record["id"] == str(pku) and record["preference"] == "better"
    assert record["rows"] == 5 and record["held_out"] == 4  # 9 rows: half (rounded down) held out
    assert manifest["metrics"]["held_out_pairs"] == 4 and manifest["metrics"]["global_step"] == 2
    assert set(manifest["metrics"]["pairwise_accuracy_by_family"]) == {"pku_saferlhf"}

    # The artifact is a safety judge for the pku_saferlhf eval suite: its manifest's threshold is the default cut.
    from posttrain.evaluation.suites import build_suite
    from rewards.reward_model import RewardModelScorer

    judge = tmp_path / "p" / "01-reward_model"
    threshold = manifest["metrics"]["decision_threshold"]
    suite = build_suite("pku_saferlhf", 4, 0, path=str(pku), reward_model=str(judge))
    replies = [json.loads(line)["response_0"] for line in pku.read_text().splitlines()[:4]]
    raw = RewardModelScorer(judge)(prompts=[r["messages"] for r in suite.rows], completions=replies)
    assert suite.scorer.threshold == threshold
    assert suite.score(replies) == [float(x > threshold) for x in raw]


def test_bad_pku_row_stops_the_reward_model_stage_naming_the_row(pretrained, tmp_path):
    bad = tmp_path / "pku.jsonl"
    row = {"prompt": "p", "response_0": "a", "response_1": "b", "safer_response_id": 1, "better_response_id": 1}
    bad.write_text("\n".join(json.dumps(r) for r in [row, row, {**row, "safer_response_id": "1"}]))
    result = posttrain("stage=reward_model", f"parent={pretrained}", "reward_model=pku_saferlhf",
                       f"reward_model.pairs.path={bad}", f"run.root={tmp_path}", "run.name=b")
    assert result.returncode == 2
    assert f"{bad}: row 3: field 'safer_response_id' must be 0 or 1, got '1'" in result.stderr
    assert not list(tmp_path.glob("b/*/manifest.json"))


def kill_group(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def test_grpo_killed_after_a_checkpoint_resumes_with_every_steps_completions_once(pretrained, tmp_path):
    args = ("stage=grpo", f"parent={pretrained}", f"run.root={tmp_path}", "run.name=r", "grpo.prompts.n=32",
            "grpo.trainer.max_steps=6", "grpo.trainer.save_steps=2", "grpo.trainer.per_device_train_batch_size=8",
            "grpo.trainer.num_generations=4", "grpo.trainer.max_completion_length=8")
    stage_dir = tmp_path / "r" / "01-grpo"
    table = stage_dir / "completions.jsonl"

    def steps() -> list[int]:
        return [json.loads(line)["step"] for line in table.read_text().splitlines()] if table.exists() else []

    proc = popen(*args, log=tmp_path / "first.log")
    try:
        deadline, checkpoint = time.monotonic() + 600, None
        while time.monotonic() < deadline and proc.poll() is None:
            done = [p for p in (stage_dir / "checkpoints").glob("checkpoint-*") if (p / "trainer_state.json").exists()]
            checkpoint = max((int(p.name.split("-")[1]) for p in done), default=None)
            if checkpoint is not None and max(steps(), default=-1) >= checkpoint:
                break  # the step after the checkpoint has scored its completions: kill now
            time.sleep(0.05)
        assert proc.poll() is None, "GRPO ended before it could be killed:\n" + (tmp_path / "first.log").read_text()[-2000:]
    finally:
        kill_group(proc)
    written = steps()
    assert max(written) >= checkpoint  # the killed attempt left completions for a step it will redo

    result = posttrain(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"grpo: resuming from {stage_dir / 'checkpoints'}" in result.stderr
    assert "completions the killed attempt scored after" in result.stderr
    counts = {step: steps().count(step) for step in set(steps())}
    assert counts == dict.fromkeys(range(6), 8), counts  # 8 completions a step (2 prompts x 4), each step once
    # the record of equal-reward groups covers the steps before the checkpoint too (it comes back with it)
    metrics = verify_artifact(stage_dir)["metrics"]
    assert metrics["sampling"]["steps"] == 6, metrics["sampling"]
    assert metrics["step_seconds"]["generation"] > 0


def test_a_second_run_on_a_busy_stage_directory_stops_naming_the_owner(pretrained, tmp_path):
    # The first run is stopped (SIGSTOP) as soon as it holds the stage: a live owner for as long as the second run
    # takes to start, however slow the machine, without a long stage to wait out. It then finishes its 20 steps.
    args = ("stage=sft", f"parent={pretrained}", f"run.root={tmp_path}", "run.name=dup", "sft.trainer.max_steps=20",
            "sft.trainer.save_steps=10")
    stage_dir = tmp_path / "dup" / "01-sft"
    owner = stage_dir / "owner.lock"
    first = popen(*args, log=tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None and not (owner.exists() and owner.read_text()):
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            assert f"pid {first.pid}" in owner.read_text()
            second = posttrain(*args, "sft.trainer.learning_rate=1e-2", timeout=300)
            assert first.poll() is None, "the first run ended before the second one started: nothing was tested"
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"{stage_dir} is in use by another run (host " in second.stderr and f"pid {first.pid}," in second.stderr
        assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        kill_group(first)
    manifest = verify_artifact(stage_dir)  # the first run's artifact, whole
    assert manifest["metrics"]["global_step"] == 20 and owner.read_text() == ""  # released at the end
