"""Eval suites: held-out prompts + a scorer from `rewards/`. How the text is produced is not the suite's concern.

A suite with `samples > 0` is also scored by sampling: pass@1 is the mean score over `samples` replies per prompt
drawn at `temperature` (as reasoning-model papers report it), beside the greedy score.
"""

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
    max_new_tokens: int = 32
    samples: int = 0  # replies sampled per prompt for pass@1; 0 scores greedy replies only
    temperature: float = 1.0

    def score(self, completions: list[str]) -> list[float | None]:
        kwargs = {c: [r[c] for r in self.rows] for c in self.columns}
        return self.scorer(completions, **kwargs)

    def score_samples(self, samples: list[list[str]]) -> list[float | None]:
        """Per prompt, the mean score of its sampled replies (None where the scorer does not apply)."""
        per_sample = [self.score([s[k] for s in samples]) for k in range(len(samples[0]))]
        out = []
        for scores in zip(*per_sample):
            applicable = [s for s in scores if s is not None]
            out.append(sum(applicable) / len(applicable) if applicable else None)
        return out


def echo_suite(n: int, seed: int) -> Suite:
    from posttrain.data.tiny_world import make_echo, take_split

    rows = take_split(lambda rng: make_echo(rng, min_words=3), n, "test", seed, "echo")
    rows = [dict(r, messages=r["messages"][:-1]) for r in rows]  # drop the reference answer from the prompt
    return Suite("echo", rows, REWARDS["echo_exact_match"], ("message",))


def arith_suite(n: int, seed: int, samples: int = 4, temperature: float = 1.0) -> Suite:
    """Held-out arithmetic problems, verifier-scored; greedy accuracy and sampled pass@1."""
    from posttrain.data.tiny_world import make_arith, take_split

    rows = take_split(make_arith(0.0), n, "test", seed, "arith")
    rows = [dict(r, messages=r["messages"][:-1]) for r in rows]
    return Suite("arith", rows, REWARDS["math_verifier"], ("answer",), max_new_tokens=64, samples=samples,
                 temperature=temperature)


SUITES = {"echo": echo_suite, "arith": arith_suite}


def build_suite(name: str, n: int, seed: int, **kwargs) -> Suite:
    if name not in SUITES:
        raise ValueError(f"eval suite '{name}' is not one of {sorted(SUITES)}")
    return SUITES[name](n, seed, **kwargs)
