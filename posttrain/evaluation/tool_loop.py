"""The OpenAI tool loop, as an agent framework runs it: send `tools=[...]`, run each `tool_calls` entry the reply
returns, send the results back as `tool` messages, until a reply without calls (or a bound on calls) ends it.

This is how a tool-using checkpoint is scored: through the server's own tool-call parsing and the `openai` client,
streamed or not, so a score proves the protocol works end to end, not only that the model writes the right tags.
Each transcript records its calls, how many parsed and ran (a call to an unknown tool, arguments that are not JSON
or that the tool refuses count as failed; the tool's error text still goes back to the model, as a framework does).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from posttrain.tools.registry import TOOLS


@dataclass
class Transcript:
    final: str = ""  # the last reply's content
    messages: list[dict] = field(default_factory=list)  # the whole conversation, tool turns included
    calls: int = 0
    calls_ok: int = 0  # parsed, named a known tool, and the tool answered without an error
    finish_reason: str | None = None
    hit_limit: bool = False  # stopped at max_calls with a call still pending


def run_call(name: str, arguments: str) -> tuple[str, bool]:
    """(the tool's result text, whether the call parsed and ran)."""
    if name not in TOOLS:
        return f"error: unknown tool '{name}'; known: {', '.join(sorted(TOOLS))}", False
    try:
        json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return "error: the arguments are not JSON", False
    result = TOOLS[name].call(arguments)
    return result, not result.startswith("error:")


async def streamed_message(client, **request) -> tuple[dict, str | None]:
    """One streamed chat request gathered into (the assistant message, finish reason): content deltas joined,
    tool-call deltas merged by their index, as the OpenAI client's users do."""
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, finish


async def plain_message(client, **request) -> tuple[dict, str | None]:
    reply = await client.chat.completions.create(**request)
    choice = reply.choices[0]
    message = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls]
    return message, choice.finish_reason


async def tool_loop(client, model: str, messages: list[dict], tools: list[str], max_tokens: int,
                    max_calls: int = 8, stream: bool = False) -> Transcript:
    """Run one conversation through the loop with greedy replies; `tools` are names in the tool registry."""
    schemas = [TOOLS[name].schema for name in tools]
    out = Transcript(messages=[dict(m) for m in messages])
    ask = streamed_message if stream else plain_message
    while True:
        message, out.finish_reason = await ask(client, model=model, messages=out.messages, tools=schemas,
                                               max_tokens=max_tokens, temperature=0.0)
        out.messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            out.final = message["content"] or ""
            return out
        if out.calls + len(calls) > max_calls:
            out.hit_limit, out.final = True, message["content"] or ""
            return out
        for call in calls:
            result, ok = run_call(call["function"]["name"], call["function"]["arguments"])
            out.calls, out.calls_ok = out.calls + 1, out.calls_ok + ok
            out.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def tool_loop_replies(base_url: str, api_key: str, model: str, conversations: list[list[dict]], tools: list[str],
                      max_tokens: int, concurrency: int = 16, max_calls: int = 8, stream: bool = False,
                      timeout: float = 600.0, progress=None) -> list[Transcript]:
    """Every conversation through the tool loop, `concurrency` at a time; each finished one advances `progress`."""
    from openai import AsyncOpenAI

    async def run():
        gate = asyncio.Semaphore(concurrency)
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0) as client:
            async def one(messages):
                async with gate:
                    transcript = await tool_loop(client, model, messages, tools, max_tokens, max_calls, stream)
                if progress is not None:
                    progress.update(1)
                return transcript
            return await asyncio.gather(*(one(m) for m in conversations))

    return asyncio.run(run())



def tool_figures(name: str, transcripts: list[Transcript]) -> dict:
    """A tool suite's figures beside its score: calls per prompt, the share of calls that parsed and ran, and the
    prompts cut at the bound on calls."""
    calls = sum(t.calls for t in transcripts)
    return {f"{name}_calls_per_prompt": calls / len(transcripts) if transcripts else None,
            f"{name}_calls_ok_share": sum(t.calls_ok for t in transcripts) / calls if calls else None,
            f"{name}_hit_call_limit": sum(t.hit_limit for t in transcripts)}
