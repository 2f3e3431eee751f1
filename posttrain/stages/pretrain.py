"""pretrain: the tiny world's base model, a short bootstrap on plain text with no chat tokens (TRL SFTTrainer).

The base that comes out continues text and does not follow instructions: that is the starting point every
later stage is measured against. Only `model=tiny` has this stage; real models arrive pretrained.
"""

from __future__ import annotations

import logging

from posttrain import training
from posttrain.artifacts import sha256_json
from posttrain.data.startup import startup_check, tiny_jobs
from posttrain.data.tiny_world import build_tiny_tokenizer, plain_text
from posttrain.models.tiny import build_tiny_model
from posttrain.moe import MoeRouterCallback
from posttrain.training import StageRun
from posttrain.resume import train_from_checkpoint

log = logging.getLogger("posttrain")


def main(cfg, run: StageRun) -> dict:
    import torch
    from datasets import Dataset
    from trl import SFTTrainer

    # --- config ------------------------------------------------------------------------------------------------
    if cfg.model.source != "tiny":
        raise ValueError(f"the pretrain stage builds the tiny model; model.source is '{cfg.model.source}'")
    training.begin(run)
    args = training.trl_args("SFTConfig", cfg.pretrain.trainer, run, cfg.tracking, cfg.seed)

    # --- data: plain text, no chat template ----------------------------------------------------------------------
    texts = plain_text(cfg.data.pretrain_rows, cfg.data.seed)
    dataset = Dataset.from_dict({"text": texts})

    # --- model -------------------------------------------------------------------------------------------------
    tokenizer = build_tiny_tokenizer(cfg.model.arch.vocab_size, cfg.data.seed)
    torch.manual_seed(cfg.seed)
    model = build_tiny_model(cfg.model.arch, tokenizer, seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("pretrain: tiny Qwen3 with %.2fM parameters, vocabulary %d", n_params / 1e6, len(tokenizer))
    check = startup_check("pretrain", tiny_jobs([{"text": t} for t in texts], lambda r: "plain_text",
                                                {"plain_text": cfg.data.pretrain_rows}, "tiny_world/plain_text"),
                          tokenizer, args.max_length, None, cfg.get("eval"), cfg.data.seed)

    # --- train (resumes from the last checkpoint of a killed attempt) ------------------------------------------
    moe = MoeRouterCallback()  # MoE models: expert shares per logging step, per-layer balance loss
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[moe])
    training.install_test_hooks(trainer, run)  # no-op unless the recipe's debug.fault names a rank
    resume = train_from_checkpoint(trainer, run)

    # --- save + manifest ---------------------------------------------------------------------------------------
    metrics = {**training.train_metrics(trainer), **moe.metrics(), "parameters": n_params, "rows": len(texts)}
    record = {"id": "tiny_world/plain_text", "card": "data_cards/tiny_world.md", "rows": len(texts),
              "content_sha256": sha256_json(texts), "check": check}
    return training.finish(run, trainer.model, tokenizer, trainer=trainer, datasets=[record], metrics=metrics,
                           extra={"resumed_from": resume})
