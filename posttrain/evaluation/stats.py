"""95% intervals for scorecard rows and for the change between two checkpoints scored on the same prompts.

- A rate (every per-prompt score 0 or 1: a verifier's verdict, a refusal detector's): the Wilson score interval,
  which stays inside [0, 1] and keeps its coverage near 0 and 1 and at small n, where the normal interval does not.
- A mean of fractional scores (pass@1 over k samples, a judged score): a percentile bootstrap of the mean.
- A before/after difference (sft -> grpo, dpo -> its int4 copy): a paired percentile bootstrap of the mean per-prompt
  difference. Both checkpoints answered the same prompts, so resampling prompts keeps each prompt's pair together;
  an unpaired interval would charge the difference with the spread between prompts, which both sides share.

scipy computes the intervals (`binomtest(...).proportion_ci(method="wilson")`, `stats.bootstrap`). This module
only picks which interval a score gets, pairs the scores, and seeds the resampling so that rescoring the same
replies prints the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 4000  # bootstrap draws: the interval's ends move by about 0.002 between seeds at n = 200


def _applicable(scores: Sequence[float | None]) -> np.ndarray:
    return np.asarray([s for s in scores if s is not None], dtype=np.float64)


def is_rate(values: np.ndarray) -> bool:
    return bool(np.all((values == 0.0) | (values == 1.0)))


def _bootstrap_mean(values: np.ndarray, seed: int) -> tuple[float, float]:
    from scipy import stats

    if np.all(values == values[0]):  # no spread to resample: the mean is the only value any draw can give
        return float(values[0]), float(values[0])
    result = stats.bootstrap((values,), np.mean, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                             method="percentile", rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def mean_interval(scores: Sequence[float | None], seed: int = 0) -> tuple[float, float]:
    """The 95% interval of the mean of the applicable (not None) per-prompt scores, each in [0, 1]."""
    values = _applicable(scores)
    if not len(values):
        raise ValueError("no applicable score: an interval needs at least one scored prompt")
    if np.any((values < 0.0) | (values > 1.0)):
        raise ValueError(f"scores must lie in [0, 1] for an interval of their mean, got {values.min()} .. "
                         f"{values.max()}")
    if is_rate(values):
        from scipy.stats import binomtest

        ci = binomtest(int(values.sum()), len(values)).proportion_ci(confidence_level=CONFIDENCE, method="wilson")
        return float(ci.low), float(ci.high)
    return _bootstrap_mean(values, seed)


def paired_difference(before: Sequence[float | None], after: Sequence[float | None], seed: int = 0) -> dict:
    """mean(after - before) over the prompts both scored, with its paired-bootstrap 95% interval.

    `before[i]` and `after[i]` must be the same prompt's scores (None: not scorable there; the prompt is left out).
    Returns {"diff", "low", "high", "n"}."""
    if len(before) != len(after):
        raise ValueError(f"paired scores need the same prompts on both sides, got {len(before)} and {len(after)}")
    pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
    if not pairs:
        raise ValueError("no prompt was scored on both sides: nothing to pair")
    differences = np.asarray([a - b for b, a in pairs], dtype=np.float64)
    low, high = _bootstrap_mean(differences, seed)
    return {"diff": float(differences.mean()), "low": low, "high": high, "n": len(differences)}


def clears(interval: tuple[float, float], bar: float, above: bool = True) -> bool:
    """Whether the whole interval lies beyond the bar: above it (`above`), or below it."""
    low, high = interval
    return low > bar if above else high < bar
