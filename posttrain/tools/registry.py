"""Tools by name: each an OpenAI function schema (what `tools=[...]` sends and the chat template renders) and the
function that answers one call with text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from posttrain.tools import calculator


@dataclass(frozen=True)
class Tool:
    schema: dict
    call: Callable[[str | dict], str]  # arguments (JSON text or parsed) -> the result text the model reads


TOOLS = {calculator.NAME: Tool(calculator.SCHEMA, calculator.call)}


def get_tool(name: str) -> Tool:
    if name not in TOOLS:
        raise ValueError(f"unknown tool '{name}'; known: {', '.join(sorted(TOOLS))}")
    return TOOLS[name]
