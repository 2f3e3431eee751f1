"""The OpenAI-compatible HTTP API over the engine: FastAPI routes, server-sent-event streams, Prometheus metrics.

    GET  /v1/models              the one model served
    POST /v1/completions         text in, text out (stream=true: server-sent events); `logprobs: k` and
                                 `echo` as OpenAI and vLLM define them (lm-eval-harness's log-likelihood tasks)
    POST /v1/chat/completions    messages in, the chat template applied here; reasoning inside <think>...</think>
                                 comes back as `reasoning_content`, <tool_call> blocks as `tool_calls`;
                                 `logprobs: true` with `top_logprobs: k`

Log-probabilities are the model's own (the engine's forward pass, temperature 1, before logit_bias and the
penalties: vLLM's default). A token's text is its own decoding; `text_offset` is the summed length of the token
texts before it, counted from the start of the returned text (the prompt's, with echo).
    GET  /health                 200 while the engine process runs
    GET  /metrics                Prometheus text: time to first token, time between tokens, tokens generated,
                                 requests in flight, queue length, rows decoding

Every request becomes one or more `scheduler.Request`s (n > 1 gives n), sent to the engine process
(`posttrain.serve.core`); its reader thread calls back on each token and the callbacks hand events to this event
loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HTTPRequest  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from posttrain.serve.core import CoreClient
from posttrain.serve.engine import SamplingParams
from posttrain.serve.parsing import IncrementalText, ReplyParser, opens_thinking
from posttrain.serve.protocol import APIError, ChatRequest, CompletionRequest, Sampling, parse_body
from posttrain.serve.scheduler import Request

log = logging.getLogger("posttrain")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Prometheus series of one server (its own registry, so two servers in one process do not collide)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("posttrain_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("posttrain_time_between_tokens_seconds", "Interval between consecutive tokens",
                             buckets=TBT_BUCKETS, registry=r)
        self.tokens = Counter("posttrain_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("posttrain_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.requests = Counter("posttrain_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("posttrain_requests_in_flight", "Generation requests being handled", registry=r)
        self.queue = Gauge("posttrain_queue_length", "Sequences waiting for a row of the KV cache", registry=r)
        self.running = Gauge("posttrain_running_sequences", "Sequences decoding in the current batch", registry=r)
        self.batch = Histogram("posttrain_batch_rows", "Sequences in the batch at each engine step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)

    def on_step(self, busy: int, waiting: int) -> None:
        self.running.set(busy)
        self.queue.set(waiting)
        if busy:
            self.batch.observe(busy)


class TokenText:
    """Each token id's own text, decoded once per distinct id (a log-probability table names every token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.tokenizer.decode([token])
        return text


@dataclass
class Served:
    core: CoreClient  # the engine process (the Scheduler's interface)
    tokenizer: object
    name: str
    root: str  # where the weights came from
    api_key: str | None
    metrics: Metrics
    created: int
    token_text: TokenText | None = None


class Authorize:
    """The API key check on /v1/ routes, as plain ASGI middleware: starlette's `@app.middleware("http")` would run
    every request through a task and a copy of its receive stream of its own, on the front end's one thread."""

    def __init__(self, app, api_key: str, metrics: Metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {api_key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(sent, self.expected):  # in constant time
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                self.metrics.requests.labels(scope["path"], "401").inc()
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(core: CoreClient, tokenizer, name: str, root: str = "", api_key: str | None = None):
    metrics = Metrics()
    core.on_step = metrics.on_step
    served = Served(core, tokenizer, name, root, api_key, metrics, int(time.time()), TokenText(tokenizer))
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        served.core.close()  # the engine process, its weights and its cache go with the server

    app = FastAPI(title="posttrain", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.served = served

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, err: APIError):
        metrics.requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    if api_key:
        app.add_middleware(Authorize, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        if not served.core.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": served.created,
                                            "owned_by": "posttrain", "root": root, "max_model_len": core.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = parse_body(CompletionRequest, await request.body())
        body.check()
        check_model(served, body.model)
        prompts = completion_prompts(served, body.prompt)
        return await respond(served, request, body, prompts, chat=None, endpoint="/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = parse_body(ChatRequest, await request.body())
        body.check()
        check_model(served, body.model)
        text = render_chat(served, body)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return await respond(served, request, body, [ids], chat={"thinking": opens_thinking(text),
                                                                 "tools": bool(body.tools)},
                             endpoint="/v1/chat/completions")

    async def respond(served, request, body, prompts, chat, endpoint):
        params = sampling_params(served, body, chat is not None, prompts)
        if body.stream:
            stream = stream_events(served, request, body, prompts, params, chat)
            metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(stream, media_type="text/event-stream")
        done = await run_all(served, prompts, params, body.n)
        metrics.requests.labels(endpoint, "200").inc()
        return build_response(served, body, prompts, done, chat)

    return app


# ---- request handling --------------------------------------------------------------------------------------------
def check_model(served: Served, model: str) -> None:
    if model != served.name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served.name}'.",
                       type_="NotFoundError", param="model", code="model_not_found")


def completion_prompts(served: Served, prompt) -> list[list[int]]:
    tok = served.tokenizer
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        ids = tok.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, f"prompt {i} is empty", param="prompt")
        if any(t < 0 or t >= served.core.info["vocab_size"] for t in ids):
            raise APIError(400, f"prompt {i} has token ids outside the vocabulary", param="prompt")
        out.append(ids)
    if not out:
        raise APIError(400, "prompt is empty", param="prompt")
    return out


def render_chat(served: Served, body: ChatRequest) -> str:
    tok = served.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, f"the model '{served.name}' has no chat template; use /v1/completions")
    tools = [t.model_dump() for t in body.tools] if body.tools and body.tool_choice != "none" else None
    try:
        return tok.apply_chat_template([m.for_template() for m in body.messages], tools=tools, tokenize=False,
                                       add_generation_prompt=True, **body.template_kwargs())
    except Exception as err:  # jinja's TemplateError (raise_exception in the template) and bad kwargs
        raise APIError(400, f"the chat template rejected the request: {err}", param="messages") from None


def sampling_params(served: Served, body: Sampling, chat: bool, prompts: list[list[int]]) -> SamplingParams:
    max_len = served.core.max_len
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens; the prompt has {longest}.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = getattr(body, "max_completion_tokens", None)
    max_tokens = body.max_tokens if max_tokens is None else max_tokens
    if max_tokens is None:
        max_tokens = max_len - longest if chat else 16  # OpenAI's defaults: the rest of the context, or 16
    echo = not chat and body.echo
    if max_tokens < (0 if echo else 1):
        raise APIError(400, f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}", param="max_tokens")
    if longest + max_tokens > max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens; {longest} prompt tokens + "
                            f"max_tokens {max_tokens} exceed it.", param="max_tokens", code="context_length_exceeded")
    if body.n > 1 and body.temperature == 0:
        raise APIError(400, "n > 1 needs temperature > 0 (greedy choices would all be the same)", param="n")
    if chat:
        top, prompt_top = (body.top_logprobs or 0) if body.logprobs else None, None
    else:
        top = body.logprobs
        # echo with max_tokens 0 and no logprobs still runs the prompt, its scores unread
        prompt_top = (body.logprobs if body.logprobs is not None else 0 if max_tokens == 0 else None) if echo else None
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          seed=body.seed, stop=body.stops(), stop_token_ids=list(body.stop_token_ids or []),
                          ignore_eos=body.ignore_eos, top_logprobs=top, prompt_logprobs=prompt_top,
                          logit_bias=body.token_bias(served.core.info["vocab_size"]),
                          frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty)


def requests_for(served: Served, prompts, params: SamplingParams, n: int, on_event) -> list[Request]:
    """One scheduler request per (prompt, choice); choice k of a seeded request uses seed + k."""
    out = []
    for i, prompt in enumerate(prompts):
        for k in range(n):
            p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + k})
            index = i * n + k
            out.append(Request(prompt, p, on_token=on_event(index, "token"), on_finish=on_event(index, "finish")))
    return out


def listener(served: Served, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, stream: bool):
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


async def run_all(served: Served, prompts, params, n: int) -> list[Request]:
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


def submit(served: Served, requests: list[Request]) -> None:
    for r in requests:
        try:
            served.core.submit(r)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        except RuntimeError as err:  # the engine process is gone
            raise APIError(503, str(err), type_="server_error") from None
        served.metrics.prompt_tokens.inc(len(r.prompt))


def final_text(served: Served, request: Request) -> str:
    if request.stop_text is not None:
        return request.stop_text
    return served.tokenizer.decode(request.tokens, skip_special_tokens=True)


def check_failed(requests: list[Request]) -> None:
    failed = next((r for r in requests if r.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"generation failed: {failed.error}", type_="server_error")


def usage(prompts, requests: list[Request]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(r.tokens) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(served: Served, ids: list[int], entries: list, offset: int = 0) -> dict:
    """OpenAI's completions `logprobs` object for tokens `ids` and their (log-probability, top) entries (None for
    a prompt's first token); offsets count from `offset`, the length of the token texts before these."""
    texts = [served.token_text(t) for t in ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else {served.token_text(t): lp for t, lp in e[1]} for e in entries],
            "text_offset": offsets}


def merge_logprobs(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(served: Served, ids: list[int], entries: list) -> dict:
    """OpenAI's chat `logprobs` object: per token its text, log-probability, UTF-8 bytes and the most likely."""
    def item(token: int, logprob: float) -> dict:
        text = served.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [dict(item(t, lp), top_logprobs=[item(u, v) for u, v in top])
                        for t, (lp, top) in zip(ids, entries)], "refusal": None}


def echo_text(served: Served, request: Request) -> str:
    return served.tokenizer.decode(request.prompt)


def scored_tokens(r: Request) -> list[int]:
    """The generated tokens the log-probabilities cover: the text's, then the stop token that ended it."""
    return r.tokens + ([r.stop_token] if r.stop_token is not None else [])


def text_choice(served: Served, body, index: int, r: Request) -> dict:
    """One /v1/completions choice: the completion (after the prompt, with echo) and its log-probabilities."""
    text, logprobs = final_text(served, r), None
    if body.logprobs is not None:
        logprobs = completion_logprobs(served, scored_tokens(r), r.logprobs)
    if body.echo:
        text = echo_text(served, r) + text
        if body.logprobs is not None:
            prompt = completion_logprobs(served, r.prompt, r.prompt_logprobs)
            logprobs = merge_logprobs(prompt, completion_logprobs(served, scored_tokens(r), r.logprobs,
                                                                  sum(map(len, prompt["tokens"]))))
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason}


def build_response(served: Served, body, prompts, requests: list[Request], chat) -> dict:
    check_failed(requests)
    rid, created = uuid.uuid4().hex, int(time.time())
    choices = []
    for index, r in enumerate(requests):
        if chat is None:
            choices.append(text_choice(served, body, index, r))
            continue
        parser = ReplyParser(chat["thinking"], chat["tools"])
        reasoning, content, calls = parser.finish(final_text(served, r))
        if not body.parallel_tool_calls:
            calls = calls[:1]
        message = {"role": "assistant", "content": content if content or not calls else None,
                   "reasoning_content": reasoning or None, "tool_calls": calls or None}
        choices.append({"index": index, "message": message,
                        "logprobs": chat_logprobs(served, scored_tokens(r), r.logprobs) if body.logprobs else None,
                        "finish_reason": "tool_calls" if calls else r.finish_reason})
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": served.name, "choices": choices, "usage": usage(prompts, requests)}


async def stream_events(served: Served, http_request, body, prompts, params, chat):
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

    scored = body.logprobs if chat else body.logprobs is not None
    reported = [0] * len(requests)  # tokens whose log-probabilities went out
    offsets = [0] * len(requests)  # text_offset of the next token
    echoed = [not (not chat and body.echo)] * len(requests)

    def new_logprobs(index: int) -> dict | None:
        """The log-probabilities of the tokens that arrived since the last chunk of this choice."""
        if not scored:
            return None
        r, start = requests[index], reported[index]
        reported[index] = len(r.logprobs)
        ids, entries = scored_tokens(r)[start:reported[index]], r.logprobs[start:reported[index]]
        if chat:
            return chat_logprobs(served, ids, entries)
        out = completion_logprobs(served, ids, entries, offsets[index])
        offsets[index] += sum(map(len, out["tokens"]))
        return out

    def chunk(index: int, delta: dict | str, finish: str | None = None, logprobs: dict | None = None) -> str:
        if chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish}
            if scored:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": served.name,
                                      "choices": [choice]}) + "\n\n"

    def echo_chunk(index: int) -> str:
        """The prompt (and its log-probabilities), ahead of a choice's first token: echo on /v1/completions."""
        echoed[index] = True
        r, logprobs = requests[index], None
        if scored:
            logprobs = completion_logprobs(served, r.prompt, r.prompt_logprobs)
            offsets[index] = sum(map(len, logprobs["tokens"]))
        return chunk(index, echo_text(served, r), logprobs=logprobs)

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
            if not echoed[index] and r.finish_reason != "error":
                yield echo_chunk(index)
            if event == "token":
                text = texts[index].update(r.tokens)
                if chat:
                    delta = chat_delta(*parsers[index].feed(text[: len(text) - hold] if hold else text))
                    if delta:
                        yield chunk(index, delta, logprobs=new_logprobs(index))
                else:
                    upto = len(text) - hold
                    if upto > sent[index]:
                        yield chunk(index, text[sent[index]:upto], logprobs=new_logprobs(index))
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
                yield chunk(index, delta, "tool_calls" if calls else r.finish_reason, new_logprobs(index))
            else:
                yield chunk(index, text[sent[index]:], r.finish_reason, new_logprobs(index))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": served.name,
                                         "choices": [], "usage": usage(prompts, requests)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        served.metrics.in_flight.dec()
        for r in requests:
            served.core.cancel(r)
