"""The scorecard's intervals: Wilson for rates, bootstrap for fractional means, paired bootstrap for changes."""

import math

import pytest

from posttrain.evaluation.comparisons import changes
from posttrain.evaluation.scorecard import render_markdown
from posttrain.evaluation.stats import clears, mean_interval, paired_difference


def test_rate_gets_the_wilson_interval():
    # Wilson, z = 1.959964: centre (k + z^2/2) / (n + z^2), half-width z sqrt(k(n-k)/n + z^2/4) / (n + z^2)
    k, n, z = 147, 200, 1.959964
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    low, high = mean_interval([1.0] * k + [0.0] * (n - k))
    assert low == pytest.approx(centre - half, abs=1e-5) and high == pytest.approx(centre + half, abs=1e-5)


@pytest.mark.parametrize("k, n", [(0, 24), (24, 24), (1, 9)])
def test_wilson_stays_inside_zero_one_and_is_not_degenerate_at_the_ends(k, n):
    low, high = mean_interval([1] * k + [0] * (n - k))
    assert 0.0 <= low <= k / n <= high <= 1.0
    assert high - low > 0.05  # n = 24 all wrong is not "exactly 0": the interval says how little 24 prompts show


def test_unscorable_prompts_are_left_out():
    assert mean_interval([1, None, 0, None]) == mean_interval([1, 0])


def test_fractional_scores_get_a_bootstrap_interval_around_the_mean():
    scores = [0.25, 0.5, 0.75, 1.0, 0.0] * 40  # mean 0.5, sd 0.354: normal half-width ~0.049 at n = 200
    low, high = mean_interval(scores)
    assert low < 0.5 < high
    assert 0.08 < high - low < 0.12
    assert mean_interval(scores) == (low, high)  # seeded: the same replies give the same interval


@pytest.mark.parametrize("bad, match", [([], "no applicable score"), ([None], "no applicable score"),
                                        ([0.5, 1.5], r"\[0, 1\]")])
def test_mean_interval_refuses_what_it_cannot_bound(bad, match):
    with pytest.raises(ValueError, match=match):
        mean_interval(bad)


def test_paired_difference_uses_the_pairing():
    # 20 of 100 wrong prompts turn right and nothing else moves: +0.10 whose paired interval excludes 0. The two
    # rates' own Wilson intervals (0.50 and 0.60 at n = 200) overlap: unpaired, the change would not show.
    before = [0] * 100 + [1] * 100
    after = [1] * 20 + [0] * 80 + [1] * 100
    change = paired_difference(before, after)
    assert change["diff"] == pytest.approx(0.10) and change["n"] == 200
    assert 0.0 < change["low"] < 0.10 < change["high"] < 0.2
    assert clears((change["low"], change["high"]), 0.0)
    assert mean_interval(after)[0] < mean_interval(before)[1]


def test_paired_difference_of_no_change_is_zero_and_skips_unpaired_prompts():
    assert paired_difference([1, 0, None], [1, 0, 1]) == {"diff": 0.0, "low": 0.0, "high": 0.0, "n": 2}
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1, 0], [1])
    with pytest.raises(ValueError, match="nothing to pair"):
        paired_difference([None], [1])


def test_clears_needs_the_whole_interval_beyond_the_bar():
    assert clears((0.52, 0.64), 0.5) and not clears((0.49, 0.64), 0.5)
    assert clears((-0.06, -0.01), 0.0, above=False) and not clears((-0.06, 0.01), 0.0, above=False)


def test_scorecard_prints_intervals_and_changes_against_the_parent():
    sft = {"checkpoint": "sft", "arith": 0.5, "arith_n": 4, "arith_scores": [1.0, 0.0, 1.0, 0.0], "size_mb": 1.0,
           "arith_ci": list(mean_interval([1.0, 0.0, 1.0, 0.0]))}
    grpo = {"checkpoint": "grpo", "parent": "sft", "arith": 1.0, "arith_n": 4, "arith_scores": [1.0] * 4,
            "size_mb": 1.0, "arith_ci": list(mean_interval([1.0] * 4))}
    card = {"run": "r", "suites": ["arith"], "rows": [sft, grpo]}
    card["changes"] = changes(card["rows"], card["suites"])
    assert [(c["checkpoint"], c["parent"], c["key"], c["diff"]) for c in card["changes"]] == [
        ("grpo", "sft", "arith", 0.5)]
    text = render_markdown(card)
    low, high = sft["arith_ci"]
    assert "| checkpoint | arith [95% CI] (n) |" in text
    assert f"| sft | 0.500 [{low:.3f}, {high:.3f}] (4) |" in text
    assert "## Changes against the parent checkpoint" in text
    change = card["changes"][0]
    assert f"| grpo | sft | +0.500 [{change['low']:+.3f}, {change['high']:+.3f}] |" in text
