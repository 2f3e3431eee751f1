"""Text production for eval suites: greedy decoding with transformers' `generate`, batched, left-padded.

Kept apart from the suites and scorers, so a later engine (the served endpoint) can replace it unchanged.
"""

from __future__ import annotations

from tqdm.auto import tqdm


def greedy_generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int,
                    desc: str = "generate", **template_kwargs) -> list[str]:
    import torch

    prompts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **template_kwargs)
        for c in conversations
    ]
    tokenizer.padding_side = "left"
    model.eval()
    out: list[str] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch"):
        batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            # ids: [B, prompt_len + new]; only the new tokens are the reply
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        out += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return out
