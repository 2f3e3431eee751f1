"""The eval's OpenAI tool loop (posttrain/evaluation/tool_loop.py) against a stand-in for the `openai` client that
answers as a tool-using model would: two calculator round trips, then the answer; streamed and not, the same
transcript; failed calls counted and their error text sent back; the bound on calls."""

from __future__ import annotations

import asyncio
import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from posttrain.evaluation.tool_loop import run_call, tool_loop


def call(k: int, expression: str, name: str = "calculator", raw: str | None = None) -> dict:
    arguments = raw if raw is not None else json.dumps({"expression": expression})
    return {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}


class Model:
    """Replies chosen from the conversation so far: what a model that learned the tool would send."""

    def __init__(self, plan):
        self.plan, self.requests = plan, []

    def reply(self, messages) -> dict:
        rounds = sum(m["role"] == "tool" for m in messages)
        return self.plan(rounds, messages)


class Completions:
    def __init__(self, model: Model):
        self.model = model

    async def create(self, stream: bool = False, **request):
        self.model.requests.append(request)
        message = self.model.reply(request["messages"])
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if not stream:
            return ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                                  "choices": [{"index": 0, "finish_reason": finish,
                                                               "message": {"role": "assistant", **message}}]})
        return self.chunks(message, finish)

    async def chunks(self, message, finish):
        def chunk(delta, reason=None):
            return ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0,
                                                       "model": "m", "choices": [{"index": 0, "delta": delta,
                                                                                  "finish_reason": reason}]})
        yield chunk({"role": "assistant", "content": ""})
        text = message.get("content") or ""
        for i in range(0, len(text), 4):
            yield chunk({"content": text[i:i + 4]})
        for k, c in enumerate(message.get("tool_calls") or []):  # name first, arguments in two pieces
            args = c["function"]["arguments"]
            yield chunk({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                         "function": {"name": c["function"]["name"], "arguments": args[:5]}}]})
            yield chunk({"tool_calls": [{"index": k, "function": {"arguments": args[5:]}}]})
        yield chunk({}, finish)


class Client:
    def __init__(self, model: Model):
        self.chat = type("Chat", (), {"completions": Completions(model)})()


def two_round_trips(rounds, messages):
    if rounds == 0:
        return {"content": "First 2 + 3.", "tool_calls": [call(0, "2 + 3")]}
    if rounds == 1:
        return {"content": None, "tool_calls": [call(1, f"{messages[-1]['content']} * 4")]}
    return {"content": f"The answer is {messages[-1]['content']}."}


def run(plan, stream=False, max_calls=8):
    model = Model(plan)
    out = asyncio.run(tool_loop(Client(model), "m", [{"role": "user", "content": "(2 + 3) * 4?"}], ["calculator"],
                                max_tokens=64, max_calls=max_calls, stream=stream))
    return out, model


def test_two_round_trips_reach_the_answer_streamed_and_not():
    plain, model = run(two_round_trips)
    streamed, _ = run(two_round_trips, stream=True)
    assert plain.final == "The answer is 20." and (plain.calls, plain.calls_ok) == (2, 2)
    assert [m["role"] for m in plain.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in plain.messages if m["role"] == "tool"] == ["5", "20"]
    assert plain.messages[2]["tool_call_id"] == "call_0" and plain.messages[4]["tool_call_id"] == "call_1"
    assert model.requests[0]["tools"][0]["function"]["name"] == "calculator"
    assert model.requests[0]["temperature"] == 0.0 and len(model.requests) == 3
    assert streamed.final == plain.final and streamed.messages == plain.messages


def test_failed_calls_are_counted_and_their_error_goes_back():
    def clumsy(rounds, messages):
        if rounds == 0:
            return {"content": None, "tool_calls": [call(0, "", raw="{expression: 2+3"), call(1, "2 + 3", "calc"),
                                                    call(2, "1 / 0")]}
        return {"content": "I could not compute it."}
    out, _ = run(clumsy)
    assert (out.calls, out.calls_ok) == (3, 0)
    assert [m["content"] for m in out.messages if m["role"] == "tool"] == [
        "error: the arguments are not JSON", "error: unknown tool 'calc'; known: calculator",
        "error: division by zero"]
    assert out.final == "I could not compute it."


def test_a_model_that_never_stops_calling_is_cut_at_the_bound():
    out, model = run(lambda rounds, messages: {"content": None, "tool_calls": [call(rounds, "1 + 1")]}, max_calls=3)
    assert out.hit_limit and out.calls == 3 and len(model.requests) == 4 and out.final == ""


def test_run_call_reports_whether_the_call_ran():
    assert run_call("calculator", '{"expression": "6 * 7"}') == ("42", True)
    assert run_call("calculator", '{"expression": "6 *"}')[1] is False
