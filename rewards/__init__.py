"""Reward functions and scorers, each with TRL's signature `(completions, **kwargs) -> list[float | None]`.

Dataset columns arrive as keyword arguments; `None` means "not applicable to this row". Recipes and eval suites
choose rewards by name through REWARDS, the one explicit name -> function table.
"""

from rewards.code_verifier import code_verifier, code_verifier_strict
from rewards.constraints import instruction_grounded, instruction_loose, instruction_strict
from rewards.echo import echo_exact_match
from rewards.refusal import answered, refusal
from rewards.safety import tiny_safety_rule
from rewards.steps import running_sum_steps
from rewards.verifiers import math_verifier, think_format

REWARDS = {
    "answered": answered,
    "code_verifier": code_verifier,
    "code_verifier_strict": code_verifier_strict,
    "echo_exact_match": echo_exact_match,
    "instruction_grounded": instruction_grounded,
    "instruction_loose": instruction_loose,
    "instruction_strict": instruction_strict,
    "math_verifier": math_verifier,
    "refusal": refusal,
    "running_sum_steps": running_sum_steps,
    "think_format": think_format,
    "tiny_safety_rule": tiny_safety_rule,
}

__all__ = [
    "REWARDS",
    "answered",
    "code_verifier",
    "code_verifier_strict",
    "echo_exact_match",
    "instruction_grounded",
    "instruction_loose",
    "instruction_strict",
    "math_verifier",
    "refusal",
    "running_sum_steps",
    "think_format",
    "tiny_safety_rule",
]
