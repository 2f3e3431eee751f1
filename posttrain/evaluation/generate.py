"""Text production for eval suites with transformers' `generate`: batched, left-padded, greedy or sampled.

Kept apart from the suites and scorers, so a later engine (the served endpoint) can replace it unchanged.
"""

from __future__ import annotations

from tqdm.auto import tqdm


def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int,
             samples: int = 0, temperature: float = 1.0, seed: int = 0, desc: str = "generate",
             **template_kwargs) -> list[str] | list[list[str]]:
    """Replies to each conversation: one greedy reply per prompt when `samples` is 0, else a list of `samples`
    replies drawn at `temperature` with no top-k / top-p truncation (pass@1 is estimated from plain sampling)."""
    import torch

    prompts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **template_kwargs)
        for c in conversations
    ]
    tokenizer.padding_side = "left"
    model.eval()
    sampling = {"do_sample": False}
    if samples:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0,
                    "num_return_sequences": samples}
        torch.manual_seed(seed)
    step = max(1, batch_size // max(samples, 1))  # batch_size counts sequences, prompts x samples
    out: list = []
    for start in tqdm(range(0, len(prompts), step), desc=desc, unit="batch"):
        batch = tokenizer(prompts[start : start + step], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            # ids: [B * samples, prompt_len + new]; only the new tokens are the reply
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 **sampling)
        texts = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        if samples:
            out += [texts[i : i + samples] for i in range(0, len(texts), samples)]
        else:
            out += texts
    return out
