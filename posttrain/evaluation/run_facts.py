"""What the claims read from a finished run (posttrain.evaluation.claims): its scorecard rows, paired changes and
judged win rates, and from the stages' manifests the reward model's held-out accuracy, GRPO's reward per step,
the quantized copies' perplexity change, which stages the run has and what GRPO trained on."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.artifacts import read_manifest


class ClaimsError(ValueError):
    """The run lacks what a claim reads (a checkpoint, a suite, a manifest metric); the message names it."""


@dataclass
class RunFacts:
    """What the claims read from a finished run."""
    scores: dict[str, dict]  # checkpoint label -> its scorecard row
    reward_model_accuracy: float | None
    grpo_rewards: list[float]  # mean reward per GRPO step, in step order
    reward_model_pairs: int | None = None  # held-out pairs behind reward_model_accuracy
    changes: list[dict] = field(default_factory=list)  # the scorecard's paired changes against each parent
    eval_config: dict = field(default_factory=dict)  # the eval config the scorecard recorded
    perplexity_change: dict[str, float] = field(default_factory=dict)  # quantized label -> held-out change
    judged: list[dict] = field(default_factory=list)  # the scorecard's judged win rates against each parent
    stages: set[str] = field(default_factory=set)  # the stages the run has artifacts of (quantize: its labels)
    grpo_prompts: str | None = None  # grpo.prompts.source of the run's GRPO stage (constraints: the ifeval claims)

    def score(self, checkpoint: str, key: str) -> float:
        row = self.scores.get(checkpoint)
        if row is None:
            raise ClaimsError(f"the scorecard has no row '{checkpoint}' (has {', '.join(self.scores)})")
        if key not in row:
            raise ClaimsError(f"the scorecard row '{checkpoint}' has no '{key}' (the eval suites must include it)")
        return float(row[key])


def grpo_step_rewards(manifest: dict) -> list[float]:
    """Mean reward per step from GRPO's manifest (its reward curve, one point per logging step)."""
    curve = manifest.get("metrics", {}).get("reward_curve") or []
    return [float(c["reward"]) for c in sorted(curve, key=lambda c: c["step"])]


def read_facts(run_dir: Path) -> RunFacts:
    path = Path(run_dir) / "scorecard.json"
    if not path.is_file():
        raise ClaimsError(f"{path} does not exist: evaluate the run first (posttrain eval run.name={Path(run_dir).name})")
    card = json.loads(path.read_text())
    accuracy, pairs, rewards, perplexity, stages, prompts = None, None, [], {}, set(), None
    for stage_dir in sorted(d for d in Path(run_dir).iterdir() if d.is_dir()):
        manifest = read_manifest(stage_dir)
        if manifest is None:
            continue
        metrics = manifest.get("metrics", {})
        stages.add(manifest.get("label") or manifest.get("stage"))
        if manifest.get("stage") == "reward_model":
            accuracy, pairs = metrics.get("pairwise_accuracy"), metrics.get("held_out_pairs")
        elif manifest.get("stage") == "grpo":
            rewards = grpo_step_rewards(manifest)
            prompts = (((manifest.get("config") or {}).get("grpo") or {}).get("prompts") or {}).get("source")
        elif manifest.get("stage") == "quantize" and "perplexity" in metrics:
            perplexity[manifest.get("label")] = metrics["perplexity"]["change"]
    return RunFacts({r["checkpoint"]: r for r in card["rows"]}, accuracy, rewards, pairs, card.get("changes") or [],
                    card.get("eval_config") or {}, perplexity, card.get("judged") or [], stages, prompts)
