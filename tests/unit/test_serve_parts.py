"""The server's parts without HTTP: reply parsing, continuous batching, option parsing, the vLLM command."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from posttrain.config_schema import ServeCfg
from posttrain.serve.engine import Engine, SamplingParams, model_from_hf
from posttrain.serve.parsing import ReplyParser, opens_thinking, parse_reply, partial_tag_len
from posttrain.serve.scheduler import Request, Scheduler
from posttrain.serve.server import parse_options, vllm_command
from tests.unit.test_engine import tiny_hf

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# ---- reasoning and tool calls ----------------------------------------------------------------------------------
def test_reply_splits_reasoning_content_and_tool_calls():
    reply = parse_reply("<think>\nadd 2 and 3\n</think>\n\nIt is 5.")
    assert (reply.reasoning_content, reply.content, reply.tool_calls) == ("add 2 and 3", "It is 5.", [])
    reply = parse_reply("Checking." + CALL)
    assert reply.content == "Checking." and reply.tool_calls[0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert parse_reply(CALL).content is None  # only a call: no content, as OpenAI returns it
    assert parse_reply("2 plus 3</think>5", thinking=True).reasoning_content == "2 plus 3"  # template opened it
    assert parse_reply("no think here").reasoning_content is None


def test_malformed_tool_call_stays_in_the_content():
    text = '<tool_call>{"name": get_weather}</tool_call>'
    reply = parse_reply(text)
    assert reply.tool_calls == [] and reply.content == text
    assert parse_reply(CALL, tools=False).content == CALL  # no tools offered: the text is just text


def test_prompt_that_opens_a_think_block_is_detected():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert partial_tag_len("abc<thi") == 4 and partial_tag_len("abc</") == 2 and partial_tag_len("abc") == 0


@pytest.mark.parametrize("text, thinking", [
    ("<think>\nfirst 2, then 3\n</think>\n\nThe answer is 5.", False),
    ("plan: <thinly> veiled</think>done", True),
    ("I will look it up. " + CALL, False),
    ("a < b and <thinking> is not a tag", False),
])
def test_streamed_deltas_add_up_to_the_whole_reply(text, thinking):
    parser = ReplyParser(thinking=thinking)
    reasoning = content = ""
    for end in range(1, len(text) + 1):  # one character at a time: the worst case for held-back tags
        r, c = parser.feed(text[:end])
        reasoning, content = reasoning + r, content + c
    r, c, calls = parser.finish(text)
    whole = parse_reply(text, thinking)
    assert reasoning + r == (whole.reasoning_content or "") and content + c == (whole.content or "")
    assert [x["function"] for x in calls] == [x["function"] for x in whole.tool_calls]


# ---- continuous batching -----------------------------------------------------------------------------------------
@pytest.fixture
def engine():
    return Engine(model_from_hf(tiny_hf("qwen3")), None, max_batch=4, max_len=64, stop_token_ids=[])


def run(scheduler: Scheduler, requests: list[Request], timeout: float = 60) -> list[Request]:
    done = threading.Semaphore(0)
    for r in requests:
        r.on_finish = lambda _: done.release()
        scheduler.submit(r)
    for _ in requests:
        assert done.acquire(timeout=timeout), "a request did not finish"
    return requests


def test_request_joining_a_running_batch_gets_the_tokens_it_gets_alone(engine):
    prompts = [[5, 6, 7, 8, 9, 10], [1, 2], [3, 4, 5], [9] * 11, [2, 7]]
    params = SamplingParams(max_tokens=12)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    scheduler = Scheduler(engine)
    try:
        late = [Request(p, params) for p in prompts[1:]]
        joined = threading.Event()

        def join_after_three(request: Request):  # runs on the engine thread, mid-generation
            if len(request.tokens) == 3 and not joined.is_set():
                joined.set()
                for r in late:
                    scheduler.submit(r)

        first = Request(prompts[0], params, on_token=join_after_three)
        done = threading.Semaphore(0)
        for r in [first, *late]:
            r.on_finish = lambda _: done.release()
        scheduler.submit(first)
        for _ in range(len(prompts)):
            assert done.acquire(timeout=60)
        assert [first.tokens] + [r.tokens for r in late] == alone
        assert scheduler.max_busy == 4  # 4 rows: the fifth request waited for a free row, then reused it
        assert scheduler.steps < sum(len(t) for t in alone) - len(prompts)  # steps were shared
        assert all(r.finish_reason == "length" and r.ttft_s > 0 for r in [first, *late])
    finally:
        scheduler.close()


def test_cache_grows_in_blocks_as_requests_need_and_keeps_running_rows(engine, monkeypatch):
    """The cache starts at one block per row and grows (by whole blocks, to what the longest admitted request needs,
    at most max_len) while a request is running, without changing the running request's tokens."""
    from posttrain.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "CACHE_BLOCK", 8)
    short, long_ = ([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=10)), ([9] * 11, SamplingParams(max_tokens=30))
    alone = [engine.generate([p], q)[0].token_ids for p, q in (short, long_)]
    engine.model.setup_cache(1, 8)  # as a fresh engine would start
    scheduler = Scheduler(engine)
    try:
        assert engine.model.max_len == 8
        late = Request(*long_)
        lengths = []

        def join_after_three(request: Request):  # runs on the engine thread, mid-generation
            lengths.append(engine.model.max_len)
            if len(request.tokens) == 3:
                scheduler.submit(late)

        first = Request(*short, on_token=join_after_three)
        run(scheduler, [first])
        done = threading.Semaphore(0)
        late.on_finish = lambda _: done.release()
        assert done.acquire(timeout=60)
        assert [first.tokens, late.tokens] == alone
        assert lengths[0] == 16 and engine.model.max_len == 48  # 6 + 10 -> 2 blocks; 11 + 30 -> 6 blocks
        assert engine.model.cache_bytes() == 4 * 48 * engine.model.kv_bytes_per_token()
    finally:
        scheduler.close()


def test_kv_cache_in_bfloat16_halves_it_and_keeps_greedy_tokens_close():
    fp32 = Engine(model_from_hf(tiny_hf("qwen3")), None, max_batch=4, max_len=64, stop_token_ids=[])
    bf16 = Engine(model_from_hf(tiny_hf("qwen3")), None, max_batch=4, max_len=64, stop_token_ids=[],
                  kv_dtype=torch.bfloat16)
    prompts = [[5, 6, 7, 8, 9, 10], [1, 2], [3, 4, 5], [9] * 11]
    params = SamplingParams(max_tokens=16)
    a, b = fp32.generate(prompts, params), bf16.generate(prompts, params)
    assert bf16.model.cache_bytes() * 2 == fp32.model.cache_bytes()
    assert bf16.model.model.layers[0].self_attn.cache.k.dtype == torch.bfloat16
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p.token_ids, q.token_ids))
    assert same >= 0.75 * 4 * 16, same  # rounding the keys may flip a near tie, not the whole reply


def test_scheduler_rejects_bad_requests_and_cancels(engine):
    scheduler = Scheduler(engine)
    try:
        with pytest.raises(ValueError, match="exceed the context"):
            scheduler.submit(Request([1] * 60, SamplingParams(max_tokens=8)))
        with pytest.raises(ValueError, match="max_tokens"):
            scheduler.submit(Request([1], SamplingParams(max_tokens=0)))
        with pytest.raises(ValueError, match="empty"):
            scheduler.submit(Request([], SamplingParams()))
        cancelled = Request([1, 2, 3], SamplingParams(max_tokens=50))
        cancelled.on_token = lambda r: len(r.tokens) == 2 and scheduler.cancel(r)
        normal = Request([4, 5], SamplingParams(max_tokens=5))
        run(scheduler, [cancelled, normal])
        assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) <= 3
        assert normal.finish_reason == "length" and len(normal.tokens) == 5
        assert not scheduler.busy  # every row free again
    finally:
        scheduler.close()
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.submit(Request([1], SamplingParams(max_tokens=4)))


def test_sampled_requests_are_reproducible_by_seed_inside_a_batch(engine):
    scheduler = Scheduler(engine)
    try:
        hot = SamplingParams(max_tokens=10, temperature=1.3, seed=11)
        a, b, other = Request([1, 2, 3], hot), Request([1, 2, 3], hot), Request([7, 7], SamplingParams(max_tokens=10))
        run(scheduler, [a, other, b])
        assert a.tokens == b.tokens
        assert a.tokens == engine.generate([[1, 2, 3]], hot)[0].token_ids
    finally:
        scheduler.close()


def test_engine_failure_fails_the_running_requests_and_the_server_keeps_going(engine, monkeypatch):
    scheduler = Scheduler(engine)
    try:
        original = engine.decode_one_token
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("out of memory (simulated)")
            return original(*args, **kwargs)

        monkeypatch.setattr(engine, "decode_one_token", flaky)
        broken = Request([1, 2], SamplingParams(max_tokens=6))
        run(scheduler, [broken])
        assert broken.finish_reason == "error" and "simulated" in broken.error
        fine = Request([1, 2], SamplingParams(max_tokens=6))
        run(scheduler, [fine])
        assert fine.finish_reason == "length" and len(fine.tokens) == 6
    finally:
        scheduler.close()


# ---- options and the vLLM backend --------------------------------------------------------------------------------
def test_serve_options_parse_key_value_and_flags():
    opts = parse_options(["runs/x/04-dpo", "port=0", "--max-batch", "8", "--api-key=k", "backend=posttrain"])
    assert (opts.model, opts.port, opts.max_batch, opts.api_key) == ("runs/x/04-dpo", 0, 8, "k")
    with pytest.raises(ValueError, match="unknown serve option 'prot'"):
        parse_options(["m", "prot=1"])
    with pytest.raises(ValueError, match="must be an integer"):
        parse_options(["m", "port=eighty"])
    with pytest.raises(ValueError, match="backend"):
        parse_options(["m", "backend=tgi"])
    with pytest.raises(ValueError, match="give the model"):
        parse_options(["port=1"])


def test_vllm_backend_needs_vllm_and_builds_the_same_names(monkeypatch, tmp_path):
    import importlib.util
    import shutil

    (tmp_path / "config.json").write_text("{}")
    opts = ServeCfg(model=str(tmp_path), api_key="k", served_model_name="dpo", backend="vllm")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RuntimeError, match="needs vLLM installed"):
            vllm_command(opts, 8001)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/vllm")
    cmd, name = vllm_command(opts, 8001)
    assert name == "dpo"
    assert cmd[:3] == ["vllm", "serve", str(tmp_path)]
    assert cmd[cmd.index("--served-model-name") + 1] == "dpo" and cmd[cmd.index("--api-key") + 1] == "k"
    assert cmd[cmd.index("--port") + 1] == "8001" and "--reasoning-parser" in cmd


def test_tiny_model_decode_uses_one_row_per_request(engine):
    """The engine's prefill into chosen rows (what the scheduler uses) equals prefill into rows 0..B-1."""
    engine.model.setup_cache(engine.max_batch, engine.max_len)
    a = engine.prefill([[1, 2, 3], [4, 5]])
    b = engine.prefill([[1, 2, 3], [4, 5]], rows=torch.tensor([3, 1]))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_one_serving_options_type_and_an_artifact_hashed_once(tmp_path, monkeypatch):
    """`posttrain serve` and eval share ServeCfg's defaults; resolving an artifact hashes each weight file once,
    and its model/ directory (what eval serves after verifying the artifact itself) not at all."""
    from posttrain import artifacts
    from posttrain.config import compose
    from posttrain.serve.server import resolve_model

    assert parse_options(["m"]) == ServeCfg(model="m")
    cfg = compose(["pipeline=tiny"])
    assert set(cfg.serve) == {f.name for f in dataclasses.fields(ServeCfg)}
    model = tmp_path / "04-dpo" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    weights = {"model/model.safetensors": artifacts.sha256_file(model / "model.safetensors")}
    (model.parent / artifacts.MANIFEST).write_text(json.dumps({"stage": "dpo", "label": "dpo", "weights": weights}))
    hashed = []
    real = artifacts.sha256_file
    monkeypatch.setattr(artifacts, "sha256_file", lambda path: (hashed.append(path), real(path))[1])
    assert resolve_model(str(model.parent)) == (str(model), "dpo") and len(hashed) == 1
    assert resolve_model(str(model)) == (str(model), "model") and len(hashed) == 1


def test_a_released_engine_frees_its_model_and_cache():
    """An eval serves one checkpoint after another in one process: each engine's weights and KV cache must go when
    its server stops, even while something (FastAPI's caches) still holds the engine."""
    import gc
    import weakref

    engine = Engine(model_from_hf(tiny_hf("qwen3")), None, max_batch=4, max_len=64, stop_token_ids=[])
    Scheduler(engine).close()  # a scheduler allocates the cache, as the server's does
    model = weakref.ref(engine.model)
    cache = weakref.ref(engine.model.model.layers[0].self_attn.cache.k)
    engine.release()
    gc.collect()
    assert model() is None and cache() is None


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_served_memory_matches_the_planners_estimate(family, tmp_path):
    """The weights and KV cache a server logs at start are within 10% of what the planner predicts for the same
    config, rows and context (the cache exactly: both count layers x 2 x kv heads x head_dim x bytes)."""
    from posttrain.serve.core import memory_report

    hf = tiny_hf(family)
    hf.config.save_pretrained(tmp_path)
    engine = Engine(model_from_hf(hf), None, max_batch=8, max_len=96)
    engine.reserve(1)
    report = memory_report(engine, str(tmp_path))
    assert abs(report["weights_bytes"] / report["planned_weights_bytes"] - 1) < 0.10, report
    assert report["kv_bytes_max"] == report["planned_kv_bytes"] == 8 * 96 * report["kv_bytes_per_token"]
    assert report["kv_bytes_now"] == report["kv_bytes_max"]  # one 256-position block exceeds max_len: capped
    assert report["peak_rss_bytes"] > report["weights_bytes"]
