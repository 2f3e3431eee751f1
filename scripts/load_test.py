"""Load test of `posttrain serve` on loopback: requests/s and latency percentiles at several client counts.

    python scripts/load_test.py runs/demo/04-dpo                      start a server on the artifact, then load it
    python scripts/load_test.py --url http://127.0.0.1:8000/v1 --model dpo --api-key KEY   an already running one

Each level runs `--clients` concurrent clients that send chat requests (held-out tiny-world echo prompts, greedy,
`--max-tokens` each) back to back until `--requests` requests are done or `--time-limit` seconds pass, whichever is
first: the loop is bounded in count and time, and the target must be a loopback address. Prints one row per level:
requests done, failures, requests/s, p50/p99 latency (request sent to full reply), generated tokens/s.

With an artifact (not --url), the same run then stops the server and measures the engine alone on the same model:
the same requests (the same rendered prompts, greedy, the same max_tokens, so the same replies) generated in
batches of the server's max_batch, in this process, with no HTTP in between. Each level's row then gives the
server's tokens/s as a fraction of the engine's: what the HTTP front end, templating, tokenizing and scheduling
cost on top of the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def level(url: str, key: str, model: str, prompts: list[list[dict]], clients: int, requests: int,
                max_tokens: int, time_limit: float) -> dict:
    from openai import AsyncOpenAI

    latencies, tokens, failures = [], 0, []
    issued = 0
    deadline = time.monotonic() + time_limit

    async def worker(client):
        nonlocal issued, tokens
        while issued < requests and time.monotonic() < deadline:
            messages = prompts[issued % len(prompts)]
            issued += 1
            start = time.perf_counter()
            try:
                reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                             temperature=0)
                latencies.append(time.perf_counter() - start)
                tokens += reply.usage.completion_tokens
            except Exception as err:  # counted and reported, never hidden
                failures.append(f"{type(err).__name__}: {err}")

    async with AsyncOpenAI(base_url=url, api_key=key, timeout=max(60.0, time_limit), max_retries=0) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    return {"clients": clients, "requests": len(latencies) + len(failures), "failed": len(failures),
            "requests_per_s": len(latencies) / wall, "p50_ms": 1000 * percentile(latencies, 0.5) if latencies else None,
            "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None, "tokens_per_s": tokens / wall,
            "mean_ms": 1000 * statistics.mean(latencies) if latencies else None, "wall_s": wall,
            "first_failures": failures[:3]}


def start_server(model: str, key: str, max_batch: int, log: Path) -> tuple[subprocess.Popen, str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", model, "port=0", f"api_key={key}",
                             f"max_batch={max_batch}", "max_len=512"], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = re.search(r"'([^']+)' on (http://127\.0\.0\.1:\d+/v1)", log.read_text())
        if match:
            return proc, match.group(2), match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group, then wait until every process of it (the front end, the engine process
    and its forkserver) is gone, so that nothing of it runs beside what is measured next."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)


def echo_prompts(n: int) -> list[list[dict]]:
    sys.path.insert(0, str(REPO))
    from posttrain.evaluation.suites import echo_suite

    return [row["messages"] for row in echo_suite(n, seed=0).rows]


def engine_alone(artifact: str, prompts: list[list[dict]], requests: int, max_tokens: int, batch: int,
                 repeats: int = 3) -> dict:
    """The engine's own tokens/s on the load test's requests: prompts rendered with the chat template as the server
    renders them, greedy, `max_tokens` each, in batches of `batch`; the best of `repeats` timed passes after one
    warm-up batch."""
    sys.path.insert(0, str(REPO))
    from posttrain.serve.engine import SamplingParams, load_engine
    from posttrain.serve.server import resolve_model

    weights, _ = resolve_model(artifact)
    engine = load_engine(weights, max_batch=batch, max_len=512)
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template(prompts[i % len(prompts)], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens)
    engine.generate(ids[:batch], params)
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = sum(len(c.token_ids) for c in engine.generate(ids, params))
        wall = time.perf_counter() - start
        best = wall if best is None else min(best, wall)
    return {"requests": requests, "batch": batch, "tokens": tokens, "repeats": repeats, "wall_s": best,
            "tokens_per_s": tokens / best, "requests_per_s": requests / best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", help="artifact or model directory to serve (omit with --url)")
    parser.add_argument("--url", help="an already running server's base URL (loopback only)")
    parser.add_argument("--model", help="the served model name (with --url)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=1000, help="requests per level (upper bound)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per level (upper bound)")
    parser.add_argument("--max-batch", type=int, default=32, help="rows of the started server's KV cache")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-alone comparison")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if bool(args.artifact) == bool(args.url):
        parser.error("give either an artifact to serve or --url of a running server")

    proc = None
    key = args.api_key or secrets.token_hex(16)
    if args.artifact:
        log = Path(tempfile.mkdtemp()) / "serve.log"
        proc, url, name = start_server(args.artifact, key, args.max_batch, log)
    else:
        url, name = args.url, args.model
        if not name:
            parser.error("--url needs --model")
    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to load {host}: the load test targets loopback only")
    try:
        prompts = echo_prompts(64)
        rows = [asyncio.run(level(url, key, name, prompts, c, args.requests, args.max_tokens, args.time_limit))
                for c in args.clients]
    finally:
        if proc is not None:
            stop_server(proc)
    engine = None
    if args.artifact and not args.no_engine:
        engine = engine_alone(args.artifact, prompts, max(r["requests"] for r in rows), args.max_tokens,
                              args.max_batch)
        for r in rows:
            r["engine_ratio"] = r["tokens_per_s"] / engine["tokens_per_s"]
    print(f"\nload test: '{name}' at {url}, chat requests of up to {args.max_tokens} tokens, greedy")
    print("| clients | requests | failed | requests/s | p50 ms | p99 ms | tokens/s | of the engine's |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = [f"{r[k]:.0f}" if r[k] is not None else "n/a" for k in ("p50_ms", "p99_ms")]
        ratio = f"{r['engine_ratio']:.2f}" if "engine_ratio" in r else "n/a"
        print(f"| {r['clients']} | {r['requests']} | {r['failed']} | {r['requests_per_s']:.1f} | {ms[0]} | {ms[1]} | "
              f"{r['tokens_per_s']:.0f} | {ratio} |")
        for failure in r["first_failures"]:
            print(f"  failure: {failure}")
    if engine is not None:
        print(f"engine alone: {engine['requests']} of the same requests in batches of {engine['batch']}: "
              f"{engine['tokens_per_s']:.0f} tokens/s, {engine['requests_per_s']:.1f} requests/s "
              f"(best of {engine['repeats']}, {engine['tokens']} tokens)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"levels": rows, "engine": engine}, indent=2))


if __name__ == "__main__":
    main()
