"""The fields of the library config classes a recipe's blocks are checked against: TRL's trainer configs and peft's
LoraConfig, by name and by type (posttrain.config uses these at start-up). trl and peft are imported inside the
functions: importing them takes seconds, and commands that never compose a recipe should not pay for it."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any


def trl_fields(class_name: str) -> list[str]:
    import trl

    return [f.name for f in dataclasses.fields(getattr(trl, class_name)) if f.init]


@functools.cache
def trl_field_types(class_name: str) -> dict[str, Any]:
    import trl

    return typing.get_type_hints(getattr(trl, class_name))


def lora_fields() -> list[str]:
    from peft import LoraConfig

    return [f.name for f in dataclasses.fields(LoraConfig) if f.init]


def fits(value, hint) -> bool:
    """Whether `value` is acceptable for a field annotated `hint`; annotations it does not understand accept all."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # TRL passes the value on as it is: a string here would fail only when the optimizer starts
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {member.value for member in hint}
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(fits(v, args[0]) for v in value) if args else isinstance(value, (list, tuple))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def describe(hint) -> str:
    """A type annotation as a reader would say it: `float`, `int or None`, `one of 'a', 'b'`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in hint)
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
