"""sft: base -> instruct with TRL's SFTTrainer; loss on assistant tokens only.

Rows are rendered through the model's own chat template and the assistant mask is computed from the rendered
text (posttrain.chat.render), so templates without `{% generation %}` tags (most real ones) work. The dataset
reaches TRL pre-tokenized with an `assistant_masks` column, from which TRL builds the labels.
"""

from __future__ import annotations

import logging

from posttrain import sharding, training
from posttrain.data.chat_rows import load_rows, tokenize_rows
from posttrain.data.startup import sft_jobs, startup_check
from posttrain.models.freezing import freeze_below_top_layers
from posttrain.models.likelihood import perplexity
from posttrain.models.lm_head import use_compact_lm_heads
from posttrain.models.loading import load_model
from posttrain.moe import MoeRouterCallback
from posttrain.training import StageRun
from posttrain.resume import train_from_checkpoint

log = logging.getLogger("posttrain")


def main(cfg, run: StageRun) -> dict:
    from datasets import Dataset
    from trl import SFTTrainer

    # --- config ------------------------------------------------------------------------------------------------
    args, location, tokenizer = training.open_stage(cfg, run, "SFTConfig")
    template_kwargs = dict(cfg.sft.chat_template_kwargs)

    # --- model -------------------------------------------------------------------------------------------------
    model = load_model(location, cfg.model, load_in_4bit=cfg.sft.qlora)
    peft_config = trained_part(cfg.sft, model)

    # --- data: render through the chat template, mask everything but the assistant's turns ----------------------
    rows, record = load_rows(cfg.data)
    record["check"] = startup_check("sft", sft_jobs(cfg.data, rows), tokenizer, args.max_length, template_kwargs,
                                    cfg.get("eval"), cfg.data.seed)
    ids, masks, counts = training_tokens(rows, tokenizer, record["id"], args.max_length, template_kwargs)
    dataset = Dataset.from_dict({"input_ids": ids, "assistant_masks": masks})
    held_out = HeldOutPerplexity.measure_parent(cfg.data, model, tokenizer, template_kwargs)

    # --- train (resumes from the last checkpoint of a killed attempt) ------------------------------------------
    moe = MoeRouterCallback()  # MoE models: expert shares per logging step, per-layer balance loss
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
        callbacks=[moe],
    )
    use_compact_lm_heads(trainer, "sft", cfg.sft.lm_head)  # on CPU, TRL's head scores every position, in tiles
    training.install_test_hooks(trainer, run)  # no-op unless the recipe's debug.fault names a rank
    resume = train_from_checkpoint(trainer, run)

    # --- save: LoRA adapters are merged, so the artifact is a plain model directory ----------------------------
    model = merged_model(cfg, trainer, location, run) if peft_config is not None else trainer.model
    held_out_metrics = held_out.after(model) if held_out is not None and model is not None else {}
    metrics = {**training.train_metrics(trainer), **moe.metrics(), **held_out_metrics, **counts}
    datasets = [record] + ([held_out.record] if held_out is not None else [])
    return training.finish(run, model, tokenizer, trainer=trainer, datasets=datasets, metrics=metrics,
                           extra={"resumed_from": resume, "base_model": str(location)})


def trained_part(sft_cfg, model):
    """What of `model` trains: LoRA adapters (returns their peft config), the top `train_top_layers` decoder layers
    (freezes the rest), or every weight (returns None). Preflight refused both at once, and QLoRA without LoRA."""
    if sft_cfg.get("train_top_layers") is not None:
        frozen = freeze_below_top_layers(model, sft_cfg.train_top_layers)
        log.info("sft: training the top %d of %d decoder layers and the final norm (%s of %s parameters)",
                 frozen["trained_layers"], frozen["layers"], f"{frozen['trainable_params']:,}",
                 f"{frozen['trainable_params'] + frozen['frozen_params']:,}")
    return training.lora_config(sft_cfg.lora)


def training_tokens(rows: list[dict], tokenizer, source: str, max_length: int | None, template_kwargs: dict):
    """The rows rendered and masked (input ids, assistant masks), and the manifest's counts of them, logged."""
    ids, masks, dropped = tokenize_rows(rows, tokenizer, source, max_length, template_kwargs)
    n_tokens, n_trained = sum(map(len, ids)), sum(map(sum, masks))
    counts = {"rows": len(ids), "rows_dropped_by_max_length": dropped, "tokens": n_tokens,
              "assistant_token_fraction": n_trained / n_tokens}
    log.info("sft: %d rows (%d dropped: no assistant token within max_length), %d tokens, %.1f%% trained on",
             len(ids), dropped, n_tokens, 100 * counts["assistant_token_fraction"])
    return ids, masks, counts


def merged_model(cfg, trainer, location, run: StageRun):
    """The trained LoRA adapters merged into the parent's weights: QLoRA's into full-precision weights (not the
    4-bit ones it trained against), the adapters saved beside the model either way. Sharded (FSDP, ZeRO-3): the
    merged model exists on rank 0 only, the other ranks get None."""
    if not cfg.sft.qlora:
        return sharding.merge_lora(trainer, lambda: load_model(location, cfg.model), run.out_dir / "adapter",
                                   check=require_trained_adapters)
    from peft import PeftModel

    require_trained_adapters(trainer.model)
    training.save_adapter(trainer.model, run)  # rank 0 writes, every rank may read
    return PeftModel.from_pretrained(load_model(location, cfg.model), run.out_dir / "adapter").merge_and_unload()


def require_trained_adapters(model) -> None:
    import torch

    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    if not lora_b or all(torch.count_nonzero(p) == 0 for p in lora_b):
        raise RuntimeError("sft: LoRA B matrices are still zero after training: the adapters got no gradient")


class HeldOutPerplexity:
    """The perplexity of a real dataset's held-out rows (`data.held_out`) under the parent and the trained model.
    Rows are measured whole, as quantize measures them: a reply cut at max_length would leave rows out."""

    def __init__(self, sequences: list, record: dict, parent: float):
        self.sequences, self.record, self.parent = sequences, {**record, "role": "perplexity"}, parent

    @classmethod
    def measure_parent(cls, data_cfg, model, tokenizer, template_kwargs: dict) -> HeldOutPerplexity | None:
        """The held-out rows and the parent's perplexity on them; None for the tiny world or no held-out rows."""
        if data_cfg.name == "tiny" or getattr(data_cfg, "held_out", 0) == 0:
            return None
        rows, record = load_rows(data_cfg, "held_out")
        ids, masks, _ = tokenize_rows(rows, tokenizer, record["id"], None, template_kwargs)
        with sharding.whole_weights(model):  # ZeRO-3 partitioned the weights at load
            sequences = list(zip(ids, masks))
            return cls(sequences, record, perplexity(model, sequences))

    def after(self, model) -> dict:
        """{"held_out_perplexity": parent, trained, change, held_out_rows} with the trained model measured now."""
        after = perplexity(model, self.sequences)
        log.info("sft: held-out perplexity %.3f -> %.3f on %d rows (%s)", self.parent, after,
                 len(self.sequences), self.record["id"])
        return {"held_out_perplexity": {"parent": self.parent, "trained": after, "change": after / self.parent - 1,
                                        "held_out_rows": len(self.sequences)}}
