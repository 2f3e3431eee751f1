"""The engine core in a process of its own: the model and its scheduler on one end of a pipe, the HTTP front end on
the other (vLLM V1's split, on a multiprocessing pipe).

In one process, the front end's Python (HTTP parsing, request validation, the chat template, tokenizing and
detokenizing, JSON) and the engine thread's (a few calls per layer per step) take turns on one interpreter lock:
on the tiny model at 32 clients that held the server to a quarter of the engine's own tokens/s. Here each has its
own process and its own lock.

`CoreClient` is what the front end holds. It has the Scheduler's interface (`submit`, `cancel`, `close`,
`queue_length`) over `scheduler.Request` objects, so the HTTP layer is the same for both: the client's reader
thread appends each token the core reports to the request and runs its callbacks there.

The pipe carries pickled tuples:
    front -> core   ("submit", id, prompt, params) | ("cancel", id) | ("close",)
    core -> front   ("ready", info) once the model is loaded, or ("failed", message)
                    ("step", events, rows busy, requests waiting) after each engine turn that did something,
                    events being ("token", id, token, log-probabilities or None), ("prompt", id, the prompt's
                    log-probabilities) before the first token of a request that asked for them, and
                    ("finish", id, finish reason, stop text, error, stop token, its log-probabilities or None)
One message per engine step, not per token. The core is a child of the front end: it exits when the pipe closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import threading
import time

import torch

from posttrain.config_schema import ServeCfg
from posttrain.planner.config import load_config
from posttrain.planner.plan import plan_model
from posttrain.serve.engine import load_engine
from posttrain.serve.model import KVCache
from posttrain.serve.scheduler import Request, Scheduler, check_request

log = logging.getLogger("posttrain")


def engine_threads(requested: int) -> int:
    """`serve.threads`, where 0 means every core this process may use but one (at least one)."""
    if requested > 0:
        return requested
    return max(1, len(os.sched_getaffinity(0)) - 1)


def build_engine(opts: ServeCfg, weights: str):
    """(the engine on `weights`, a line on its memory)."""
    engine = load_engine(weights, dtype=opts.dtype, max_batch=opts.max_batch, quant_backend=opts.quant_backend,
                         kv_dtype=None if opts.kv_dtype == "auto" else opts.kv_dtype)
    engine.max_len = min(opts.max_len, engine.max_len)
    engine.reserve(1)
    report = memory_report(engine, weights)
    mb = lambda n: f"{n / 1e6:,.0f} MB" if n is not None else "n/a"  # noqa: E731
    line = (f"weights {mb(report['weights_bytes'])} ({opts.dtype}), KV cache {mb(report['kv_bytes_now'])} now, up "
            f"to {mb(report['kv_bytes_max'])} ({engine.max_batch} rows x {engine.max_len} positions x "
            f"{report['kv_bytes_per_token']} B); peak resident {mb(report['peak_rss_bytes'])}; the planner's "
            f"estimate: weights {mb(report['planned_weights_bytes'])}, KV cache {mb(report['planned_kv_bytes'])}")
    return engine, line


def memory_report(engine, weights: str) -> dict:
    """What a loaded engine holds, beside what the planner predicts for it: weight bytes (parameters and quantized
    buffers, not the cache or rotary tables), the KV cache now and at max_batch x max_len, the process's peak
    resident memory. The planner's figures are None for a quantized directory (its format is the export's)."""
    model = engine.model
    skip = {id(b) for m in model.modules() if isinstance(m, KVCache) for b in m.buffers()}
    skip |= {id(getattr(model, n)) for n in ("rope_cos", "rope_sin", "slots", "head_offsets", "inv_freq")
             if isinstance(getattr(model, n, None), torch.Tensor)}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    per_token = model.kv_bytes_per_token()
    config = load_config(weights)
    planned_weights = planned_kv = None
    if "quantization_config" not in config:
        kv_dtype = str(model.kv_dtype).removeprefix("torch.")
        plan = plan_model(config, kv_dtype=kv_dtype, contexts=[engine.max_len], batches=[engine.max_batch])
        fmt = {"float32": "fp32", "bfloat16": "bf16"}.get(str(model.model.norm.weight.dtype).removeprefix("torch."))
        planned_weights = next((w.bytes for w in plan.weights if w.format == fmt), None)
        planned_kv = plan.kv.table[0]["kv_bytes"]
    return {"weights_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "kv_bytes_now": model.cache_bytes(), "kv_bytes_per_token": per_token,
            "kv_bytes_max": per_token * engine.max_batch * engine.max_len,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "planned_weights_bytes": planned_weights, "planned_kv_bytes": planned_kv}


# ---- the core process ----------------------------------------------------------------------------------------------
def run_core(opts: ServeCfg, weights: str, conn) -> None:
    """The core process's main: load the engine, report ready, then pass requests to the scheduler until "close"
    or until the front end's end of the pipe goes away."""
    # the engine process's own: transformers is imported by then (core_preload)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the front end reports the load; a bar from a child only garbles its output
    torch.set_num_threads(engine_threads(opts.threads))
    try:
        engine, memory_line = build_engine(opts, weights)
    except Exception as err:  # reported to the front end, which raises it where the server was asked for
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    send_lock = threading.Lock()
    outbox: list[tuple] = []  # the events of the engine turn under way (appended on the engine thread)
    requests: dict[int, Request] = {}  # running or waiting, by id

    prompts_sent: set[int] = set()

    def prompt_scores(request: Request) -> None:
        if request.prompt_logprobs is not None and request.id not in prompts_sent:
            prompts_sent.add(request.id)
            outbox.append(("prompt", request.id, request.prompt_logprobs))

    def on_token(request: Request) -> None:
        prompt_scores(request)
        entry = request.logprobs[-1] if request.params.top_logprobs is not None and request.logprobs else None
        outbox.append(("token", request.id, request.tokens[-1], entry))

    def on_finish(request: Request) -> None:
        prompt_scores(request)
        prompts_sent.discard(request.id)
        entry = request.logprobs[-1] if request.stop_token is not None and request.logprobs else None
        outbox.append(("finish", request.id, request.finish_reason, request.stop_text, request.error,
                       request.stop_token, entry))
        requests.pop(request.id, None)

    def on_step(busy: int, waiting: int) -> None:
        send(("step", outbox[:], busy, waiting))
        outbox.clear()

    def send(message) -> None:
        with send_lock:
            try:
                conn.send(message)
            except (BrokenPipeError, OSError):  # the front end is gone; the receive loop below ends too
                pass

    scheduler = Scheduler(engine, on_step=on_step)
    conn.send(("ready", {"max_len": engine.max_len, "max_batch": engine.max_batch,
                         "vocab_size": engine.model.args.vocab_size, "memory": memory_line}))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "close":
                break
            if message[0] == "cancel":
                request = requests.get(message[1])
                if request is not None:
                    scheduler.cancel(request)
                continue
            _, rid, prompt, params = message
            request = Request(prompt, params, on_token=on_token, on_finish=on_finish, id=rid)
            requests[rid] = request
            try:
                scheduler.submit(request)
            except (ValueError, RuntimeError) as err:  # the front end checked it; a shutdown under way remains
                requests.pop(rid, None)
                send(("step", [("finish", rid, "error", None, str(err), None, None)], 0, 0))
    finally:
        scheduler.close()
        if outbox:
            send(("step", outbox[:], 0, 0))
        engine.release()


# ---- the front end's side ------------------------------------------------------------------------------------------
class CoreClient:
    """The engine core as the front end sees it: starts the core process, submits requests to it and hears their
    tokens back. `on_step(busy, waiting)` runs after each reported step (the server's metrics)."""

    def __init__(self, opts: ServeCfg, weights: str, startup_timeout: float = 600.0):
        # forkserver: the server process imports torch and the engine once (set_forkserver_preload), and every core
        # is a fork of it, so an eval that serves one checkpoint after another pays that import once. A plain fork
        # of the caller would copy a process whose OpenMP pool (training, eval's likelihood pass) may already run.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["posttrain.serve.core_preload"])
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=run_core, args=(opts, weights, child), name="posttrain-engine",
                                   daemon=True)
        self.process.start()
        child.close()
        self.model, self.startup_timeout = opts.model, startup_timeout
        self.on_step = None
        self.info: dict | None = None
        self.pending: dict[int, Request] = {}
        self.waiting = 0
        self.send_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="posttrain-core-reader", daemon=True)

    def wait_ready(self) -> "CoreClient":
        """Block until the engine process has loaded the model (the caller may do its own loading meanwhile);
        raises RuntimeError if it failed or exited first."""
        self.info = self._wait_ready(self.model, self.startup_timeout)
        self.max_len, self.max_batch = self.info["max_len"], self.info["max_batch"]
        self.reader.start()
        return self

    def _wait_ready(self, model: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process for {model} exited with {self.process.exitcode} before it "
                                   f"was ready")
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the engine process for {model} was not ready within {timeout:.0f} s")
        kind, payload = self.conn.recv()
        if kind == "failed":
            self.process.join(10)
            raise RuntimeError(f"{model}: the engine could not load: {payload}")
        return payload

    # ---- the Scheduler's interface ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request; the same checks as `Scheduler.submit`, here, so a bad one fails before it is sent."""
        check_request(request, self.max_len)
        with self.send_lock:
            if not self.alive:
                raise RuntimeError("the engine process is not running")
            self.pending[request.id] = request
            self.conn.send(("submit", request.id, request.prompt, request.params))
        return request

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        if request.id in self.pending:
            self._send(("cancel", request.id))

    @property
    def queue_length(self) -> int:
        return self.waiting

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and self.reader.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        self._send(("close",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.conn.close()
        if self.reader.is_alive():
            self.reader.join(timeout)

    # ---- the reader thread ------------------------------------------------------------------------------------
    def _send(self, message) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):
                pass

    def _read(self) -> None:
        while True:
            try:
                _, events, busy, waiting = self.conn.recv()
            except (EOFError, OSError):
                break
            now = time.perf_counter()
            for kind, rid, *payload in events:
                request = self.pending.get(rid)
                if request is None:
                    continue
                if kind == "prompt":
                    request.prompt_logprobs = payload[0]
                    continue
                if kind == "token":
                    token, entry = payload
                    request.tokens.append(token)
                    if entry is not None:
                        request.logprobs.append(entry)
                    request.first_token_at = request.first_token_at or now
                    request.last_token_at = now
                    callback = request.on_token
                else:
                    request.finish_reason, request.stop_text, request.error, request.stop_token, entry = payload
                    if entry is not None:
                        request.logprobs.append(entry)
                    del self.pending[rid]
                    callback = request.on_finish
                if callback is not None:
                    try:
                        callback(request)
                    except Exception:  # a listener's bug must not stop the reader
                        log.exception("request callback failed")
            self.waiting = waiting
            if self.on_step is not None:
                self.on_step(busy, waiting)
        # the core is gone (closed, or died): nothing pending will finish any more
        for request in list(self.pending.values()):
            request.finish_reason, request.error = "error", "the engine process exited"
            self.pending.pop(request.id, None)
            if request.on_finish is not None:
                request.on_finish(request)

