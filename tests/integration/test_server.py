"""`posttrain serve` as a subprocess on a free loopback port, driven by the official `openai` client.

The served model is a tiny Qwen3 trained to memorise three replies (tests/scripted_model.py): plain content,
reasoning in a think block, a tool call. Every load loop below is bounded in count and time and targets 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from tests.helpers import popen
from tests.scripted_model import SCRIPT, WEATHER_TOOL, build_scripted_model

openai = pytest.importorskip("openai")
KEY = "test-key"
NAME = "scripted"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = popen("serve", str(model_dir), "port=0", f"api_key={KEY}", f"served_model_name={NAME}", "max_batch=16",
                 "max_len=512", log=log)
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None:
            match = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", log.read_text())
            if match:
                url = match.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start:\n{log.read_text()}")
            else:
                time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server, api_key=KEY, timeout=60, max_retries=0) as c:
        yield c


def chat(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kwargs)


def test_models_endpoint_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 512


def test_chat_returns_the_memorised_reply_and_usage(client):
    reply = chat(client, SCRIPT[0][0])
    choice = reply.choices[0]
    assert choice.message.content == "Hello there, friend."
    assert choice.message.model_extra.get("reasoning_content") is None and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 5


def test_reasoning_comes_back_as_reasoning_content(client):
    message = chat(client, SCRIPT[1][0]).choices[0].message
    assert message.model_extra["reasoning_content"] == "2 plus 3 makes 5."
    assert message.content == "The answer is 5."


def test_tool_call_comes_back_as_openai_tool_calls(client):
    reply = chat(client, SCRIPT[2][0], tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_completions_endpoint_continues_raw_text(client, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(SCRIPT[0][0], add_generation_prompt=True, tokenize=False)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0)
    assert reply.choices[0].text == "Hello there, friend." and reply.choices[0].finish_reason == "stop"
    short = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    stopped = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0, stop=[" friend"])
    assert stopped.choices[0].text == "Hello there," and stopped.choices[0].finish_reason == "stop"


def test_streaming_chat_sends_reasoning_and_content_deltas_that_add_up(client):
    whole = chat(client, SCRIPT[1][0]).choices[0].message
    stream = chat(client, SCRIPT[1][0], stream=True, stream_options={"include_usage": True})
    reasoning, content, chunks, finish, usage = "", "", 0, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            chunks += 1
            reasoning += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content
    assert chunks > 5 and finish == "stop" and usage.completion_tokens > 5


def test_streaming_tool_call_and_streaming_completion(client):
    calls, finish = [], None
    for chunk in chat(client, SCRIPT[2][0], tools=[WEATHER_TOOL], stream=True):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="Hello there", max_tokens=12, temperature=0, stream=True))
    alone = client.completions.create(model=NAME, prompt="Hello there", max_tokens=12, temperature=0)
    assert text == alone.choices[0].text and text


def test_sampling_is_seeded_and_n_gives_n_choices(client):
    kwargs = dict(model=NAME, prompt="Hello", max_tokens=10, temperature=1.5, seed=7)
    first = [c.text for c in client.completions.create(n=3, **kwargs).choices]
    again = [c.text for c in client.completions.create(n=3, **kwargs).choices]
    assert len(first) == 3 and first == again
    assert len(set(first)) > 1  # choice k uses seed + k


@pytest.mark.parametrize("change, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 500}, "n"),
    ({"temperature": 3.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 1000}]}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
])
def test_bad_requests_get_a_400_error_object(client, change, field):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **change}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/chat/completions", body=body, cast_to=object)
    error = err.value.body
    assert err.value.status_code == 400 and error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or "").startswith(field)


def test_malformed_json_unknown_model_missing_field_and_missing_key(server, client):
    import httpx

    raw = httpx.post(f"{server}/chat/completions", content=b"{not json", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.post("/chat/completions", body={"model": NAME}, cast_to=object)
    with openai.OpenAI(base_url=server, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    assert httpx.get(server.replace("/v1", "/health"), timeout=30).json() == {"status": "ok"}  # still serving
    assert chat(client, SCRIPT[0][0]).choices[0].message.content == "Hello there, friend."


def test_64_concurrent_requests_each_equal_the_request_sent_alone(server, client):
    prompts = [f"Tell me about item {i}." if i % 3 else SCRIPT[i % 2][0][0]["content"] for i in range(64)]
    alone = [chat(client, [{"role": "user", "content": p}], max_tokens=16).choices[0].message for p in prompts]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server, api_key=KEY, timeout=120, max_retries=0) as c:
            return await asyncio.wait_for(asyncio.gather(*(
                c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=16,
                                          temperature=0) for p in prompts)), timeout=300)

    together = [r.choices[0].message for r in asyncio.run(all_at_once())]
    assert [(m.content, m.model_extra.get("reasoning_content")) for m in together] == \
        [(m.content, m.model_extra.get("reasoning_content")) for m in alone]
    import httpx

    text = httpx.get(server.replace("/v1", "/metrics"), timeout=30).text
    batch_sum = float(re.search(r"^posttrain_batch_rows_sum (\S+)", text, re.M).group(1))
    batch_count = float(re.search(r"^posttrain_batch_rows_count (\S+)", text, re.M).group(1))
    big_steps = float(re.search(r'^posttrain_batch_rows_bucket\{le="8.0"\} (\S+)', text, re.M).group(1))
    assert batch_count > big_steps  # some engine steps decoded more than 8 sequences together: batching happened
    assert batch_sum > batch_count


def test_metrics_are_prometheus_text_with_latency_histograms(server, client):
    import httpx

    chat(client, SCRIPT[0][0])
    text = httpx.get(server.replace("/v1", "/metrics"), timeout=30).text
    for series in ("posttrain_time_to_first_token_seconds_bucket", "posttrain_time_between_tokens_seconds_count",
                   "posttrain_generation_tokens_total", "posttrain_requests_in_flight", "posttrain_queue_length"):
        assert re.search(rf"^{series}", text, re.M), series
    assert float(re.search(r"^posttrain_time_to_first_token_seconds_count (\S+)", text, re.M).group(1)) >= 1
    assert float(re.search(r"^posttrain_generation_tokens_total (\S+)", text, re.M).group(1)) >= 5
