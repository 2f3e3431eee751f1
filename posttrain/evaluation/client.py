"""Text production for eval suites through an OpenAI-compatible server, with the official `openai` client.

The same code talks to `posttrain serve`, `vllm serve` and llama.cpp's server (`llama_cpp.server`). Requests go
out concurrently (the server batches them continuously); each suite prompt is one chat request, and a suite that
samples asks for `n` choices (and for the missing ones one at a time, from a server that answers one).
`latency_probe` times streamed requests one at a time, from the client's side: time to first token and decode
tokens per second as a user of the endpoint sees them.

Progress is reported per checkpoint, not per request: a `CheckpointProgress` counts every request of every suite
and of the latency probe (one bar on a terminal, one summary line in the log), and posttrain.serve.server.quiet_http_logs keeps the HTTP
stack's one-line-per-request INFO records (httpx's `HTTP Request: POST ...`, uvicorn's access log) out of the output.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger("posttrain")
# the openai client sends through httpx2 (older releases: httpx), each over httpcore2 / httpcore; uvicorn serves
class CheckpointProgress:
    """Requests done / total for one checkpoint, across its suites and its latency probe.

    A tqdm bar on `stream` (stderr) when it is a terminal, none otherwise; `close` logs one summary line either way,
    so a log file gets one line per checkpoint rather than one per request.
    """

    def __init__(self, label: str, total: int, stream=None):
        stream = sys.stderr if stream is None else stream
        self.label, self.total, self.done = label, total, 0
        self.started = time.perf_counter()
        interactive = bool(getattr(stream, "isatty", lambda: False)())
        self.bar = tqdm(total=total, desc=f"eval {label}", unit="req", file=stream, leave=False,
                        dynamic_ncols=True, disable=not interactive)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)

    def stage(self, name: str) -> None:
        """Name the part being run (a suite, the latency probe) beside the bar."""
        self.bar.set_postfix_str(name, refresh=False)

    def close(self, detail: str = "") -> str:
        self.bar.close()
        line = (f"eval {self.label}: {self.done}/{self.total} requests in {time.perf_counter() - self.started:.1f} s"
                + (f"; {detail}" if detail else ""))
        log.info(line)
        return line


def reply_text(message) -> str:
    """The reply as the model wrote it: the reasoning the server split off goes back inside its think block, so
    scorers see what they saw from local generation (verifiers read the answer after `</think>`)."""
    reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
    content = message.content or ""
    if not reasoning:
        return content
    return f"<think>\n{reasoning}" + (f"\n</think>\n\n{content}" if content else "")


async def _chat_all(client, model: str, conversations, max_tokens: int | list[int], concurrency: int, samples: int,
                    temperature: float, seed: int, desc: str, progress=None, extra_body: dict | None = None):
    gate = asyncio.Semaphore(concurrency)
    bar = progress if progress is not None else tqdm(total=len(conversations), desc=desc, unit="prompt",
                                                     leave=False, disable=None)

    async def one(index: int, messages):
        async with gate:
            kwargs = {"temperature": 0.0} if not samples else {"temperature": temperature, "top_p": 1.0,
                                                                "n": samples, "seed": seed + 1000 * index}
            if extra_body:
                kwargs["extra_body"] = extra_body
            kwargs["max_tokens"] = max_tokens[index] if isinstance(max_tokens, list) else max_tokens
            reply = await client.chat.completions.create(model=model, messages=messages, **kwargs)
            texts = [reply_text(c.message) for c in sorted(reply.choices, key=lambda c: c.index)]
            # A server that ignores `n` (llama.cpp's answers one choice) gets the rest asked for one at a time.
            for extra in range(len(texts), samples):
                kwargs.update(n=1, seed=seed + 1000 * index + extra)
                more = await client.chat.completions.create(model=model, messages=messages, **kwargs)
                texts.append(reply_text(more.choices[0].message))
            bar.update(1)
            return texts if samples else texts[0]

    try:
        return await asyncio.gather(*(one(i, m) for i, m in enumerate(conversations)))
    finally:
        if progress is None:
            bar.close()


def chat_replies(base_url: str, api_key: str, model: str, conversations: list[list[dict]],
                 max_tokens: int | list[int], concurrency: int = 64, samples: int = 0, temperature: float = 1.0, seed: int = 0,
                 desc: str = "eval", timeout: float = 600.0, progress: CheckpointProgress | None = None,
                 extra_body: dict | None = None) -> list[str] | list[list[str]]:
    """One greedy reply per conversation (samples=0), or `samples` replies each drawn at `temperature`, each at most
    `max_tokens` long (one limit for all, or one per conversation). Each reply advances `progress` (else a bar of
    this call's own, shown on a terminal only)."""
    from openai import AsyncOpenAI

    async def run():
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0) as client:
            return await _chat_all(client, model, conversations, max_tokens, concurrency, samples, temperature,
                                   seed, desc, progress, extra_body)

    return asyncio.run(run())


def latency_probe(base_url: str, api_key: str, model: str, messages: list[dict], requests: int = 8,
                  max_tokens: int = 32, timeout: float = 120.0, progress: CheckpointProgress | None = None) -> dict:
    """Median time to first token (ms) and decode tokens/s over `requests` streamed greedy requests sent one after
    another, each running to `max_tokens` (ignore_eos), timed on the client; each request advances `progress`."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    ttfts, rates = [], []
    for _ in range(requests):
        start = time.perf_counter()
        first = last = None
        tokens = 0
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = 0  # content chunks: the token count when the server sends no usage (llama.cpp's sends none)
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            delta, now = chunk.choices[0].delta, time.perf_counter()
            chunks += bool(delta.content)
            if first is None and (delta.content or (delta.model_extra or {}).get("reasoning_content")
                                  or delta.tool_calls):
                first = now
            if chunk.choices[0].finish_reason is not None:
                last = now  # the last token: sent with the finish reason (held-back text included)
        if last is None:
            raise RuntimeError(f"{model}: the latency probe's streamed request ended without a finish reason")
        if first is None:  # only tokens that decode to no text (special tokens): the reply's first text is its end
            first = last
        tokens = tokens or chunks
        ttfts.append(first - start)
        if progress is not None:
            progress.update(1)
        if tokens > 1 and last is not None and last > first:
            rates.append((tokens - 1) / (last - first))
    client.close()
    return {"ttft_ms": 1000 * statistics.median(ttfts),
            "decode_tok_s": statistics.median(rates) if rates else None,
            "requests": requests, "max_tokens": max_tokens}
