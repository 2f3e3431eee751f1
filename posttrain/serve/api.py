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

import contextlib
import hmac
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HTTPRequest  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from posttrain.serve.core import CoreClient
from posttrain.serve.sampling import SamplingParams
from posttrain.serve.parsing import opens_thinking
from posttrain.serve.protocol import APIError, ChatRequest, CompletionRequest, Sampling, parse_body
from posttrain.serve.replies import TokenText, build_response
from posttrain.serve.streaming import run_all, stream_events

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
