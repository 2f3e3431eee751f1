"""Group-relative advantages (GRPO): each sample's reward minus its group's mean, optionally scaled."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], group_size: int, scale: str = "none", eps: float = 1e-4) -> list[float]:
    """Advantages for consecutive groups of `group_size` samples of one prompt each.

    scale: "none" (reward - group mean), "group" (divided by the group's std) or "batch" (by the whole batch's std).
    Standard deviations are population std (ddof=0); `eps` keeps all-equal groups at 0 rather than dividing by 0.

    >>> group_advantages([1, 0, 1, 0], 4)
    [0.5, -0.5, 0.5, -0.5]
    >>> [round(a, 3) for a in group_advantages([1, 0, 1, 0], 4, scale="group")]
    [1.0, -1.0, 1.0, -1.0]
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    if scale not in ("none", "group", "batch"):
        raise ValueError(f"scale '{scale}' is not one of none, group, batch")
    advantages: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        mean = sum(group) / group_size
        centred = [r - mean for r in group]
        if scale == "group":
            std = math.sqrt(sum(c * c for c in centred) / group_size)
            centred = [c / (std + eps) for c in centred]
        advantages += centred
    if scale == "batch":
        mean = sum(map(float, rewards)) / len(rewards)
        std = math.sqrt(sum((float(r) - mean) ** 2 for r in rewards) / len(rewards))
        advantages = [a / (std + eps) for a in advantages]
    return advantages


def equal_reward_fraction(rewards: list[float], group_size: int) -> float:
    """Fraction of groups whose rewards are all equal: they have zero advantage and teach nothing.

    >>> equal_reward_fraction([1, 1, 0, 1, 0, 0], 3)
    0.0
    >>> equal_reward_fraction([1, 1, 1, 0, 1, 0], 3)
    0.5
    """
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return sum(len(set(g)) == 1 for g in groups) / len(groups)
