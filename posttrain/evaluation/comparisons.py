"""Checkpoints compared with their parents in one scorecard: the paired change of every score (with its bootstrap
interval), and, for suites that keep their replies and name a judge, the judge's win rate of each reply over the
parent's reply to the same prompt."""

from __future__ import annotations

from posttrain.evaluation.stats import mean_interval, paired_difference

JUDGE_LIMITS = ("The judge is the run's own reward model, trained on pairs of the same kind as DPO's (HH-RLHF "
                "harmless-base): it shares their blind spots and may reward what DPO learned to say rather than what "
                "is safer; it reads at most 1,024 tokens. The refusal rate beside it (rewards/refusal.py) is the "
                "independent measure.")


def judged(rows: list[dict], suites, eval_cfg, seed: int = 0) -> list[dict]:
    """For each suite that keeps its replies and names a judge (`eval.<suite>.reward_model`): each checkpoint's
    greedy reply against its parent's, prompt by prompt, scored by the judge. A win is 1, a tie 0.5, a loss 0; the
    win rate comes with its 95% interval (posttrain.evaluation.stats.mean_interval)."""
    # late: rewards.reward_model imports transformers, which a scorecard without a judged suite never needs
    from rewards.reward_model import RewardModelScorer

    by_label, out = {r["checkpoint"]: r for r in rows}, []
    for suite in suites:
        section = eval_cfg.get(suite.name) if hasattr(eval_cfg, "get") else None
        judge = section.get("reward_model") if hasattr(section, "get") else None
        key = f"{suite.name}_replies"
        pairs = [(row, by_label.get(row.get("parent"))) for row in rows]
        pairs = [(row, parent) for row, parent in pairs if parent and key in row and key in parent]
        if not judge or not pairs:
            continue
        scorer, scores = RewardModelScorer(judge), {}
        prompts = [r["messages"] for r in suite.rows]
        for row in {id(r): r for pair in pairs for r in pair}.values():
            scores[row["checkpoint"]] = scorer(prompts=prompts, completions=row[key])
        for row, parent in pairs:
            wins = [1.0 if a > b else 0.5 if a == b else 0.0
                    for a, b in zip(scores[row["checkpoint"]], scores[parent["checkpoint"]], strict=True)]
            low, high = mean_interval(wins, seed)
            out.append({"checkpoint": row["checkpoint"], "parent": parent["checkpoint"], "suite": suite.name,
                        "judge": str(judge), "win_rate": sum(wins) / len(wins), "low": low, "high": high,
                        "n": len(wins), "ties": wins.count(0.5)})
    return out


def render_judged(card: dict) -> list[str]:
    if not card.get("judged"):
        return []
    lines = ["", "## Judged against the parent", "",
             "Each reply against the parent's reply to the same prompt, scored by the run's reward model: a win 1, a "
             "tie 0.5, a loss 0, with the win rate's 95% interval. " + JUDGE_LIMITS, "",
             "| checkpoint | against | suite | win rate [95% CI] (n) | ties |", "|---|---|---|---|---|"]
    for j in card["judged"]:
        lines.append(f"| {j['checkpoint']} | {j['parent']} | {j['suite']} | {j['win_rate']:.3f} "
                     f"[{j['low']:.3f}, {j['high']:.3f}] ({j['n']}) | {j['ties']} |")
    return lines


def changes(rows: list[dict], suites: list[str], seed: int = 0) -> list[dict]:
    """Each checkpoint against its parent checkpoint in the same scorecard (sft against base, grpo against sft, a
    quantized copy against what it quantized): per suite, the mean per-prompt change of the greedy score (and of
    pass@1 where the suite samples, and of the loose and grounded scores where it has them: ifeval's) with its paired-bootstrap 95%
    interval."""
    by_label = {r["checkpoint"]: r for r in rows}
    out = []
    for row in rows:
        parent = by_label.get(row.get("parent"))
        if parent is None:
            continue
        for suite in suites:
            for key in (suite, f"{suite}_pass@1", f"{suite}_loose", f"{suite}_grounded"):
                if f"{key}_scores" in row and f"{key}_scores" in parent:
                    change = paired_difference(parent[f"{key}_scores"], row[f"{key}_scores"], seed)
                    out.append({"checkpoint": row["checkpoint"], "parent": parent["checkpoint"], "key": key,
                                **change})
    return out


def render_changes(card: dict, headers: dict[str, str]) -> list[str]:
    """One row per checkpoint with a parent: each score's change and its paired 95% interval (`headers`: a suite's
    column name where it is not the suite's own)."""
    found = card.get("changes") or []
    if not found:
        return []
    keys = list(dict.fromkeys(c["key"] for c in found))
    head = ["checkpoint", "against"] + [headers.get(k, k.replace("_pass@1", " pass@1")) for k in keys]
    lines = ["", "## Changes against the parent checkpoint", "",
             "Mean per-prompt change on the same prompts, with its 95% interval (paired bootstrap over prompts).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in dict.fromkeys(c["checkpoint"] for c in found):
        mine = {c["key"]: c for c in found if c["checkpoint"] == label}
        cells = [label, next(iter(mine.values()))["parent"]]
        cells += [f"{mine[k]['diff']:+.3f} [{mine[k]['low']:+.3f}, {mine[k]['high']:+.3f}]" if k in mine else "n/a"
                  for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
