"""Likelihoods of held-out replies: the perplexity of held-out rows (SFT before and after, quantize against its
parent), and the likelihood-shift report: how DPO moved the chosen and rejected replies of held-out pairs.

For each pair, the log-probability of the chosen and of the rejected reply given the prompt, under the reference
(the parent) and under the trained policy. The report gives the mean per-token log-probability of each, before and
after, and DPO's implicit reward `beta * (log pi(y|x) - log ref(y|x))`: its accuracy (chosen's above rejected's)
and mean margin. DPO can raise the margin while lowering both likelihoods; the report shows which happened.

Prompts and replies are rendered through the chat template as TRL's DPOTrainer renders them (the prompt with the
generation prompt, then prompt + reply; the reply is what follows their common prefix).
"""

from __future__ import annotations

import math

from tqdm.auto import tqdm


def reply_token_ids(tokenizer, prompt: list[dict], reply: list[dict]) -> tuple[list[int], int]:
    """Token ids of prompt + reply and the index where the reply starts."""
    prompt_ids = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(tokenizer.apply_chat_template(prompt + reply, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    start = 0
    while start < min(len(prompt_ids), len(full_ids)) and prompt_ids[start] == full_ids[start]:
        start += 1
    return full_ids, start


def reply_logprobs(model, tokenizer, pairs: list[dict], batch_size: int = 32, desc: str = "log-probs"):
    """Per pair: (sum of chosen log-probs, chosen tokens, sum of rejected log-probs, rejected tokens)."""
    import torch

    items = []
    for pair in pairs:
        for key in ("chosen", "rejected"):
            items.append(reply_token_ids(tokenizer, pair["prompt"], pair[key]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    sums: list[tuple[float, int]] = []
    try:
        for start in tqdm(range(0, len(items), batch_size), desc=desc, unit="batch"):
            batch = items[start : start + batch_size]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
            attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
            with torch.no_grad():
                logits = model(input_ids=ids.to(model.device), attention_mask=attention.to(model.device)).logits
            # logits[:, t] predicts token t + 1
            logps = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None].to(model.device))
            for row, (full, reply_start) in enumerate(batch):
                token_logps = logps[row, reply_start - 1 : len(full) - 1, 0]
                sums.append((token_logps.sum().item(), len(full) - reply_start))
    finally:
        model.train(was_training)
    return [(*sums[2 * k], *sums[2 * k + 1]) for k in range(len(pairs))]


def likelihood_shift(reference: list[tuple], policy: list[tuple], beta: float, pairs: list[dict]) -> dict:
    """The report from reply_logprobs under the reference and under the policy (same pairs, same order)."""
    n = len(pairs)
    if n == 0 or len(reference) != n or len(policy) != n:
        raise ValueError(f"likelihood_shift: {n} pairs, {len(reference)} reference and {len(policy)} policy rows")

    def per_token(rows, which):  # mean over pairs of the reply's mean per-token log-probability
        return sum(r[0] / r[1] if which == "chosen" else r[2] / r[3] for r in rows) / n

    margins = [beta * ((p[0] - r[0]) - (p[2] - r[2])) for r, p in zip(reference, policy)]
    report = {
        "held_out_pairs": n,
        "beta": beta,
        "chosen_logp_per_token": {"reference": per_token(reference, "chosen"), "policy": per_token(policy, "chosen")},
        "rejected_logp_per_token": {"reference": per_token(reference, "rejected"),
                                    "policy": per_token(policy, "rejected")},
        "implicit_reward_accuracy": sum(m > 0 for m in margins) / n,
        "implicit_reward_margin": sum(margins) / n,
    }
    for key in ("chosen_logp_per_token", "rejected_logp_per_token"):
        report[key]["shift"] = report[key]["policy"] - report[key]["reference"]
    kinds: dict[str, list[float]] = {}
    for pair, m in zip(pairs, margins):
        kinds.setdefault(pair.get("kind", "all"), []).append(m)
    report["implicit_reward_accuracy_by_kind"] = {k: sum(m > 0 for m in v) / len(v) for k, v in sorted(kinds.items())}
    return report


def render_shift(report: dict) -> str:
    """Two lines for logs and the scorecard."""
    c, r = report["chosen_logp_per_token"], report["rejected_logp_per_token"]
    return (f"chosen log-prob/token {c['reference']:.3f} -> {c['policy']:.3f} ({c['shift']:+.3f}), "
            f"rejected {r['reference']:.3f} -> {r['policy']:.3f} ({r['shift']:+.3f}); "
            f"implicit reward accuracy {report['implicit_reward_accuracy']:.3f}, "
            f"margin {report['implicit_reward_margin']:.3f} ({report['held_out_pairs']} held-out pairs)")


def perplexity(model, sequences: list[tuple[list[int], list[int]]]) -> float:
    """exp(mean NLL) of the assistant tokens of each held-out (ids, assistant mask): the replies the model was
    trained to write. Prompt tokens are left out: the tiny world's prompts hold random words no model predicts."""
    import torch

    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for ids, mask in sequences:
                x = torch.tensor([ids], device=model.device)
                logits = model(x).logits[0, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
                keep = torch.tensor(mask[1:], dtype=torch.bool, device=nll.device)
                total += nll[keep].sum().item()
                count += int(keep.sum())
    finally:
        model.train(was_training)
    return math.exp(total / count)
