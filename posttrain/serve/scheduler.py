"""Continuous batching: many requests share one engine, a request joins the running batch at the next step.

One thread owns the model. Each turn of its loop it
1. admits waiting requests into free rows of the KV cache (the lowest free rows first) and prefills them together,
   which also gives each its first token;
2. runs one decode step over rows 0..h-1, h = 1 + the highest busy row, so the cache is read as views; a free row
   inside that range decodes a dummy token at position 0, which the next prefill into the row overwrites;
3. samples each busy row's next token with that request's own parameters, and retires finished requests, freeing
   their rows for step 1 of the next turn.

A row's stale keys from an earlier request never leak: the causal mask over cache positions only lets a row see
positions up to its own, all of which its own prefill and decode steps wrote. So a greedy request gets the same
tokens alone or among others (tests/integration/test_server.py checks this with 64 concurrent requests).

Callers hear about progress through callbacks run on the engine thread (`on_token`, `on_finish`); in the server
the scheduler runs in the engine process (posttrain.serve.core), which batches them into one message per step. Why not vLLM's or TGI's schedulers: neither runs on this CPU, and the engine's
static cache with per-row positions makes the scheduler a short loop.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from posttrain.serve.engine import Engine
from posttrain.serve.sampling import SamplingParams, accept_token, adjusted, greedy_tokens, sample, top_logprobs

log = logging.getLogger("posttrain")


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[["Request"], None] | None = None  # after each accepted token (engine thread)
    on_finish: Callable[["Request"], None] | None = None  # once, when done or failed (engine thread)
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None
    stop_text: str | None = None  # the text cut before a stop string, when one ended the request
    # with params.top_logprobs: one (log-probability, [(token, log-probability)] of the most likely) per token
    logprobs: list = field(default_factory=list)
    # with params.prompt_logprobs: the same per prompt token, None for the first (set before the first token)
    prompt_logprobs: list | None = None
    # the end-of-sequence or stop token that ended the request (not in `tokens`, not in the text); with
    # params.top_logprobs its entry ends `logprobs`, as vLLM and OpenAI report it (lm-eval reads up to it)
    stop_token: int | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    # engine state
    row: int = -1
    pos: int = 0  # cache position of the newest token, which is fed to the next decode step
    generator: torch.Generator | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def tbt_s(self) -> float | None:
        if self.first_token_at is None or len(self.tokens) < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (len(self.tokens) - 1)


def check_request(request: Request, max_len: int) -> None:
    """Raise ValueError on bad sampling parameters, an empty prompt or one too long for the context."""
    request.params.check()
    if not request.prompt:
        raise ValueError("the prompt is empty")
    if len(request.prompt) + request.params.max_tokens > max_len:
        raise ValueError(f"{len(request.prompt)} prompt tokens + max_tokens {request.params.max_tokens} exceed "
                         f"the context of {max_len} tokens")


class Scheduler:
    """Runs requests on `engine` in a background thread; `submit` is safe from any thread."""

    def __init__(self, engine: Engine, max_prefill_tokens: int = 8192,
                 on_step: Callable[[int, int], None] | None = None):
        self.engine = engine
        self.rows = engine.max_batch
        self.max_prefill_tokens = max_prefill_tokens  # tokens (rows x padded width) per prefill call
        self.on_step = on_step  # (rows decoded, requests waiting) after every turn: the metrics
        self.waiting: collections.deque[Request] = collections.deque()
        self.busy: dict[int, Request] = {}  # row -> request
        self.lock = threading.Condition()
        self.stopping = False
        self.steps = 0  # decode steps run (tests read it to see batching happen)
        self.max_busy = 0  # the most rows decoded together so far
        engine.reserve(1)  # the cache grows as admitted requests need it (Engine.reserve)
        self.thread = threading.Thread(target=self._loop, name="posttrain-engine", daemon=True)
        self.thread.start()

    # ---- the public side -------------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request (checked first: raises ValueError on bad parameters or a prompt too long)."""
        check_request(request, self.engine.max_len)
        with self.lock:
            if self.stopping:
                raise RuntimeError("the engine is shutting down")
            self.waiting.append(request)
            self.lock.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request at the next step (a client that went away); its row is freed."""
        request.cancelled = True

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    def close(self, timeout: float = 10.0) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not self.busy:
                    self.lock.wait(timeout=1.0)
                if self.stopping:
                    break
            decoded = 0
            try:
                self._admit()
                decoded = len(self.busy)
                if decoded:
                    self._decode()
            except Exception as err:  # a bug or an out-of-memory: fail the running requests, keep serving
                log.exception("engine step failed")
                for request in list(self.busy.values()):
                    self._finish(request, "error", error=f"{type(err).__name__}: {err}")
            if self.on_step is not None:
                self.on_step(decoded, len(self.waiting))
        for request in list(self.busy.values()) + list(self.waiting):
            self._finish(request, "cancelled", error="the server is shutting down")

    def _admit(self) -> None:
        """Move waiting requests into free rows and prefill them, as many per call as the token budget allows."""
        while True:
            free = [r for r in range(self.rows) if r not in self.busy]
            batch: list[Request] = []
            with self.lock:
                while self.waiting and len(batch) < len(free):
                    nxt = self.waiting[0]
                    width = max([len(q.prompt) for q in batch] + [len(nxt.prompt)])
                    if batch and width * (len(batch) + 1) > self.max_prefill_tokens:
                        break
                    batch.append(self.waiting.popleft())
            batch = [q for q in batch if not q.cancelled or self._finish(q, "cancelled")]
            if not batch:
                return
            for request, row in zip(batch, free):
                request.row = row
                request.pos = len(request.prompt)
                if request.params.seed is not None:
                    request.generator = torch.Generator(device=self.engine.device).manual_seed(request.params.seed)
                self.busy[row] = request
            self.engine.reserve(max(len(q.prompt) + q.params.max_tokens for q in batch), keep=True)
            scored = [q for q in batch if q.params.prompt_logprobs is not None]
            batch = [q for q in batch if q.params.prompt_logprobs is None]
            for request in scored:  # one at a time: the logits of every prompt position are [S, vocab]
                rows = torch.tensor([request.row], device=self.engine.device)
                logits = self.engine.prefill([request.prompt], rows=rows, every_position=True)[0]
                request.prompt_logprobs = self.engine.prompt_logprobs(request.prompt, logits,
                                                                      request.params.prompt_logprobs)
                if request.params.max_tokens == 0:  # the prompt scored, nothing to generate
                    self._finish(request, "length")
                else:
                    self._accept([request], logits[len(request.prompt) - 1][None])
            if batch:
                rows = torch.tensor([q.row for q in batch], device=self.engine.device)
                logits = self.engine.prefill([q.prompt for q in batch], rows=rows)
                self._accept(batch, logits)

    def _decode(self) -> None:
        high = max(self.busy) + 1
        tokens = torch.zeros(high, dtype=torch.long)
        pos = torch.zeros(high, dtype=torch.long)
        for row, request in self.busy.items():
            tokens[row], pos[row] = request.tokens[-1], request.pos
        device = self.engine.device
        logits = self.engine.decode_one_token(tokens.to(device), pos.to(device), int(pos.max()) + 1)
        self.steps += 1
        self.max_busy = max(self.max_busy, len(self.busy))
        order = sorted(self.busy)
        for request in self.busy.values():
            request.pos += 1
        self._accept([self.busy[r] for r in order], logits[order])

    def _accept(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Pick each request's next token from its logits row (greedy rows in one argmax) and append it."""
        greedy = greedy_tokens(logits)
        chosen = []
        for i, request in enumerate(requests):
            p = request.params
            raw = logits[i]
            row = adjusted(raw, p, request.tokens)
            if p.temperature == 0:
                chosen.append(greedy[i] if row is raw else int(row.argmax()))
            else:
                chosen.append(sample(row, p, request.generator))
        scored = [i for i, r in enumerate(requests) if r.params.top_logprobs is not None]
        entries = {}
        if scored:  # one log-softmax over the rows that report log-probabilities, the most any of them asks for
            k = max(requests[i].params.top_logprobs for i in scored)
            picked = torch.tensor([chosen[i] for i in scored], device=logits.device)
            for i, (lp, top) in zip(scored, top_logprobs(logits[scored], picked, k)):
                entries[i] = (lp, top[: requests[i].params.top_logprobs])
        now = time.perf_counter()
        for i, request in enumerate(requests):
            p, token = request.params, chosen[i]
            if request.cancelled:
                self._finish(request, "cancelled")
                continue
            before = len(request.tokens)
            reason, cut = accept_token(token, request.tokens, p, self.engine.eos_ids, self.engine._text)
            if reason == "stop" and cut is None and len(request.tokens) == before:
                request.stop_token = token
            if i in entries and (len(request.tokens) > before or request.stop_token is not None):
                request.logprobs.append(entries[i])
            if len(request.tokens) > before:
                request.first_token_at = request.first_token_at or now
                request.last_token_at = now
            if reason == "stop":
                request.stop_text = cut
                self._finish(request, "stop")
                continue
            if request.on_token is not None:
                request.on_token(request)
            if reason == "length":
                self._finish(request, "length")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> bool:
        request.finish_reason, request.error = reason, error
        if self.busy.get(request.row) is request:
            del self.busy[request.row]
        if request.on_finish is not None:
            try:
                request.on_finish(request)
            except Exception:  # a listener's bug must not stop the engine
                log.exception("on_finish callback failed")
        return False
