"""A trained reward model as a reward: scores (prompt, completion) with a sequence-classification model.

The model is a reward-model artifact (`runs/<run>/NN-reward_model`, whose `model/` holds it) or any
sequence-classification reward model given by path or hub id. Conversations are rendered through the model's own
chat template, as the model saw them in training; plain-text prompts and completions are joined as they are.
"""

from __future__ import annotations

from pathlib import Path
from posttrain.artifacts import verify_artifact


class RewardModelScorer:
    """Callable with TRL's reward signature: `scorer(prompts=..., completions=...) -> list[float]`.

    TRL names the reward's logged metrics (`rewards/reward_model/mean`) after the instance's `__name__`:

    >>> RewardModelScorer.__dict__["__name__"]
    'reward_model'
    >>> RewardModelScorer()
    Traceback (most recent call last):
    ...
    ValueError: RewardModelScorer needs a path (artifact or model directory) or a loaded model
    """

    __name__ = "reward_model"  # TRL names a reward's logged metrics after it

    def __init__(self, path: str | Path | None = None, *, model=None, tokenizer=None, batch_size: int = 16,
                 max_length: int = 1024):
        if model is None:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            if path is None:
                raise ValueError("RewardModelScorer needs a path (artifact or model directory) or a loaded model")
            path = Path(path)
            if (path / "model").is_dir():  # an artifact directory: verify before trusting its weights

                verify_artifact(path)
                path = path / "model"
            model = AutoModelForSequenceClassification.from_pretrained(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
        if getattr(model.config, "num_labels", None) != 1:
            raise ValueError(f"{path or 'model'}: a reward model has one output (num_labels=1), "
                             f"this one has {model.config.num_labels}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = batch_size, max_length

    def texts(self, prompts, completions) -> list[str]:
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):
                completion = completion if isinstance(completion, list) else [
                    {"role": "assistant", "content": completion}]
                out.append(self.tokenizer.apply_chat_template(prompt + completion, tokenize=False))
            else:
                out.append(prompt + completion)
        return out

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        import torch
        from tqdm.auto import tqdm

        texts = self.texts(prompts, completions)
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length, add_special_tokens=False)["input_ids"]
        # Batches of similar lengths, so that a batch pads to little more than its own rows (scored in the callers'
        # order all the same): on 800 HH-RLHF replies of 20-1000 tokens, in batches of 8, padding to each batch's
        # longest row in the given order spent most of the forward passes on pad tokens.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        starts = range(0, len(order), self.batch_size)
        was_training = self.model.training
        self.model.eval()
        scores: list[float] = [0.0] * len(ids)
        try:
            for start in tqdm(starts, desc="reward model", unit="batch", disable=len(starts) < 8, leave=False):
                rows = order[start : start + self.batch_size]
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, padding=True, padding_side="right",
                                           return_tensors="pt").to(self.model.device)
                with torch.no_grad():
                    for i, score in zip(rows, self.model(**batch).logits[:, 0].float().tolist()):
                        scores[i] = score
        finally:
            self.model.train(was_training)
        return scores
