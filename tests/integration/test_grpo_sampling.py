"""Dynamic sampling on TRL's GRPOTrainer (posttrain.grpo_sampling) and the completion table's advantages, on a
small random model: a reward that gives every completion of some prompts the same score leaves those groups without
signal; with grpo.sampling.filter=zero_std the trained batch holds only groups that carry some."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

import pytest
import torch

from posttrain.grpo_sampling import dynamic_sampling_trainer, informative_groups
from posttrain.resume import train_from_checkpoint
from posttrain.grpo_record import StepTimer, sampling_summary, step_split
from posttrain.stages.grpo import RewardTable

GROUP = 4


def varied_reward(prompts, completions, **kwargs):
    """0 for every completion of a 'flat' prompt (an all-equal group), a score that differs between completions of
    the others (a checksum of the text: distinct sampled texts get distinct scores), None for 'skip' prompts."""
    out = []
    for prompt, completion in zip(prompts, completions):
        text = prompt[-1]["content"]
        reply = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(None if "skip" in text else 0.0 if "flat" in text else (zlib.crc32(reply.encode()) % 997) / 997)
    return out


def make_trainer(tiny_tokenizer, tmp_path, prompts: list[str], sampling: str, reward_funcs, seed: int = 0,
                 **overrides):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.models.tiny import TinyArch, build_tiny_model

    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16)
    model = build_tiny_model(arch, tiny_tokenizer, seed=seed)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, per_device_train_batch_size=2 * GROUP,
                      num_generations=GROUP, max_completion_length=8, temperature=1.0, learning_rate=1e-3,
                      beta=0.0, loss_type="dapo", scale_rewards="group", logging_steps=1, report_to=[], seed=seed,
                      bf16=False, dataloader_num_workers=0, **{"save_strategy": "no", **overrides})
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in prompts]
    cls = dynamic_sampling_trainer(GRPOTrainer, SimpleNamespace(filter=sampling, max_rounds=4))
    trainer = cls(model=model, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(rows),
                  processing_class=tiny_tokenizer)
    trainer.model.train()
    return trainer


def batch_of(prompts: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": p}]} for p in prompts for _ in range(GROUP)]


POOL = ["flat one", "flat two", "vary one", "vary two", "vary three", "vary four"]


def test_zero_std_groups_are_replaced_by_fresh_informative_ones(tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_tokenizer, tmp_path, POOL, "zero_std", [varied_reward])
    out = trainer._generate_and_score_completions(batch_of(["flat one", "flat two"]))
    assert out["completion_ids"].size(0) == 2 * GROUP  # the batch keeps its size
    assert informative_groups(out["advantages"], GROUP).all()  # both all-zero groups were dropped and refilled
    mask = out["completion_mask"]
    assert int(out["num_items_in_batch"]) == int(mask.sum())  # the DAPO token count is the kept rows'
    assert (out["prompt_mask"].sum(1) > 0).all() and out["prompt_ids"].size(0) == 2 * GROUP
    record = trainer.sampling_history[-1]
    assert record["generated"] == 4 * GROUP and record["trained"] == 2 * GROUP  # 2 flat groups + 2 fresh ones
    assert record["filtered_group_share"] == 0.5 and record["filled_uninformative_groups"] == 0
    # TRL trains on exactly this: one optimizer step runs on it, and the weights move
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(r["trained"] == 2 * GROUP for r in trainer.sampling_history)


def test_without_the_filter_all_equal_groups_are_trained_on(tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_tokenizer, tmp_path, POOL, "none", [varied_reward])
    out = trainer._generate_and_score_completions(batch_of(["flat one", "vary one"]))
    assert informative_groups(out["advantages"], GROUP).tolist() == [False, True]
    assert trainer.sampling_history == []


def test_too_few_informative_prompts_fill_the_batch_and_say_so(tiny_tokenizer, tmp_path, caplog):
    trainer = make_trainer(tiny_tokenizer, tmp_path, ["flat one", "flat two", "flat three", "vary one"], "zero_std",
                           [varied_reward])
    with caplog.at_level("INFO", logger="posttrain"):
        out = trainer._generate_and_score_completions(batch_of(["flat one", "flat two"]))
    assert out["completion_ids"].size(0) == 2 * GROUP
    assert informative_groups(out["advantages"], GROUP).tolist() == [True, False]  # 'vary one', then a flat group
    assert trainer.sampling_history[-1]["filled_uninformative_groups"] == 1
    assert "uninformative groups fill the batch" in caplog.text


def test_the_completion_table_logs_the_advantages_trl_trains_on(tiny_tokenizer, tmp_path):
    """TRL's advantages (Bessel-corrected group std, unscorable completions out of the baseline) against the
    table's, on one batch with a group of unscorable completions and two scored ones."""
    table = RewardTable({"varied": (varied_reward, 1.0)}, GROUP, "group", tmp_path / "completions.jsonl")
    trainer = make_trainer(tiny_tokenizer, tmp_path, POOL, "none", table.wrapped())
    out = trainer._generate_and_score_completions(batch_of(["vary one", "skip one"]))
    logged = [json.loads(line)["advantage"] for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(out["advantages"].tolist(), abs=1e-5)
    assert logged == pytest.approx(list(trainer._logs["advantages"])[-2 * GROUP:], abs=1e-5)
    assert any(a != 0 for a in logged[:GROUP]) and logged[GROUP:] == [0.0] * GROUP


def test_a_reward_that_never_fires_is_reported(tiny_tokenizer, tmp_path, caplog):
    def never(completions, **kwargs):
        return [0.0] * len(completions)

    table = RewardTable({"varied": (varied_reward, 1.0), "never": (never, 0.1)}, GROUP, "group",
                        tmp_path / "completions.jsonl")
    trainer = make_trainer(tiny_tokenizer, tmp_path, POOL, "none", table.wrapped())
    with caplog.at_level("WARNING", logger="posttrain"):
        for _ in range(2):
            trainer._generate_and_score_completions(batch_of(["vary one", "vary two"]))
    assert "reward 'never' scored 0 on every completion" in caplog.text
    assert "reward 'varied'" not in caplog.text


def test_the_screen_keeps_the_prompts_passed_some_of_the_time(tiny_tokenizer, tmp_path):
    from posttrain.stages.grpo import screen_prompts

    def reward(prompts, completions, **kwargs):
        scores = varied_reward(prompts, completions)
        return [1.0 if "always" in p[-1]["content"] else s for p, s in zip(prompts, scores)]

    trainer = make_trainer(tiny_tokenizer, tmp_path, POOL, "none", [varied_reward])
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": "x"}
            for p in ("flat one", "vary one", "always one", "vary two")]
    screen = SimpleNamespace(samples=6, keep=[0.1, 0.9], batch=8)
    kept, record = screen_prompts(rows, screen, trainer.model, tiny_tokenizer, {"r": (reward, 1.0)}, trainer.args, {})
    assert [r["prompt"][0]["content"] for r in kept] == ["vary one", "vary two"]
    assert record["screened"] == 4 and record["kept"] == 2 and record["samples"] == 6
    assert record["pass_rates"][0] == 0.0 and record["pass_rates"][2] == 1.0 and 0.1 <= record["pass_rates"][1] <= 0.9
    with pytest.raises(ValueError, match="keep must be"):
        screen_prompts(rows, SimpleNamespace(samples=6, keep=[0.9, 0.1], batch=8), trainer.model, tiny_tokenizer,
                       {"r": (reward, 1.0)}, trainer.args, {})


def test_a_checkpoint_at_max_steps_resumes_without_another_step_and_keeps_its_step_records(tiny_tokenizer, tmp_path):
    def trainer(where=tmp_path):  # the stage's reward table logs each generation batch's equal-reward groups
        table = RewardTable({"varied": (varied_reward, 1.0)}, GROUP, "group", where / "completions.jsonl")
        return make_trainer(tiny_tokenizer, where, POOL, "zero_std", table.wrapped(), save_strategy="steps",
                            save_steps=2)

    first = trainer()
    StepTimer().attach(first)
    first.train()  # max_steps 2: its last checkpoint is at the end
    trained = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    # transformers alone trains one more step from a checkpoint at max_steps: what train_from_checkpoint prevents
    plain = trainer(tmp_path / "plain")
    plain.train(resume_from_checkpoint=checkpoint)
    assert plain.state.global_step == 3

    resumed = trainer()
    assert train_from_checkpoint(resumed, SimpleNamespace(name="grpo", checkpoints=tmp_path / "out")) == checkpoint
    assert resumed.state.global_step == 2 and resumed.sampling_history == []  # nothing generated, no step
    assert all(torch.equal(trained[n], p) for n, p in resumed.model.named_parameters())
    # the step records come back with the checkpoint's log_history: both steps, though this process ran none
    split = step_split(resumed.state.log_history)
    assert split["steps"] == 2 and split["generation"] > 0 and split["update_and_rest"] > 0
    summary = sampling_summary(resumed.state.log_history, GROUP)
    assert summary["steps"] == 2 and summary["trained"] == 2 * 2 * GROUP and summary["generated"] >= summary["trained"]
    assert [r["step"] for r in summary["per_step"]] == [1, 2]
