"""Requests through the engine core for the HTTP layer: one scheduler request per (prompt, choice), callbacks that
hand the core client's events to the event loop, a whole reply awaited, or a server-sent-event stream.
`served` below is the app's `posttrain.serve.api.Served`: the core client, the tokenizer, the metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from posttrain.serve.sampling import SamplingParams
from posttrain.serve.parsing import IncrementalText, ReplyParser
from posttrain.serve.protocol import APIError
from posttrain.serve.replies import chat_logprobs, completion_logprobs, echo_text, final_text, scored_tokens, usage
from posttrain.serve.scheduler import Request


def requests_for(served, prompts, params: SamplingParams, n: int, on_event) -> list[Request]:
    """One scheduler request per (prompt, choice); choice k of a seeded request uses seed + k."""
    out = []
    for i, prompt in enumerate(prompts):
        for k in range(n):
            p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + k})
            index = i * n + k
            out.append(Request(prompt, p, on_token=on_event(index, "token"), on_finish=on_event(index, "finish")))
    return out


def listener(served, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, stream: bool):
    """Callbacks for the core client's reader thread: record metrics there, then pass (index, kind) to the event loop. Only a
    stream hears of each token; a whole reply waits for the finish alone, so a non-streamed request wakes the
    event loop once rather than once per token."""
    metrics = served.metrics

    def on_event(index: int, kind: str):
        last = [None]

        def callback(request: Request):
            if kind == "token":
                metrics.tokens.inc()
                if last[0] is None:
                    metrics.ttft.observe(request.ttft_s)
                else:
                    metrics.tbt.observe(request.last_token_at - last[0])
                last[0] = request.last_token_at
                if not stream:
                    return
            loop.call_soon_threadsafe(queue.put_nowait, (index, kind))
        return callback
    return on_event


async def run_all(served, prompts, params, n: int) -> list[Request]:
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    requests = requests_for(served, prompts, params, n, listener(served, loop, queue, stream=False))
    served.metrics.in_flight.inc()
    try:
        submit(served, requests)
        remaining = len(requests)
        while remaining:
            _, kind = await queue.get()
            remaining -= kind == "finish"
    finally:
        served.metrics.in_flight.dec()
        for r in requests:
            served.core.cancel(r)  # no-op for finished ones; frees rows if the client went away
    return requests


def submit(served, requests: list[Request]) -> None:
    for r in requests:
        try:
            served.core.submit(r)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        except RuntimeError as err:  # the engine process is gone
            raise APIError(503, str(err), type_="server_error") from None
        served.metrics.prompt_tokens.inc(len(r.prompt))


class StreamedLogprobs:
    """Per choice of a stream: the log-probabilities of the tokens that arrived since its last chunk, the running
    text_offset, and the prompt's (echo) ahead of its first token."""

    def __init__(self, served, requests: list[Request], chat, body):
        self.served, self.requests, self.chat = served, requests, chat
        self.asked = body.logprobs if chat else body.logprobs is not None
        self.reported = [0] * len(requests)  # tokens whose log-probabilities went out
        self.offsets = [0] * len(requests)  # text_offset of the next token
        self.echoed = [bool(chat) or not body.echo] * len(requests)

    def new(self, index: int) -> dict | None:
        if not self.asked:
            return None
        r, start = self.requests[index], self.reported[index]
        self.reported[index] = end = len(r.logprobs)
        ids, entries = scored_tokens(r)[start:end], r.logprobs[start:end]
        if self.chat:
            return chat_logprobs(self.served, ids, entries)
        out = completion_logprobs(self.served, ids, entries, self.offsets[index])
        self.offsets[index] += sum(map(len, out["tokens"]))
        return out

    def echo_due(self, index: int) -> bool:
        return not self.echoed[index]

    def echo(self, index: int) -> dict | None:
        """The prompt's log-probabilities (with echo on /v1/completions), once, before the choice's first token."""
        self.echoed[index] = True
        if not self.asked:
            return None
        out = completion_logprobs(self.served, self.requests[index].prompt, self.requests[index].prompt_logprobs)
        self.offsets[index] = sum(map(len, out["tokens"]))
        return out


async def stream_events(served, http_request, body, prompts, params, chat):
    """Server-sent events: one chunk per new piece of text per choice, a last chunk with the finish reason,
    optionally a usage chunk, then `data: [DONE]`."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    requests = requests_for(served, prompts, params, body.n, listener(served, loop, queue, stream=True))
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    hold = max((len(s) for s in params.stop), default=1) - 1  # text that may still turn into a stop string
    sent = [0] * len(requests)
    parsers = [ReplyParser(chat["thinking"], chat["tools"]) if chat else None for _ in requests]
    texts = [IncrementalText(served.tokenizer) for _ in requests]

    scores = StreamedLogprobs(served, requests, chat, body)

    def chunk(index: int, delta: dict | str, finish: str | None = None, logprobs: dict | None = None) -> str:
        if chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish}
            if scores.asked:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": served.name,
                                      "choices": [choice]}) + "\n\n"

    def chat_delta(reasoning: str, content: str) -> dict:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    served.metrics.in_flight.inc()
    try:
        submit(served, requests)
        if chat:
            for index in range(len(requests)):
                yield chunk(index, {"role": "assistant", "content": ""})
        remaining = len(requests)
        while remaining:
            index, event = await queue.get()
            r = requests[index]
            if scores.echo_due(index) and r.finish_reason != "error":
                yield chunk(index, echo_text(served, r), logprobs=scores.echo(index))
            if event == "token":
                text = texts[index].update(r.tokens)
                if chat:
                    delta = chat_delta(*parsers[index].feed(text[: len(text) - hold] if hold else text))
                    if delta:
                        yield chunk(index, delta, logprobs=scores.new(index))
                else:
                    upto = len(text) - hold
                    if upto > sent[index]:
                        yield chunk(index, text[sent[index]:upto], logprobs=scores.new(index))
                        sent[index] = upto
                continue
            remaining -= 1
            if r.finish_reason == "error":
                yield "data: " + json.dumps(APIError(500, f"generation failed: {r.error}", "server_error").body())
                yield "\n\n"
                continue
            text = final_text(served, r)
            if chat:
                reasoning, content, calls = parsers[index].finish(text)
                if not body.parallel_tool_calls:
                    calls = calls[:1]
                delta = chat_delta(reasoning, content)
                if calls:
                    delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(calls)]
                yield chunk(index, delta, "tool_calls" if calls else r.finish_reason, scores.new(index))
            else:
                yield chunk(index, text[sent[index]:], r.finish_reason, scores.new(index))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": served.name,
                                         "choices": [], "usage": usage(prompts, requests)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        served.metrics.in_flight.dec()
        for r in requests:
            served.core.cancel(r)
