"""What a GRPO run's steps did, read back from the trainer's log_history: where each step's seconds went
(generation, scoring, the rest) and, with dynamic sampling, the completions generated against those trained on.

Everything here reads or writes log_history entries, which a trainer checkpoint keeps, so a resumed run's record
covers the steps before its checkpoint too. `StepTimer` writes the step split; `grpo_sampling` writes the sampling
keys.
"""

from __future__ import annotations

import time
from collections import defaultdict

from transformers import TrainerCallback


class StepTimer(TrainerCallback):
    """Where each GRPO step's seconds go: generating the completions, scoring them, and the rest (log-probabilities,
    the loss and the update). Wraps two GRPOTrainer methods on the instance (`_generate`, `_calculate_rewards`) and
    logs each step's `time/generation`, `time/scoring` and `time/step` through TRL's own metrics, so they land in the
    step's log_history entry, which a checkpoint keeps for a resumed run (TRL times these too, but reports its
    timings to W&B only)."""

    PARTS = (("_generate", "generation"), ("_calculate_rewards", "scoring"))

    def __init__(self):
        self.trainer, self.started, self.seconds = None, None, defaultdict(float)

    def attach(self, trainer) -> None:
        self.trainer = trainer
        trainer.add_callback(self)
        for method, part in self.PARTS:
            original = getattr(trainer, method)

            def timed(*args, _original=original, _part=part, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds[_part] += time.perf_counter() - start

            setattr(trainer, method, timed)

    def on_step_begin(self, args, state, control, **kwargs):
        self.started, self.seconds = time.perf_counter(), defaultdict(float)

    def on_step_end(self, args, state, control, **kwargs):
        if self.started is None:
            return
        metrics = self.trainer._metrics["train"]
        for _, part in self.PARTS:
            metrics[f"time/{part}"].append(self.seconds[part])
        metrics["time/step"].append(time.perf_counter() - self.started)


def step_sums(history: list[dict], key: str) -> tuple[float, int]:
    """(sum over steps, steps) of a per-step metric in a trainer's log_history, whose entries hold its mean over each
    logging window: each entry counts for the steps since the previous entry that logged it."""
    total, steps, last = 0.0, 0, 0
    for entry in history:
        if key in entry and entry[key] is not None and "step" in entry:
            total += entry[key] * (entry["step"] - last)
            steps += entry["step"] - last
            last = entry["step"]
    return total, steps


def step_split(history: list[dict]) -> dict[str, float]:
    """Seconds per step, over every step the log_history covers (a resumed run's too): generation, scoring and the
    rest of the step (log-probabilities, the loss and the update)."""
    sums = {part: step_sums(history, f"time/{part}") for part in ("generation", "scoring", "step")}
    steps = sums["step"][1]
    if not steps:
        return {}
    generation, scoring, whole = (sums[k][0] / steps for k in ("generation", "scoring", "step"))
    return {"generation": round(generation, 4), "scoring": round(scoring, 4),
            "update_and_rest": round(whole - generation - scoring, 4), "steps": steps}


def sampling_summary(history: list[dict], group_size: int) -> dict:
    """From the log_history (so a resumed run counts the steps before its checkpoint): the share of generated groups
    whose rewards were all equal (mean over steps) and, with dynamic sampling, the completions generated and trained
    on, the share of trained completions in informative groups, and each logging step's record."""
    equal, steps = step_sums(history, "equal_reward_groups")
    summary = {"steps": steps, "equal_reward_group_share": equal / steps if steps else None}
    generated, trained, filled = (step_sums(history, f"sampling/{k}")[0]
                                  for k in ("generated", "trained", "filled_uninformative_groups"))
    if trained:
        keys = ("generated", "trained", "rounds", "informative_groups", "filled_uninformative_groups",
                "filtered_group_share")
        summary.update(generated=round(generated), trained=round(trained),
                       informative_trained_share=(trained - filled * group_size) / trained,
                       per_step=[{"step": h["step"], **{k: h[f"sampling/{k}"] for k in keys}}
                                 for h in history if "sampling/generated" in h])
    return summary
