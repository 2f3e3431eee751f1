"""Dynamic sampling for TRL's GRPOTrainer: groups whose rewards are all equal are dropped and the step's batch is
refilled with groups sampled from fresh prompts, within a bound on the rounds of generation.

A group whose completions all got the same reward has zero advantage everywhere, so it adds nothing to the policy
gradient; on a small model most groups can be like that (all wrong on a hard problem, all right on an easy one).
DAPO's "dynamic sampling", open-instruct's `filter_zero_std_samples`, verl's `algorithm.filter_groups` and
OpenRLHF's dynamic filtering all drop such groups; TRL 1.16 has no option for it. This is the smallest hook that
adds it: a mixin that overrides `GRPOTrainer._generate_and_score_completions` (one generation batch: sample, score,
compute advantages and log-probabilities) and calls TRL's own method once per round, so roll-outs on the project's
engine, TRL's generate and TRL's vLLM path all keep working unchanged. What it adds is the bookkeeping TRL's
tensors need to be merged: prompts are left-padded, completions right-padded, and `num_items_in_batch` (the DAPO
loss's token count) is recounted over the rows kept.

Each round's advantages are TRL's, computed within that round, so under `scale_rewards: batch` the batch std is the
round's, not the merged batch's; with `group` (or `none`) they are exactly what one batch of the kept groups gives.
"""

from __future__ import annotations

import json
import logging

import torch

from posttrain.config_schema import OPTION_VALUES

log = logging.getLogger("posttrain")

FILTERS = OPTION_VALUES["grpo.sampling.filter"]
PROMPT_SIDE = ("prompt_ids", "prompt_mask")  # [B, P], left-padded
COMPLETION_SIDE = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                   "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")  # [B, C] (or [B, 1])
ROW_SIDE = ("advantages",)  # [B]


def informative_groups(advantages: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] advantages -> [B / group_size] bool: the groups with any non-zero advantage (TRL gives every completion
    of a group whose rewards are all equal, or that could not be scored, an advantage of exactly 0).

    >>> informative_groups(torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 1.0]), 2).tolist()
    [True, False, True]
    """
    if advantages.numel() % group_size:
        raise ValueError(f"{advantages.numel()} advantages do not split into groups of {group_size}")
    return (advantages.view(-1, group_size) != 0).any(dim=1)


def pad_to(tensor: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    """[B, w] -> [B, width], padded on the left or the right with `value`."""
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    pad = tensor.new_full((tensor.size(0), missing), value)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def merge_batches(batches: list[dict], pad_token_id: int) -> dict:
    """Concatenate TRL generation batches (the dicts `_generate_and_score_completions` returns) row-wise, padding
    prompt-side tensors on the left and completion-side tensors on the right to the widest. `num_items_in_batch` is
    recounted from the merged masks. A key this does not know how to merge (multimodal inputs) is refused."""
    known = {*PROMPT_SIDE, *COMPLETION_SIDE, *ROW_SIDE, "num_items_in_batch"}
    for batch in batches:
        if unknown := sorted(set(batch) - known):
            raise ValueError(f"grpo.sampling.filter: TRL's batch has {unknown}, which dynamic sampling cannot merge "
                             f"(multimodal inputs); use grpo.sampling.filter=none")
    merged = {}
    for key in batches[0]:
        if key == "num_items_in_batch":
            continue
        parts = [b[key] for b in batches]
        if key in ROW_SIDE or all(p.size(1) == 1 for p in parts):
            merged[key] = torch.cat(parts)
            continue
        width = max(p.size(1) for p in parts)
        value = pad_token_id if key in ("prompt_ids", "completion_ids") else 0
        merged[key] = torch.cat([pad_to(p, width, value, left=key in PROMPT_SIDE) for p in parts])
    mask = merged["completion_mask"] * merged["tool_mask"] if "tool_mask" in merged else merged["completion_mask"]
    merged["num_items_in_batch"] = mask.sum()
    return merged


def take_rows(batch: dict, rows: torch.Tensor) -> dict:
    """The batch's rows `rows` (an index tensor), with `num_items_in_batch` recounted."""
    out = {k: v[rows] for k, v in batch.items() if k != "num_items_in_batch"}
    mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
    out["num_items_in_batch"] = mask.sum()
    return out


def plan_rows(informative: list[bool], group_size: int, groups_wanted: int) -> tuple[list[int], int]:
    """Which rows of the merged batch to train on: the informative groups in generation order, up to
    `groups_wanted`, then (when too few were found) the earliest uninformative ones to keep the batch's size.
    Returns (row indices, uninformative groups used to fill).

    >>> plan_rows([False, True, False, True, True], 2, 2)
    ([2, 3, 6, 7], 0)
    >>> plan_rows([False, True, False], 1, 2)
    ([1, 0], 1)
    """
    chosen = [g for g, ok in enumerate(informative) if ok][:groups_wanted]
    fill = [g for g, ok in enumerate(informative) if not ok][: groups_wanted - len(chosen)]
    return [g * group_size + k for g in chosen + fill for k in range(group_size)], len(fill)


class DynamicSampling:
    """Mixin for GRPOTrainer (`class Trainer(DynamicSampling, GRPOTrainer)`); set `sampling_filter` and
    `sampling_max_rounds` on the instance. Each training generation batch: TRL's method generates and scores; when
    fewer groups than the batch holds are informative, another round samples the missing number of groups from
    fresh prompts (a seeded walk over the training set), up to `max_rounds` rounds in all; the batch then holds the
    informative groups first and, if still short, the earliest uninformative ones (zero advantage), so its size never
    changes. Per step it logs completions generated and trained on, and the share of generated groups filtered."""

    sampling_filter: str = "none"
    sampling_max_rounds: int = 1
    sampling_history: list

    def _generate_and_score_completions(self, inputs):
        if self.sampling_filter == "none" or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if self.accelerator.num_processes > 1:
            raise ValueError("grpo.sampling.filter=zero_std runs on one process only: each process holds a slice of "
                             "the groups, and the refill would have to agree across them")
        group = self.num_generations
        wanted = len(inputs) // group
        batches, informative, seen = [], [], {prompt_key(x) for x in inputs[::group]}
        batch_inputs = inputs
        for _ in range(self.sampling_max_rounds):
            out = super()._generate_and_score_completions(batch_inputs)
            batches.append(out)
            informative += informative_groups(out["advantages"], group).tolist()
            missing = wanted - sum(informative)
            if missing <= 0:
                break
            batch_inputs = self.fresh_prompts(missing, seen)
            if not batch_inputs:
                break
        merged = merge_batches(batches, self.processing_class.pad_token_id) if len(batches) > 1 else batches[0]
        rows, filled = plan_rows(informative, group, wanted)
        stats = {"generated": len(informative) * group, "trained": len(rows), "rounds": len(batches),
                 "informative_groups": sum(informative), "filled_uninformative_groups": filled,
                 "filtered_group_share": 1 - sum(informative) / len(informative)}
        for name, value in stats.items():
            self._metrics["train"][f"sampling/{name}"].append(float(value))
        self.sampling_history.append({"step": self.state.global_step, **stats})
        if filled:
            log.info("grpo: step %d: %d of %d groups informative after %d rounds; %d uninformative groups fill the "
                     "batch (raise grpo.sampling.max_rounds)", self.state.global_step, sum(informative),
                     len(informative), len(batches), filled)
        return take_rows(merged, torch.tensor(rows))

    def fresh_prompts(self, groups: int, seen: set) -> list[dict]:
        """`groups` training prompts not in this batch, each repeated num_generations times (TRL's sampler order),
        from a seeded walk over the training set that carries on from call to call."""
        dataset = self.train_dataset
        if not hasattr(self, "_refill_order"):
            generator = torch.Generator().manual_seed(self.args.seed + 1)
            self._refill_order, self._refill_next = torch.randperm(len(dataset), generator=generator).tolist(), 0
        picked = []
        for _ in range(len(dataset)):
            if len(picked) == groups:
                break
            row = dict(dataset[self._refill_order[self._refill_next]])
            self._refill_next = (self._refill_next + 1) % len(dataset)
            key = prompt_key(row)
            if key not in seen:
                seen.add(key)
                picked.append(row)
        return [row for row in picked for _ in range(self.num_generations)]


def prompt_key(row: dict) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def dynamic_sampling_trainer(trainer_cls, sampling_cfg):
    """GRPOTrainer (or a subclass) with dynamic sampling per `grpo.sampling` ({filter, max_rounds})."""
    if sampling_cfg.filter not in FILTERS:
        raise ValueError(f"grpo.sampling.filter '{sampling_cfg.filter}' is not one of {', '.join(FILTERS)}")
    if sampling_cfg.max_rounds < 1:
        raise ValueError(f"grpo.sampling.max_rounds must be at least 1, got {sampling_cfg.max_rounds}")

    class Trainer(DynamicSampling, trainer_cls):
        sampling_filter = sampling_cfg.filter
        sampling_max_rounds = sampling_cfg.max_rounds

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sampling_history = []

    Trainer.__name__ = f"DynamicSampling{trainer_cls.__name__}"
    return Trainer
