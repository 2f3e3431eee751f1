"""The OpenAI request bodies the server accepts, and its error objects.

Requests are validated strictly (a string where a number belongs is an error, not coerced), so a client's mistake
comes back as a 400 naming the field instead of a surprising generation. A field the server does not implement is
refused with a 400 naming it, never accepted and dropped: a client asking for `response_format: json_object` or
`user` accounting would otherwise get a success that is not one. A few of OpenAI's fields are taken only at the
value that asks for nothing (`best_of` equal to `n`, `response_format: {"type": "text"}`, `tool_choice` "auto" or
"none"). Extensions beside OpenAI's fields follow vLLM's names: `top_k`, `stop_token_ids`, `ignore_eos`,
`chat_template_kwargs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI allows 5 on completions, 20 on chat; vLLM 20)


class APIError(Exception):
    """An error the client caused (or a 5xx the server reports): becomes an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # vLLM extension; -1 also means "off" there
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's logit processors: a bias per token id (JSON keys are strings), penalties on repeated tokens
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with integer token ids, each checked against the vocabulary and OpenAI's [-100, 100]."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab_size - 1})",
                               param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias[{key}]: {value} is outside [-100, 100]", param="logit_bias")
            out[int(key)] = float(value)
        return out


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # per token: its log-probability and the k likeliest
    echo: bool = False  # the prompt comes back ahead of the completion (with its log-probabilities, if asked)
    best_of: int | None = None  # only equal to n: the server returns every choice it samples

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of ({self.best_of}) other than n ({self.n}) is not implemented: this server "
                                f"returns every choice it samples", param="best_of")


class FunctionCall(Strict):
    name: str
    arguments: str | dict


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ResponseFormat(Strict):
    type: Literal["text"]  # json_object and json_schema would need constrained decoding, which the engine lacks


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:  # a participant's name, for templates that render it
            out["name"] = self.name
        return out


class Parameters(BaseModel):
    """A function's parameters: a JSON Schema object. Only its shape is checked here (the server has no JSON Schema
    library and does not constrain decoding to it); its other keywords pass through to the chat template."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["object"]
    properties: dict[str, dict[str, Any]] | None = None
    required: list[str] | None = None

    @model_validator(mode="after")
    def _required_are_properties(self):
        unknown = sorted(set(self.required or []) - set(self.properties or {}))
        if unknown:
            raise ValueError(f"required names {unknown}, which are not among its properties")
        return self


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: Parameters | None = None
    strict: Literal[False] | None = None  # true asks for arguments constrained to the schema, which the engine lacks


class Tool(Strict):
    type: Literal["function"] = "function"
    function: dict[str, Any]  # as sent (the chat template renders it), once FunctionDef accepts it

    @field_validator("function")
    @classmethod
    def _function(cls, value: dict) -> dict:
        try:
            FunctionDef.model_validate(value)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{where or 'function'}: {first['msg']}") from None
        return value


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    # "auto" lets the model call a tool or not; "none" leaves the tools out of the prompt. "required" and naming a
    # function would need constrained decoding, which the engine lacks.
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool = True  # false: only the reply's first tool call is returned
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None  # OpenAI's field, handed to the chat template
    enable_thinking: bool | None = None  # Qwen3's template switch, accepted at the top level too
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs


def parse_body(model: type[BaseModel], raw: bytes):
    """Validate a request body, turning every failure into a 400 that names the field."""
    import json

    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")  # an unknown field first
        param = ".".join(str(p) for p in errors[0]["loc"]) or None

        def say(e: dict) -> str:
            where = ".".join(str(p) for p in e["loc"]) or "body"
            if e["type"] == "extra_forbidden":
                return f"{where}: this server does not implement this field"
            return f"{where}: {e['msg']}"
        raise APIError(400, f"invalid request: {'; '.join(say(e) for e in errors[:5])}", param=param) from None
