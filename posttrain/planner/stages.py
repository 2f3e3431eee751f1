"""The capacity planner per training stage of a composed pipeline recipe: the memory each GPU needs under every
strategy, beside the strategy the recipe's launcher uses, and whether that one fits.

    plans = stage_plans(cfg, load_config("Qwen/Qwen3-8B"), "zero3", gpus=8, gpu_mem_gb=80)
    print(render_stage_plans(plans))

What a stage puts through the model, from its recipe:
- the sequence is the trainer's max_length; GRPO's is a prompt budget of PROMPT_BUDGET tokens (GSM8K's p99 is about
  160) plus max_completion_length;
- DPO and the reward model put chosen and rejected through the model together, so their micro-batch counts twice;
- full-FT DPO also holds a frozen bf16 reference, sharded like the weights under ZeRO-3;
- GRPO's colocated vLLM keeps `vllm_gpu_memory_utilization` of each GPU for itself;
- LoRA stages are planned as LoRA at the recipe's rank, QLoRA stages as QLoRA.
Launchers map onto the planner's strategies: FSDP (1 or 2) shards weights, gradients and optimizer states as
ZeRO-3 does; ZeRO-3 with offload is planned as ZeRO-3 (offload only lowers GPU memory further).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.planner.memory import GB
from posttrain.planner.plan import plan_model
from posttrain.planner.report import table
from posttrain.planner.training import STRATEGIES, STRATEGY_NAMES

PROMPT_BUDGET = 512
TRAINING_STAGES = ("sft", "reward_model", "grpo", "dpo")
AS_PLANNED = {"single": "ddp", "ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
              "zero3_offload": "zero3", "fsdp1": "zero3", "fsdp2": "zero3"}


@dataclass
class StagePlan:
    stage: str
    method: str  # full | lora | qlora
    seq_len: int
    micro_batch: int  # sequences through the model at once (chosen + rejected count twice)
    usable_gb: float  # per GPU, after the planner's headroom and a colocated vLLM's share
    need_gb: dict[str, float]  # planner strategy -> GB per GPU, the DPO reference included
    strategy: str  # the planner's name for what the launcher runs

    @property
    def fits(self) -> bool:
        return self.need_gb[self.strategy] <= self.usable_gb


def stage_budget(cfg, stage: str, gpu_mem_gb: float, usable_fraction: float = 0.9) -> tuple[str, int, int, float]:
    """(method, seq_len, micro_batch, usable GB per GPU) for one training stage of a composed recipe."""
    block, trainer = cfg[stage], cfg[stage].trainer
    method = "lora" if block.get("lora") is not None else "full"
    if block.get("qlora"):
        method = "qlora"
    micro = trainer.per_device_train_batch_size
    seq = PROMPT_BUDGET + trainer.max_completion_length if stage == "grpo" else trainer.max_length
    if stage in ("dpo", "reward_model"):
        micro *= 2
    usable = usable_fraction * gpu_mem_gb
    if stage == "grpo" and trainer.get("use_vllm") and trainer.get("vllm_mode") == "colocate":
        usable -= trainer.vllm_gpu_memory_utilization * gpu_mem_gb
    return method, seq, micro, usable


def stage_plans(cfg, model_config: dict, launcher_strategy: str, gpus: int, gpu_mem_gb: float,
                stages=TRAINING_STAGES) -> list[StagePlan]:
    """One StagePlan per training stage the pipeline runs (of `stages`), under `launcher_strategy` (a name
    posttrain.sharding.requested_strategy returns)."""
    if launcher_strategy not in AS_PLANNED:
        raise ValueError(f"no planner strategy for launcher strategy {launcher_strategy!r}; known: "
                         f"{', '.join(AS_PLANNED)}")
    plans = []
    for stage in stages:
        if stage not in cfg.pipeline.stages:
            continue
        method, seq, micro, usable = stage_budget(cfg, stage, gpu_mem_gb)
        lora = cfg[stage].get("lora")
        plan = plan_model(model_config, gpus=gpus, gpu_mem_gb=gpu_mem_gb, seq_len=seq, micro_batch=micro,
                          lora_rank=lora.r if lora is not None else 16,
                          gradient_checkpointing=bool(cfg[stage].trainer.get("activation_checkpointing")))
        need = {}
        for strategy in STRATEGIES:
            reference = 0.0
            if stage == "dpo" and method == "full":  # the frozen reference policy, bf16
                reference = plan.training.base_bytes_bf16 / (gpus if strategy == "zero3" else 1)
            need[strategy] = (plan.training.row(method, strategy).total + reference) / GB
        plans.append(StagePlan(stage, method, seq, micro, usable, need, AS_PLANNED[launcher_strategy]))
    return plans


def render_stage_plans(plans: list[StagePlan], launcher: str) -> str:
    """A table: one row per stage, GB per GPU under each strategy, the launcher's marked with *, and a verdict."""
    header = ["stage", "method", "seq x micro", "usable GB", *(STRATEGY_NAMES[s] for s in STRATEGIES),
              f"launcher {launcher}"]
    rows = []
    for p in plans:
        cells = [f"{p.need_gb[s]:.1f}{'*' if s == p.strategy else ''}" for s in STRATEGIES]
        verdict = f"{STRATEGY_NAMES[p.strategy]}: {'fits' if p.fits else 'DOES NOT FIT'}"
        rows.append([p.stage, p.method, f"{p.seq_len} x {p.micro_batch}", f"{p.usable_gb:.1f}", *cells, verdict])
    return table(header, rows, left=(0, 1, 2, len(header) - 1))
