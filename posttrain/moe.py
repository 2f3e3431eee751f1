"""Mixture-of-experts training: which experts the tokens of each logging window went to, and the load-balancing loss
per MoE layer and sequence.

`MoeRouterCallback` is a `transformers.TrainerCallback` every training stage attaches; on a dense model it does
nothing. At the start of training it hooks each MoE layer's router (transformers' `*TopKRouter` modules:
`Qwen3MoeTopKRouter`, ...) and the model's top forward:

- **Expert shares.** The router hook counts the top-k experts each token is sent to; padding is left out when the
  model was called with an `attention_mask` whose size matches the router's tokens. Only forwards with gradients on
  are counted: the training forwards (every micro-batch of a gradient-accumulation step), not GRPO's sampling or
  the no-grad old / reference log-probability passes. At every logging step the window's shares go into the logs
  and into that step's `trainer.state.log_history` entry, and the window starts again:

      expert_share/layer{L}/expert{E}      share of layer L's top-k assignments that went to expert E (sums to 1)
      expert_share/min, expert_share/max   over every layer and expert
      expert_share/min_ratio               min share / fair share (1 / experts): 1.0 is balanced, 0 a dead expert

  `metrics()` gives the last window for the manifest. Reporters that come before this callback in the trainer's
  list (W&B, ...) do not see the shares: transformers hands them the logs first; `log_history` and the console do.

- **Load balancing per layer and sequence.** TRL adds `router_aux_loss_coef x outputs.aux_loss` to the SFT, GRPO
  and DPO losses. transformers (and TRL's fused LM head) compute that aux loss once, from token fractions and router
  probabilities *averaged over layers*: it is at its minimum when the layer average is balanced while every layer
  sends all its tokens to its own two experts, which is what the tiny MoE did (min share / fair share 0.00 in every
  SFT window, at coefficients 0.01 to 1.0). Switch Transformer adds the loss for each MoE layer; the hook replaces
  `outputs.aux_loss` with the mean over layers of that loss, computed from this forward's router logits. Balanced
  batches still starved experts on one kind of data (each task family of the tiny world used its own experts, and
  GRPO trains on arithmetic alone), so by default the loss is computed per sequence and averaged (DeepSeek-V3's
  sequence-wise balance): `balance="sequence"` (default) | `"layer"` | `"transformers"` (leave it as it is).

- **A config that generates.** TRL's SFTTrainer turns `output_router_logits` on in the model's config; at the end of
  training it is turned off again, so the saved artifact runs `generate` with a KV cache (posttrain.models.tiny).
"""

from __future__ import annotations

import logging
import re

import torch
from transformers import TrainerCallback

log = logging.getLogger("posttrain")
LAYER = re.compile(r"layers\.(\d+)\.")
# The load-balancing loss the trainers optimise: transformers' own (token fractions and router probabilities averaged
# over layers), per layer over the whole batch, or per layer and per sequence (see `balance_loss`)
BALANCE = ("transformers", "layer", "sequence")


# --- routers -------------------------------------------------------------------------------------------------------
def is_router(module: torch.nn.Module) -> bool:
    """transformers 5's MoE routers (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`, ...) carry `top_k` and `num_experts`."""
    return ("Router" in type(module).__name__ and isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int))


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> router module, for every MoE layer of `model` (empty for a dense model)."""
    routers = {}
    for name, module in model.named_modules():
        if is_router(module):
            match = LAYER.search(name)
            if match is None:
                raise ValueError(f"router module '{name}' has no 'layers.<index>.' in its name")
            routers[int(match.group(1))] = module
    return dict(sorted(routers.items()))


def router_logits_and_experts(router: torch.nn.Module, output) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's logits [tokens, experts] and the [tokens, top_k] experts it chose: its third output (logits,
    weights, indices) when it returns them, else the top-k of its logits."""
    logits = output[0] if isinstance(output, tuple) else output
    if isinstance(output, tuple) and len(output) == 3 and not output[-1].is_floating_point():
        return logits, output[-1]
    return logits, torch.topk(logits, router.top_k, dim=-1).indices


# --- shares --------------------------------------------------------------------------------------------------------
def expert_shares(counts: dict[int, list[float]]) -> dict[int, list[float]]:
    """Per layer, each expert's share of that layer's top-k assignments; layers that saw no token are left out.

    >>> expert_shares({0: [3.0, 1.0], 1: [0.0, 0.0]})
    {0: [0.75, 0.25]}
    """
    return {layer: [c / sum(row) for c in row] for layer, row in counts.items() if sum(row) > 0}


def min_share_ratio(shares: dict[int, list[float]]) -> float:
    """The smallest share over every layer and expert, divided by the fair share 1 / experts (1.0 = balanced).

    >>> min_share_ratio({0: [0.5, 0.5], 1: [0.9, 0.1]})
    0.2
    """
    return min(min(row) * len(row) for row in shares.values())


def share_logs(shares: dict[int, list[float]]) -> dict[str, float]:
    """The log entries of one window: every layer/expert share, their min and max, and min share / fair share.

    >>> share_logs({0: [0.75, 0.25]})["expert_share/min_ratio"]
    0.5
    """
    logs = {f"expert_share/layer{layer}/expert{e}": s for layer, row in shares.items() for e, s in enumerate(row)}
    flat = [s for row in shares.values() for s in row]
    logs["expert_share/min"], logs["expert_share/max"] = min(flat), max(flat)
    logs["expert_share/min_ratio"] = min_share_ratio(shares)
    return logs


# --- the load-balancing loss, per layer (and sequence) ---------------------------------------------------------------
def balance_loss(router_logits: list[torch.Tensor], top_k: int, attention_mask: torch.Tensor | None = None,
                 per_sequence: bool = False) -> torch.Tensor:
    """Switch Transformer's load-balancing loss for each MoE layer, averaged over layers: experts x sum over experts
    of (fraction of the top-k assignments it got) x (its mean router probability); `top_k` when balanced.

    `router_logits`: one [tokens, experts] per layer, tokens = batch x seq. `attention_mask` [batch, seq] leaves
    padding out when its size is the token count. `per_sequence` computes the loss over each sequence's tokens and
    averages over sequences (DeepSeek-V3's sequence-wise balance): a batch can be balanced while every sequence of
    one kind (arithmetic, say) uses the same few experts, and a later stage that trains on that kind alone starves
    the others.
    """
    tokens, experts = router_logits[0].shape
    if attention_mask is not None and attention_mask.numel() == tokens:
        mask = attention_mask.to(router_logits[0].device, torch.float32)  # [batch, seq]
    else:
        mask = torch.ones(1, tokens, device=router_logits[0].device)
    if not per_sequence:
        mask = mask.reshape(1, -1)  # the whole batch is one group
    groups = mask.shape[0]
    weight = mask.unsqueeze(-1)  # [groups, n, 1]
    counted = weight.sum(dim=1).clamp(min=1)  # [groups, 1]
    per_layer = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1).reshape(groups, -1, experts)  # [groups, n, experts]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = torch.zeros_like(probs).scatter_(-1, chosen, 1.0)  # 1 where the expert is in the token's top-k
        fraction = (assigned * weight).sum(dim=1) / counted  # [groups, experts], sums to top_k
        mean_prob = (probs * weight).sum(dim=1) / counted  # [groups, experts], sums to 1
        per_group = experts * (fraction * mean_prob).sum(dim=-1)  # [groups]
        per_layer.append(per_group[mask.sum(dim=1) > 0].mean())
    return torch.stack(per_layer).mean()


# --- the callback --------------------------------------------------------------------------------------------------
class MoeRouterCallback(TrainerCallback):
    """Expert shares per logging window, the load-balancing loss per layer (and sequence), a config that generates."""

    def __init__(self, balance: str = "sequence") -> None:
        if balance not in BALANCE:
            raise ValueError(f"balance '{balance}' is not one of {', '.join(BALANCE)}")
        self.balance = balance
        self.handles: list = []
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [experts] top-k assignments in this window
        self.top_k = 0
        self.token_mask: torch.Tensor | None = None  # attention mask of the forward in progress, [batch, seq]
        self.forward_logits: dict[int, torch.Tensor] = {}  # layer -> router logits of the forward in progress
        self.last_window: dict[int, list[float]] = {}
        self.windows = 0

    # --- hooks -------------------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> int:
        """Hook every router of `model` and its top forward; returns the router count (0: dense, nothing hooked)."""
        self.detach()
        routers = find_routers(model)
        if not routers:
            return 0
        self.top_k = next(iter(routers.values())).top_k
        self.handles.append(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        self.handles.append(model.register_forward_hook(self._forward_ends))
        for layer, router in routers.items():
            self.counts[layer] = torch.zeros(router.num_experts, dtype=torch.float64, device=router.weight.device)
            self.handles.append(router.register_forward_hook(self._router_hook(layer)))
        log.info("moe: %d MoE layers of %d experts (top-%d); logging expert shares; load-balancing loss %s",
                 len(routers), next(iter(routers.values())).num_experts, self.top_k,
                 {"transformers": "as transformers computes it (layer-averaged)", "layer": "per layer",
                  "sequence": "per layer and sequence"}[self.balance])
        return len(routers)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.token_mask, self.forward_logits = [], None, {}

    def _forward_starts(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        self.token_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self.forward_logits = {}

    def _router_hook(self, layer: int):
        def hook(router: torch.nn.Module, inputs, output) -> None:
            if not torch.is_grad_enabled():  # sampling and reference passes run without gradients
                return
            logits, chosen = router_logits_and_experts(router, output)  # [tokens, experts], [tokens, top_k]
            self.forward_logits[layer] = logits
            chosen = chosen.detach()
            weights = None
            if self.token_mask is not None and self.token_mask.numel() == chosen.shape[0]:
                weights = self.token_mask.reshape(-1, 1).expand_as(chosen).reshape(-1).to(chosen.device, torch.float64)
            counts = self.counts[layer]
            counts += torch.bincount(chosen.reshape(-1), weights=weights, minlength=counts.numel()).to(counts)

        return hook

    def _forward_ends(self, module, args, output):
        # aux_loss is set only when the trainer asked for router logits, i.e. on the forwards it trains on
        if self.balance == "transformers" or getattr(output, "aux_loss", None) is None or not self.forward_logits:
            return None
        logits = [self.forward_logits[layer] for layer in sorted(self.forward_logits)]
        loss = balance_loss(logits, self.top_k, self.token_mask, per_sequence=self.balance == "sequence")
        output.aux_loss = loss.to(output.aux_loss)
        self.forward_logits = {}
        return output

    # --- windows -----------------------------------------------------------------------------------------------
    def take_window(self) -> dict[int, list[float]]:
        """This window's shares (summed over data-parallel ranks), and a fresh window."""
        if not self.counts:
            return {}
        stacked = torch.stack(list(self.counts.values()))  # [layers, experts]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(stacked)  # every rank logs, so every rank reaches this call
        rows = dict(zip(self.counts, stacked.tolist()))
        for counts in self.counts.values():
            counts.zero_()
        return expert_shares(rows)

    def metrics(self) -> dict:
        """For the manifest: the last logging window's shares per layer and its min share / fair share."""
        if not self.last_window:
            return {}
        return {"expert_share_last_window": {f"layer{k}": v for k, v in self.last_window.items()},
                "min_expert_share_ratio": min_share_ratio(self.last_window), "expert_share_windows": self.windows}

    # --- TrainerCallback events --------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.attach(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.handles and model is not None and hasattr(model, "config"):
            model.config.get_text_config().output_router_logits = False  # TRL's SFTTrainer turned it on
        self.detach()

    def on_log(self, args, state, control, logs=None, **kwargs):
        shares = self.take_window()
        if not shares:  # a dense model, or nothing trained since the last log (an eval log, the closing summary)
            return
        entries = share_logs(shares)
        if logs is not None:
            logs.update(entries)
        if state.log_history:  # Trainer.log appended this step's entry just before calling on_log
            state.log_history[-1].update(entries)
        self.last_window, self.windows = shares, self.windows + 1
