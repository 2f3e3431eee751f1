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

from posttrain.evaluation.tool_loop import tool_loop_replies
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


# ---- log-probabilities, echo, and every field of OpenAI's request schemas ------------------------------------------
def test_echo_logprobs_equal_transformers_as_lm_eval_reads_them(client, model_dir):
    """lm-eval's log-likelihood request (prompt as token ids, echo, logprobs 1, max_tokens 1, temperature 0),
    read as lm-eval reads it: token_logprobs[context length:-1] summed, greedy when each is its position's top."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    context = tok.encode(tok.apply_chat_template(SCRIPT[0][0], add_generation_prompt=True, tokenize=False))
    answers = [tok.encode("Hello there, friend."), tok.encode("Goodbye, stranger.")]
    reply = client.completions.create(model=NAME, prompt=[context + a for a in answers], max_tokens=1, echo=True,
                                      logprobs=1, temperature=0, seed=1234)
    scores = []
    for choice, answer in zip(reply.choices, answers):
        ids = context + answer
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens[: len(ids)]) == choice.text[: sum(map(len, lp.tokens[: len(ids)]))]
        assert lp.text_offset[1] == len(lp.tokens[0])
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        expected = [float(ref[i - 1, ids[i]]) for i in range(len(context), len(ids))]
        got = lp.token_logprobs[len(context):-1]
        assert max(abs(g - e) for g, e in zip(got, expected)) < 1e-3
        greedy = all(t == max(top.values()) for t, top in zip(got, lp.top_logprobs[len(context):-1]))
        scores.append((sum(got), greedy))
    assert scores[0][1] and not scores[1][1]  # the memorised reply is the greedy one, the other is not
    assert scores[0][0] > scores[1][0]
    alone = client.completions.create(model=NAME, prompt=context + answers[0], max_tokens=0, echo=True, logprobs=0,
                                      temperature=0)
    assert alone.choices[0].logprobs.token_logprobs == reply.choices[0].logprobs.token_logprobs[:-1]
    assert alone.usage.completion_tokens == 0 and alone.choices[0].logprobs.top_logprobs[1] == {}


def test_chat_and_streamed_logprobs_cover_every_generated_token(client):
    whole = chat(client, SCRIPT[0][0], logprobs=True, top_logprobs=2).choices[0]
    content = whole.logprobs.content
    assert "".join(t.token for t in content).startswith(whole.message.content)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    streamed = [t for c in chat(client, SCRIPT[0][0], logprobs=True, top_logprobs=2, stream=True)
                for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]
    kwargs = dict(model=NAME, prompt="Hello there", max_tokens=8, temperature=0, logprobs=3, echo=True)
    alone = client.completions.create(**kwargs).choices[0]
    tokens, offsets, text = [], [], ""
    for c in client.completions.create(stream=True, **kwargs):
        text += c.choices[0].text
        if c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert text == alone.text and tokens == alone.logprobs.tokens and offsets == alone.logprobs.text_offset


# A value for every field of the openai package's request types. Honoured fields must succeed, every other one must
# be refused with a 400 naming it; a field a new openai release adds fails the test until it is given a value here
# and a decision in the server.
CHAT_FIELDS = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "logit_bias": {"5": 2.0}, "logprobs": True,
    "max_completion_tokens": 4, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
    "metadata": {"k": "v"}, "modalities": ["text"], "model": NAME, "moderation": {"model": "omni"},
    "n": 2, "parallel_tool_calls": False, "prediction": {"type": "content", "content": "hi"},
    "presence_penalty": 0.5, "prompt_cache_key": "k", "prompt_cache_options": {"mode": "auto"},
    "prompt_cache_retention": "24h", "reasoning_effort": "low", "response_format": {"type": "text"},
    "safety_identifier": "s", "seed": 3, "service_tier": "auto", "stop": ["\n"], "store": False,
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "tool_choice": "auto",
    "tools": [WEATHER_TOOL], "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low",
    "web_search_options": {},
}
CHAT_HONOURED = {"frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "messages",
                 "model", "n", "parallel_tool_calls", "presence_penalty", "reasoning_effort", "response_format",
                 "seed", "stop", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
                 "top_p"}
COMPLETION_FIELDS = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 2.0}, "logprobs": 2, "max_tokens": 4,
    "model": NAME, "n": 2, "presence_penalty": 0.5, "prompt": "Hello", "seed": 3, "stop": ["\n"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": " the end", "temperature": 0.7, "top_p": 0.9, "user": "u",
}
COMPLETION_HONOURED = set(COMPLETION_FIELDS) - {"suffix", "user"}
NEEDS = {"n": {"temperature": 0.7}, "top_logprobs": {"logprobs": True}, "stream_options": {"stream": True},
         "best_of": {"n": 2, "temperature": 0.7}}


def schema_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_every_openai_request_field_is_honoured_or_refused_by_name(server, endpoint):
    import httpx
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    chat_ = endpoint.startswith("chat")
    fields, honoured = (CHAT_FIELDS, CHAT_HONOURED) if chat_ else (COMPLETION_FIELDS, COMPLETION_HONOURED)
    schema = schema_fields(chat_create_params if chat_ else completion_create_params)
    assert schema <= set(fields), f"fields of the openai package without a decision here: {schema - set(fields)}"
    base = {"model": NAME, "max_tokens": 4, "temperature": 0,
            **({"messages": fields["messages"]} if chat_ else {"prompt": "Hello"})}
    outcomes = {}
    for field in sorted(schema):
        body = {**base, **NEEDS.get(field, {}), field: fields[field]}
        reply = httpx.post(f"{server}/{endpoint}", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        if reply.status_code == 200:
            outcomes[field] = "honoured"
        elif reply.status_code == 400 and reply.json()["error"]["param"] == field:
            outcomes[field] = "refused"
        else:
            outcomes[field] = f"{reply.status_code}: {reply.text[:200]}"
    assert outcomes == {f: "honoured" if f in honoured else "refused" for f in schema}


@pytest.mark.parametrize("endpoint, change, field", [
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format.type"),
    ("chat/completions", {"tool_choice": "required", "tools": [WEATHER_TOOL]}, "tool_choice"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "refusal": None}]}, "messages.0.refusal"),
    ("completions", {"best_of": 3, "n": 1}, "best_of"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 150.0}}, "logit_bias"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"stream_options": {"include_usage": True, "include_obfuscation": True}, "stream": True},
     "stream_options.include_obfuscation"),
])
def test_values_the_server_does_not_implement_get_a_400_naming_them(server, endpoint, change, field):
    import httpx

    base = {"model": NAME, "max_tokens": 4, "temperature": 0,
            **({"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat") else {"prompt": "Hi"})}
    reply = httpx.post(f"{server}/{endpoint}", json={**base, **change}, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


@pytest.mark.parametrize("tool, says", [
    ({"type": "function", "function": {"name": "get weather", "parameters": {"type": "object"}}}, "name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}, "parameters.type"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {}},
                                                                   "required": ["b"]}}}, "required names ['b']"),
    ({"type": "function", "function": {"name": "f", "strict": True}}, "strict"),
    ({"type": "function", "function": {"name": "f", "parametrs": {}}}, "parametrs"),
    ({"type": "function", "function": {"description": "no name"}}, "name"),
    ({"type": "code_interpreter"}, "type"),
])
def test_an_invalid_tools_schema_gets_a_400_naming_the_field(server, tool, says):
    import httpx

    body = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    reply = httpx.post(f"{server}/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"].startswith("tools.0"), reply.text
    assert says in error["message"], error["message"]


def test_the_openai_tool_loop_makes_two_calculator_round_trips_streamed_and_not(server):
    question = [SCRIPT[3][0]]
    plain, = tool_loop_replies(server, KEY, NAME, question, ["calculator"], max_tokens=60)
    streamed, = tool_loop_replies(server, KEY, NAME, question, ["calculator"], max_tokens=60, stream=True)
    for t in (plain, streamed):
        assert t.final == "The answer is 20." and (t.calls, t.calls_ok) == (2, 2) and not t.hit_limit
        assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["5", "20"]
        assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m.get("tool_calls") and m["tool_calls"][0]["function"] for m in plain.messages] == \
        [m.get("tool_calls") and m["tool_calls"][0]["function"] for m in streamed.messages]
