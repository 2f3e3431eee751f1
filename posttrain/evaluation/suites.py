"""Eval suites: held-out prompts + a scorer from `rewards/`. How the text is produced is not the suite's concern."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rewards import REWARDS


@dataclass
class Suite:
    name: str
    rows: list[dict]  # each has `messages` (the prompt turns) and the scorer's columns
    scorer: Callable
    columns: tuple[str, ...]

    def score(self, completions: list[str]) -> list[float]:
        kwargs = {c: [r[c] for r in self.rows] for c in self.columns}
        return self.scorer(completions, **kwargs)


def echo_suite(n: int, seed: int) -> Suite:
    from posttrain.data.tiny_world import make_echo, take_split

    rows = take_split(lambda rng: make_echo(rng, min_words=3), n, "test", seed, "echo")
    rows = [dict(r, messages=r["messages"][:-1]) for r in rows]  # drop the reference answer from the prompt
    return Suite("echo", rows, REWARDS["echo_exact_match"], ("message",))


SUITES = {"echo": echo_suite}


def build_suite(name: str, n: int, seed: int) -> Suite:
    if name not in SUITES:
        raise ValueError(f"eval suite '{name}' is not one of {sorted(SUITES)}")
    return SUITES[name](n, seed)
