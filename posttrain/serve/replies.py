"""What goes back to an OpenAI client from finished requests: choices, messages, usage, and the log-probability
objects of both endpoints (completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, chat's
`content` list), which the stream in posttrain.serve.streaming sends chunk by chunk.
`served` below is the app's `posttrain.serve.api.Served`: the core client, the tokenizer, the metrics."""

from __future__ import annotations

import time
import uuid

from posttrain.serve.parsing import ReplyParser
from posttrain.serve.protocol import APIError
from posttrain.serve.scheduler import Request


class TokenText:
    """Each token id's own text, decoded once per distinct id (a log-probability table names every token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.tokenizer.decode([token])
        return text


def final_text(served, request: Request) -> str:
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


def completion_logprobs(served, ids: list[int], entries: list, offset: int = 0) -> dict:
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


def chat_logprobs(served, ids: list[int], entries: list) -> dict:
    """OpenAI's chat `logprobs` object: per token its text, log-probability, UTF-8 bytes and the most likely."""
    def item(token: int, logprob: float) -> dict:
        text = served.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [dict(item(t, lp), top_logprobs=[item(u, v) for u, v in top])
                        for t, (lp, top) in zip(ids, entries)], "refusal": None}


def echo_text(served, request: Request) -> str:
    return served.tokenizer.decode(request.prompt)


def scored_tokens(r: Request) -> list[int]:
    """The generated tokens the log-probabilities cover: the text's, then the stop token that ended it."""
    return r.tokens + ([r.stop_token] if r.stop_token is not None else [])


def text_choice(served, body, index: int, r: Request) -> dict:
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


def build_response(served, body, prompts, requests: list[Request], chat) -> dict:
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
