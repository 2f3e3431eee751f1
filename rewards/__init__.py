"""Reward functions and scorers, each with TRL's signature `(completions, **kwargs) -> list[float | None]`.

Dataset columns arrive as keyword arguments; `None` means "not applicable to this row". Recipes and eval suites
choose rewards by name through REWARDS, the one explicit name -> function table.
"""

from rewards.echo import echo_exact_match

REWARDS = {
    "echo_exact_match": echo_exact_match,
}

__all__ = ["REWARDS", "echo_exact_match"]
