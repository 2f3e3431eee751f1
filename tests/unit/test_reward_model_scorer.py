"""The reward-model scorer loads a sequence-classification model by path and scores (prompt, completion) pairs."""

from __future__ import annotations

import pytest

from rewards.reward_model import RewardModelScorer


def save_classifier(path, tokenizer, num_labels: int = 1):
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_scores_conversations_and_plain_text_with_a_model_given_by_path(tmp_path, tiny_tokenizer):
    scorer = RewardModelScorer(save_classifier(tmp_path / "rm", tiny_tokenizer), batch_size=2)
    prompts = [[{"role": "user", "content": "What is 3 plus 4?"}]] * 3
    completions = ["The answer is 7.", [{"role": "assistant", "content": "The answer is 9."}], "7"]
    scores = scorer(prompts=prompts, completions=completions)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) == 3  # different texts, different scores (a random head still reads the text)
    # Batching and padding do not change a score.
    assert scorer(prompts=prompts[:1], completions=completions[:1]) == pytest.approx(scores[:1], abs=1e-5)
    texts = scorer.texts(prompts[:1], completions[:1])
    assert texts[0].endswith("<|im_start|>assistant\nThe answer is 7.<|im_end|>\n")
    assert scorer(prompts=["Q: 3+4? A:"], completions=[" 7"]) != scores[:1]  # plain text is joined as is


def test_length_sorted_batches_give_each_row_its_own_score_in_the_callers_order(tmp_path, tiny_tokenizer):
    """Rows are batched by length, not in the order given: each score still lands on its own row."""
    scorer = RewardModelScorer(save_classifier(tmp_path / "rm", tiny_tokenizer), batch_size=3)
    replies = ["7", "The answer is 7 because three plus four is seven.", "It is 7.", "Seven, that is 3 + 4.", "7!",
               "Three and four make seven, so the answer is 7, which I checked twice.", "7."]
    prompts = [[{"role": "user", "content": "What is 3 plus 4?"}]] * len(replies)
    together = scorer(prompts=prompts, completions=replies)
    alone = [scorer(prompts=[p], completions=[r])[0] for p, r in zip(prompts, replies)]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 6) for s in alone)) == len(replies)  # distinct scores: a swap would show


def test_a_model_with_more_than_one_output_is_refused(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModelScorer(save_classifier(tmp_path / "cls", tiny_tokenizer, num_labels=3))
