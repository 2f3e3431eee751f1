"""reward_model: preference pairs -> a Bradley-Terry scorer, with TRL's RewardTrainer.

The scorer starts from the parent artifact (or the recipe's model) with a one-output sequence-classification head.
Pairs are the tiny world's or PKU-SafeRLHF rows (chosen by `safer_response_id` unless the recipe says `better`).
The manifest records the pairwise accuracy on held-out pairs: the fraction where chosen outscores rejected.
"""

from __future__ import annotations

import logging

from posttrain import sharding, training
from posttrain.data.preferences import load_pair_split
from posttrain.data.startup import pair_jobs, startup_check
from posttrain.models.freezing import freeze_below_top_layers
from posttrain.models.loading import torch_dtype
from posttrain.moe import MoeRouterCallback
from posttrain.training import StageRun
from posttrain.resume import train_from_checkpoint
from rewards.reward_model import RewardModelScorer

log = logging.getLogger("posttrain")


def pairwise_accuracy(scorer, pairs: list[dict]) -> dict:
    """Held-out accuracy of a scorer on pairs, per family and overall, with the mean margin."""
    prompts = [p["prompt"] for p in pairs] * 2
    completions = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    scores = scorer(prompts=prompts, completions=completions)
    chosen, rejected = scores[: len(pairs)], scores[len(pairs) :]
    wins: dict[str, list[bool]] = {}
    kinds: dict[str, list[bool]] = {}
    for pair, c, r in zip(pairs, chosen, rejected):
        wins.setdefault(pair.get("family", "all"), []).append(c > r)
        if "kind" in pair:
            kinds.setdefault(f"{pair['family']}/{pair['kind']}", []).append(c > r)
    every = [w for ws in wins.values() for w in ws]
    return {
        "pairwise_accuracy": sum(every) / len(every),
        "pairwise_accuracy_by_family": {k: sum(v) / len(v) for k, v in sorted(wins.items())},
        "pairwise_accuracy_by_kind": {k: {"accuracy": sum(v) / len(v), "pairs": len(v)} for k, v in sorted(kinds.items())},
        "mean_margin": sum(c - r for c, r in zip(chosen, rejected)) / len(pairs),
        # midway between the mean chosen and mean rejected score: rewards.safety.RewardModelSafety's default cut
        "decision_threshold": (sum(chosen) + sum(rejected)) / (2 * len(pairs)),
        "held_out_pairs": len(pairs),
    }


def load_scoring_model(location, model_cfg, tokenizer):
    """The parent's weights under a one-output sequence-classification head."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        location, num_labels=1, dtype=torch_dtype(model_cfg.dtype), trust_remote_code=model_cfg.trust_remote_code
    )
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token
    return model


def main(cfg, run: StageRun) -> dict:
    from datasets import Dataset
    from trl import RewardTrainer

    # --- config ------------------------------------------------------------------------------------------------
    args, location, tokenizer = training.open_stage(cfg, run, "RewardConfig")

    # --- model: the parent's weights under a fresh one-output head -----------------------------------------------
    model = load_scoring_model(location, cfg.model, tokenizer)
    frozen = None
    if cfg.reward_model.train_top_layers is not None:
        frozen = freeze_below_top_layers(model, cfg.reward_model.train_top_layers)
        log.info("reward_model: training the top %d of %d decoder layers and the head (%s of %s parameters)",
                 frozen["trained_layers"], frozen["layers"], f"{frozen['trainable_params']:,}",
                 f"{frozen['trainable_params'] + frozen['frozen_params']:,}")
    peft_config = training.lora_config(cfg.reward_model.lora, task_type="SEQ_CLS")

    # --- data ----------------------------------------------------------------------------------------------------
    train_pairs, held_out, record = load_pair_split("reward_model", cfg.reward_model.pairs, cfg.data.seed)
    record["check"] = startup_check("reward_model", pair_jobs(cfg.reward_model.pairs, train_pairs), tokenizer,
                                    args.max_length, None, cfg.get("eval"), cfg.data.seed)
    columns = ("prompt", "chosen", "rejected")
    dataset = Dataset.from_list([{k: p[k] for k in columns} for p in train_pairs])  # family / kind stay out

    # --- train (resumes from the last checkpoint of a killed attempt) ------------------------------------------
    batch = args.per_device_eval_batch_size or 16
    with sharding.whole_weights(model):  # ZeRO-3 partitioned the weights at load
        before = pairwise_accuracy(RewardModelScorer(model=model, tokenizer=tokenizer, batch_size=batch), held_out)
    log.info("reward_model: held-out pairwise accuracy before training %.3f on %d pairs",
             before["pairwise_accuracy"], before["held_out_pairs"])
    # MoE models: expert shares per logging step (the sequence-classification loss has no load-balancing
    # term: transformers adds it in the causal-LM classes only)
    moe = MoeRouterCallback()
    trainer = RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=peft_config, callbacks=[moe])
    training.install_test_hooks(trainer, run)  # no-op unless the recipe's debug.fault names a rank
    resume = train_from_checkpoint(trainer, run)
    model = trainer.model
    if peft_config is not None:  # sharded (FSDP, ZeRO-3): the merged model exists on rank 0 only
        model = sharding.merge_lora(trainer, lambda: load_scoring_model(location, cfg.model, tokenizer))

    # --- held-out pairwise accuracy, then save -------------------------------------------------------------------
    if model is None:  # a rank other than 0 after a sharded LoRA merge: rank 0 measures and saves
        return training.finish(run, None, tokenizer, trainer=trainer, datasets=[], metrics={}, extra={})
    held = pairwise_accuracy(RewardModelScorer(model=model, tokenizer=tokenizer, batch_size=batch), held_out)
    log.info("reward_model: held-out pairwise accuracy %.3f on %d pairs %s", held["pairwise_accuracy"],
             held["held_out_pairs"], held["pairwise_accuracy_by_family"])
    metrics = {**training.train_metrics(trainer), **moe.metrics(), **held,
               "pairwise_accuracy_before_training": before["pairwise_accuracy"]}
    return training.finish(run, model, tokenizer, trainer=trainer, datasets=[record], metrics=metrics,
                           extra={"resumed_from": resume, "base_model": str(location),
                                  "head": "sequence-classification, 1 output", "frozen": frozen})
