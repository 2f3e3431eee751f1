"""`posttrain serve`: start the OpenAI-compatible server on one artifact, model directory or hub id.

    posttrain serve runs/tiny/04-dpo                        our engine on 127.0.0.1:8000
    posttrain serve runs/tiny/05-quantize-int8 port=8001 api_key=secret max_batch=32
    posttrain serve runs/tiny/04-dpo backend=vllm           `vllm serve` on the same weights (GPU boxes)
    posttrain serve runs/tiny/07-quantize-gguf-q4_k_m backend=llamacpp
                                                            llama.cpp's server on the artifact's model.gguf

Options are `key=value` (or `--key value`): host (127.0.0.1), port (8000; 0 picks a free one), api_key (none:
requests need no key; also read from POSTTRAIN_API_KEY), dtype (float32 | bfloat16), max_batch (32 rows decoding
together), max_len (2048 tokens of context, at most the model's), kv_dtype (auto: the weights' | float32 | bfloat16),
backend (posttrain | vllm | llamacpp), served_model_name (default: the artifact's label, e.g. dpo-int8), quant_backend
(auto | own | aten | ...), threads (the engine process's torch threads; 0: all cores but one). The KV cache grows in blocks of 256 positions per row as requests need them, up to
max_batch x max_len; the server logs its weights, cache and peak memory at start, beside the planner's estimate.

Our server is two processes: the HTTP front end (this one) and the engine process (`posttrain.serve.core`), which
holds the model and runs the scheduler. `background_server` runs the front end in a thread of the calling process
(the evaluator uses it; the engine still gets a process of its own, so the evaluator's client shares no lock with
it) or, for backend=vllm, `vllm serve` as a subprocess, and for backend=llamacpp, llama-cpp-python's server
(`python -m llama_cpp.server`, built by `make llamacpp`) on a GGUF file; either way the caller gets a base URL for
the `openai` client. Our engine serves a GGUF artifact too, dequantized.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path

from posttrain.artifacts import read_manifest, verify_artifact
from posttrain.config_schema import ServeCfg
from posttrain.models.loading import check_model_reachable
from posttrain.quant.gguf_names import GGUF_NAME, gguf_file
from posttrain.registry import checkpoint_label

log = logging.getLogger("posttrain")
USAGE = __doc__


HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "uvicorn", "uvicorn.error", "uvicorn.access",
                "uvicorn.asgi")


def quiet_http_logs(level: int = logging.WARNING) -> None:
    """Raise the HTTP client and server loggers to `level`: at INFO they log one line per request."""
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(level)


def parse_options(argv: list[str]) -> ServeCfg:
    """`MODEL key=value ...` or `MODEL --key value ...`; unknown keys and bad values are errors."""
    names = {f.name: f for f in fields(ServeCfg)}
    values: dict = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--"):
            key = arg[2:].replace("-", "_")
            if "=" in key:
                key, value = key.split("=", 1)
            elif args:
                value = args.pop(0)
            else:
                raise ValueError(f"option {arg} needs a value")
        elif "=" in arg:
            key, value = arg.split("=", 1)
        elif "model" not in values:
            key, value = "model", arg
        else:
            raise ValueError(f"unexpected argument {arg!r}; options are key=value")
        if key not in names:
            raise ValueError(f"unknown serve option {key!r}; options: {', '.join(names)}")
        kind = int if names[key].type in ("int", int) else str
        try:
            values[key] = kind(value)
        except ValueError:
            raise ValueError(f"serve option {key}={value!r} must be an integer") from None
    opts = ServeCfg(**values)
    opts.api_key = opts.api_key or os.environ.get("POSTTRAIN_API_KEY") or None
    if not opts.model:
        raise ValueError("give the model to serve: an artifact directory, a model directory or a hub id")
    if opts.backend not in BACKENDS:
        raise ValueError(f"backend={opts.backend!r}: expected one of {', '.join(BACKENDS)}")
    if opts.kv_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"kv_dtype={opts.kv_dtype!r}: expected auto, float32 or bfloat16")
    if not 0 <= opts.port < 65536:
        raise ValueError(f"port={opts.port} is out of range")
    if opts.max_batch < 1 or opts.max_len < 2:
        raise ValueError("max_batch must be >= 1 and max_len >= 2")
    return opts


def resolve_model(location: str) -> tuple[str, str]:
    """(weights location, default served name) for a pipeline artifact (its model/ and manifest label), a model
    directory, or a hub id."""
    path = Path(location)
    if (path / "model").is_dir() and read_manifest(path) is not None:
        manifest = verify_artifact(path)
        return str(path / "model"), manifest.get("label") or checkpoint_label(manifest["stage"])
    if path.exists() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{location}: neither a pipeline artifact (model/ + manifest.json) nor a model "
                                f"directory (config.json)")
    check_model_reachable(location)
    return location, path.name if path.exists() else location


def build_app(opts: ServeCfg):
    """(the OpenAI-compatible app on our engine, its served name). The model is resolved once: an artifact's
    weights are hashed against its manifest here and nowhere else in the server."""
    # FastAPI loads only when a server starts in this process
    from posttrain.serve.api import create_app

    weights, default_name = resolve_model(opts.model)
    name = opts.served_model_name or default_name
    core, tokenizer = start_engine(opts, weights)
    return create_app(core, tokenizer, name, root=opts.model, api_key=opts.api_key), name


def start_engine(opts: ServeCfg, weights: str):
    """(the engine process on `weights`, as a `CoreClient`; the tokenizer the front end renders and decodes with)."""
    # both bring torch and transformers, which `posttrain serve --help` and the vLLM backend do without
    from posttrain.models.loading import load_tokenizer
    from posttrain.serve.core import CoreClient

    core = CoreClient(opts, weights)
    try:
        tokenizer = load_tokenizer(weights)  # while the engine process loads the weights
        core.wait_ready()
    except BaseException:
        core.close()
        raise
    log.info("serve: memory: %s", core.info["memory"])
    return core, tokenizer


def free_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(opts: ServeCfg) -> None:
    """Run until interrupted (the `posttrain serve` command)."""
    if opts.backend in SUBPROCESS_BACKENDS:
        proc = subprocess.Popen(SUBPROCESS_BACKENDS[opts.backend](opts, opts.port or pick_port(opts.host))[0])
        sys.exit(proc.wait())
    # uvicorn loads only when a server starts in this process
    import uvicorn

    app, name = build_app(opts)
    core = app.state.served.core
    sock = free_socket(opts.host, opts.port)
    port = sock.getsockname()[1]
    print(f"posttrain serve: '{name}' on http://{opts.host}:{port}/v1 (max_batch {core.max_batch}, context "
          f"{core.max_len}{', API key required' if opts.api_key else ''})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def pick_port(host: str) -> int:
    with contextlib.closing(free_socket(host, 0)) as sock:
        return sock.getsockname()[1]


def vllm_command(opts: ServeCfg, port: int) -> tuple[list[str], str]:
    """(`vllm serve` on the same weights and the same names, so one client talks to either server; served name)."""
    if importlib.util.find_spec("vllm") is None or shutil.which("vllm") is None:
        raise RuntimeError("backend=vllm needs vLLM installed (pip install vllm, on a GPU machine); "
                           "backend=posttrain runs on any machine")
    weights, default_name = resolve_model(opts.model)
    name = opts.served_model_name or default_name
    cmd = ["vllm", "serve", weights, "--host", opts.host, "--port", str(port), "--served-model-name", name,
           "--max-model-len", str(opts.max_len), "--max-num-seqs", str(opts.max_batch), "--dtype", {"float32": "float32"}.get(opts.dtype, "bfloat16"),
           "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if opts.api_key:
        cmd += ["--api-key", opts.api_key]
    return cmd, name


def llamacpp_command(opts: ServeCfg, port: int) -> tuple[list[str], str]:
    """(llama-cpp-python's OpenAI-compatible server on the artifact's GGUF file, under the same name; served name).
    It renders prompts with the chat template the file carries and decodes one request at a time."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError("backend=llamacpp needs llama-cpp-python with its server extras: run `make llamacpp`")
    weights, default_name = resolve_model(opts.model)
    path = gguf_file(weights)
    if path is None:
        raise ValueError(f"backend=llamacpp serves a GGUF file, and {weights} has no {GGUF_NAME}: quantize the "
                         "checkpoint with a GGUF variant (quantize:gguf-q4_k_m) or serve it with backend=posttrain")
    name = opts.served_model_name or default_name
    threads = opts.threads or max(1, (os.cpu_count() or 2) - 1)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", name,
           "--host", opts.host, "--port", str(port), "--n_ctx", str(opts.max_len), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--verbose", "False"]
    if opts.api_key:
        cmd += ["--api_key", opts.api_key]
    return cmd, name


SUBPROCESS_BACKENDS = {"vllm": vllm_command, "llamacpp": llamacpp_command}
BACKENDS = ("posttrain", *SUBPROCESS_BACKENDS)
HEALTH_PATH = {"vllm": "/health", "llamacpp": "/v1/models"}


@contextlib.contextmanager
def no_load_bars():
    """transformers' `Loading weights` bar off while the block runs: the caller (the evaluator) reports progress
    per checkpoint itself."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class BackgroundServer:
    """A running server and its base URL; `stop()` shuts it down."""

    def __init__(self, base_url: str, name: str, stop):
        self.base_url, self.name, self._stop = base_url, name, stop

    def stop(self) -> None:
        self._stop()


@contextlib.contextmanager
def background_server(opts: ServeCfg, startup_timeout: float = 600.0):
    """Serve `opts.model` while the block runs: in a thread (our engine) or a subprocess (vLLM, llama.cpp)."""
    if opts.backend in SUBPROCESS_BACKENDS:
        port = opts.port or pick_port(opts.host)
        command, name = SUBPROCESS_BACKENDS[opts.backend](opts, port)
        # llama.cpp's server logs a line per request: into a file, whose tail a failed start reports
        log_file = tempfile.NamedTemporaryFile("w+", prefix=f"{opts.backend}-", suffix=".log", delete=False) \
            if opts.backend == "llamacpp" else None
        proc = subprocess.Popen(command, start_new_session=True, stdout=log_file, stderr=log_file)
        server = BackgroundServer(f"http://{opts.host}:{port}/v1", name,
                                  lambda: (proc.terminate(), proc.wait(60)))
        try:
            wait_healthy(f"http://{opts.host}:{port}{HEALTH_PATH[opts.backend]}", startup_timeout, proc,
                         opts.api_key, log_file.name if log_file else None)
            yield server
        finally:
            server.stop()
        return

    # uvicorn loads only when a server starts in this process
    import uvicorn

    with no_load_bars():
        app, name = build_app(opts)
    sock = free_socket(opts.host, opts.port)
    port = sock.getsockname()[1]
    # in the caller's process: its logging setup stays (log_config=None), no access log, uvicorn's own at WARNING
    quiet_http_logs()
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", log_config=None, access_log=False))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="posttrain-http", daemon=True)
    thread.start()

    def stop():
        uv.should_exit = True
        thread.join(30)
        app.state.served.core.close()
        sock.close()

    try:
        deadline = time.monotonic() + 60
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server for {opts.model} did not start")
            time.sleep(0.02)
        yield BackgroundServer(f"http://{opts.host}:{port}/v1", name, stop)
    finally:
        stop()


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, api_key: str | None = None,
                 log_path: str | None = None) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log_path).read_text()[-2000:] if log_path else ""
            raise RuntimeError(f"the server process exited with {proc.returncode} before it was healthy"
                               + (f"; the end of its log {log_path}:\n{tail}" if tail else ""))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {timeout:.0f} s")


def main(argv: list[str]) -> int:
    try:
        opts = parse_options(argv)
        serve(opts)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"posttrain serve: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0

