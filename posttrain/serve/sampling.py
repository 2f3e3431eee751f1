"""Choosing tokens from logits: a request's sampling parameters, greedy and sampled picks (one row, or every row of
a batch together), OpenAI's logit_bias and repetition penalties, the log-probabilities the server reports, and the
end-of-sequence / stop-string rule. The engine and the server's scheduler share them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # record each chosen token's log-probability (of the logits divided by the temperature)
    # the server's log-probabilities (OpenAI's `logprobs`), of the model's own distribution (temperature 1, before
    # logit_bias and the penalties, as vLLM reports them): None reports none; k >= 0 each generated token's and
    # the k most likely; prompt_logprobs the same for the prompt's tokens (`echo`)
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits before sampling
    frequency_penalty: float = 0.0  # minus this times each token's count in the completion so far
    presence_penalty: float = 0.0  # minus this for each token the completion already holds

    def check(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only to score the prompt), got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def adjusted(logits: torch.Tensor, params: SamplingParams, tokens: list[int]) -> torch.Tensor:
    """logits [vocab] with the request's logit_bias added and OpenAI's frequency and presence penalties taken off
    the tokens the completion already holds (the same logits when it asks for none of them)."""
    if not (params.logit_bias or params.frequency_penalty or params.presence_penalty):
        return logits
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
    if tokens and (params.frequency_penalty or params.presence_penalty):
        ids, counts = torch.tensor(tokens, device=logits.device).unique(return_counts=True)
        logits[ids] -= counts.float() * params.frequency_penalty + params.presence_penalty
    return logits


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For rows of logits [N, vocab] and the token each row chose [N]: (the chosen token's log-probability, the k
    most likely tokens with theirs), from the log-softmax of the logits as they are."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, chosen[:, None])[:, 0].tolist()
    if not k:
        return [(c, []) for c in picked]
    values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(picked, ids.tolist(), values.tolist())]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [vocab]: argmax at temperature 0, else temperature, top-k, then top-p (nucleus)."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [B, vocab] (the first index on ties, as torch's). On CPU through numpy:
    torch's CPU argmax over a 49k vocabulary took ~190 us a row in bf16 (~100 in fp32) against numpy's ~25, 2 % of a
    SmolLM2 batch-1 step, and 3 ms of every batch-32 step."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist()
    return logits.float().numpy().argmax(-1).tolist()


def sample_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One token per row of logits [B, vocab] with the same parameters for every row, drawn together from torch's
    global generator (what `sample` does row by row, in one call: on a batch of 128 rows the per-row calls took
    longer than the model's decode step)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True, dim=-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1)[:, 0]


def accept_token(token: int, tokens: list[int], p: SamplingParams, eos_ids: set[int],
                 decode) -> tuple[str | None, str | None]:
    """Append `token` to a sequence unless it ends it. Returns (finish reason or None, the text cut before a stop
    string when one ended it, else None). `decode` turns token ids into text (only called when `p.stop` is set)."""
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop", None
    tokens.append(token)
    if p.stop:
        text = decode(tokens)
        cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            return "stop", text[:cut]
    return ("length" if len(tokens) >= p.max_tokens else None), None
