"""Group-relative advantages (GRPO): each sample's reward minus its group's mean, optionally scaled."""

from __future__ import annotations

import math


def nan_std(values: list[float]) -> float:
    """The sample standard deviation (Bessel-corrected, ddof 1) of the values that are not NaN; NaN when fewer
    than two are (TRL's `nanstd`)."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) < 2:
        return math.nan
    mean = sum(kept) / len(kept)
    return math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))


def group_advantages(rewards: list[float | None], group_size: int, scale: str = "none",
                     eps: float = 1e-4) -> list[float]:
    """Advantages for consecutive groups of `group_size` samples of one prompt each, as TRL's GRPOTrainer computes
    them (`multi_objective_aggregation: sum_then_normalize`, its default).

    scale: "none" (reward - group mean), "group" (divided by the group's std) or "batch" (by the whole batch's std).
    A reward of None or NaN marks a completion that no reward function could score: it is left out of its group's
    mean and std and its advantage is 0. Standard deviations are Bessel-corrected over the scored rewards; `eps`
    keeps all-equal groups at 0 rather than dividing by 0, and a group with one scored reward gets 0 throughout.

    >>> group_advantages([1, 0, 1, 0], 4)
    [0.5, -0.5, 0.5, -0.5]
    >>> [round(a, 3) for a in group_advantages([1, 0, 1, 0], 4, scale="group")]
    [0.866, -0.866, 0.866, -0.866]
    >>> [round(a, 3) for a in group_advantages([1, None, 0, 0], 4)]  # the unscored one is out of the mean (1/3)
    [0.667, 0.0, -0.333, -0.333]
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    if scale not in ("none", "group", "batch"):
        raise ValueError(f"scale '{scale}' is not one of none, group, batch")
    values = [math.nan if r is None else float(r) for r in rewards]
    batch_std = nan_std(values)
    advantages: list[float] = []
    for start in range(0, len(values), group_size):
        group = values[start : start + group_size]
        scored = [v for v in group if not math.isnan(v)]
        mean = sum(scored) / len(scored) if scored else math.nan
        std = {"group": nan_std(group), "batch": batch_std, "none": 0.0}[scale]
        for v in group:
            a = v - mean if scale == "none" else (v - mean) / (std + eps)
            advantages.append(0.0 if math.isnan(a) else a)
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
