"""dpo: reasoning -> aligned with TRL's DPOTrainer on safety preference pairs; the parent is the reference model.

Pairs are the tiny world's safety pairs (harmful request: chosen = decline, rejected = compliance; benign request
of the same shape: the other way round) or PKU-SafeRLHF rows (posttrain.data.preferences: safer, better or
safe_vs_unsafe). With `dpo.lora` set, only adapters train and TRL takes the reference from the adapter-free model,
which is the parent; the adapters are merged into the saved artifact.

The manifest carries the likelihood-shift report on held-out pairs (posttrain.models.likelihood).
"""

from __future__ import annotations

import logging

from posttrain import sharding, training
from posttrain.config import RecipeError
from posttrain.data.dolly import DataError
from posttrain.data.preferences import load_pair_split
from posttrain.data.startup import pair_jobs, startup_check
from posttrain.models.likelihood import likelihood_shift, render_shift, reply_logprobs
from posttrain.models.lm_head import use_compact_lm_heads
from posttrain.models.loading import load_model
from posttrain.moe import MoeRouterCallback
from posttrain.training import StageRun
from posttrain.resume import train_from_checkpoint


def kept_pairs(trainer, given: int, record: dict, source) -> None:
    """TRL's DPOTrainer silently drops every pair whose prompt alone fills trainer.max_length (keep_start
    truncation would leave it no reply token). HH-RLHF prompts are whole conversations, often longer than a short
    max_length: say how many went, record it, and stop before the first step if none is left."""
    kept = len(trainer.train_dataset)
    record["dropped_by_max_length"] = given - kept
    if kept == 0:
        raise DataError(f"{source}: every one of the {given} training pairs has a prompt of at least "
                        f"dpo.trainer.max_length={trainer.args.max_length} tokens, so TRL drops them all; raise "
                        f"dpo.trainer.max_length")
    if kept < given:
        log.warning("dpo: %d of %d training pairs dropped: their prompt alone fills dpo.trainer.max_length=%d",
                    given - kept, given, trainer.args.max_length)

log = logging.getLogger("posttrain")


def main(cfg, run: StageRun) -> dict:
    from datasets import Dataset
    from trl import DPOTrainer

    # --- config ------------------------------------------------------------------------------------------------
    args, location, tokenizer = training.open_stage(cfg, run, "DPOConfig")

    # --- models: the policy starts from the parent, which is also the frozen reference ---------------------------
    model = load_model(location, cfg.model)
    peft_config, ref_model = training.lora_config(cfg.dpo.lora), None
    if peft_config is None:
        ref_model = load_model(location, cfg.model)
        ref_model.eval()

    # --- data ----------------------------------------------------------------------------------------------------
    train_pairs, held_out, record = load_pair_split("dpo", cfg.dpo.pairs, cfg.data.seed)
    if cfg.dpo.shift_pairs is not None:
        if cfg.dpo.shift_pairs < 1:
            raise RecipeError(f"dpo.shift_pairs is {cfg.dpo.shift_pairs}; the likelihood shift needs at least 1 pair")
        held_out = held_out[: cfg.dpo.shift_pairs]  # what the likelihood shift measures
    record["check"] = startup_check("dpo", pair_jobs(cfg.dpo.pairs, train_pairs), tokenizer, args.max_length,
                                    None, cfg.get("eval"), cfg.data.seed)
    dataset = Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in train_pairs])
    dataset = training.shared_dataset(dataset, run, "pairs")  # several processes share TRL's reference cache

    # --- the reference's log-probabilities on held-out pairs, before any update ---------------------------------
    batch = args.per_device_eval_batch_size or 32
    with sharding.whole_weights(model):  # ZeRO-3 partitioned the weights at load
        reference = reply_logprobs(model, tokenizer, held_out, batch, desc="dpo: reference log-probs")

    # --- train (resumes from the last checkpoint of a killed attempt) ------------------------------------------
    moe = MoeRouterCallback()  # MoE models: expert shares per logging step, per-layer balance loss
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=peft_config, callbacks=[moe])
    kept_pairs(trainer, len(dataset), record, cfg.dpo.pairs.path or cfg.dpo.pairs.get("hub_id"))
    use_compact_lm_heads(trainer, "dpo", cfg.dpo.lm_head)  # on CPU, TRL's head scores every position, in tiles
    training.install_test_hooks(trainer, run)  # no-op unless the recipe's debug.fault names a rank
    resume = train_from_checkpoint(trainer, run)
    model = trainer.model
    if peft_config is not None:  # sharded (FSDP, ZeRO-3): the merged model exists on rank 0 only
        model = sharding.merge_lora(trainer, lambda: load_model(location, cfg.model), run.out_dir / "adapter")

    # --- how the held-out likelihoods moved, then save -----------------------------------------------------------
    if model is None:  # a rank other than 0 after a sharded LoRA merge: rank 0 measures and saves
        return training.finish(run, None, tokenizer, trainer=trainer, datasets=[], metrics={}, extra={})
    policy = reply_logprobs(model, tokenizer, held_out, batch, desc="dpo: policy log-probs")
    shift = likelihood_shift(reference, policy, args.beta, held_out)
    log.info("dpo: %s", render_shift(shift))
    metrics = {**training.train_metrics(trainer), **moe.metrics(), "likelihood_shift": shift}
    return training.finish(run, model, tokenizer, trainer=trainer, datasets=[record], metrics=metrics,
                           extra={"resumed_from": resume, "base_model": str(location), "reference": str(location),
                                  "lora": peft_config is not None})
