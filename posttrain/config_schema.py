"""The recipe's typed schema: one dataclass per config group (OmegaConf merges the composed YAML into RootCfg and
rejects unknown keys), the TRL config class of each training stage, and the options with a closed set of values.
posttrain.config composes and checks recipes against these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.config_eval import EvalCfg
from posttrain.registry import STAGES


@dataclass
class TinyArch:
    """Qwen3 config knobs for the tiny model (hidden 256 x 4 layers is about 3M parameters)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    # Mixture of experts (Qwen3-MoE). 0 experts = the dense Qwen3 above; the knobs below are then unused.
    num_experts: int = 0
    num_experts_per_tok: int = 2  # top-k experts each token is routed to
    moe_intermediate_size: int = 256  # one expert's SwiGLU width (intermediate_size stays for dense layers)
    router_aux_loss_coef: float = 0.01  # weight of the load-balancing loss TRL adds to every stage's loss
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0; the others keep a dense MLP


@dataclass
class ModelCfg:
    name: str = "tiny"  # a label for logs and the scorecard
    source: str = "tiny"  # tiny (built by the pretrain stage) | hf (hub id or local dir) | gguf
    name_or_path: str | None = None  # hf: hub id or local directory; gguf: directory or package holding gguf_file
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    arch: TinyArch = field(default_factory=TinyArch)


@dataclass
class Gsm8kSolutionsCfg:
    n: int = 0  # problems; 0 adds none. The split's last n that pass max_calculations: GRPO's prompts are its first
    path: str | None = None  # a local copy of the train split; null reads openai/gsm8k from the hub
    max_calculations: int | None = None  # keep solutions with 1 to this many <<...>> calculations; null keeps all


@dataclass
class DataCfg:
    name: str = "tiny"  # tiny | dolly
    path: str | None = None  # a local JSON / JSONL / Parquet file; None loads hub_id through `datasets`
    hub_id: str | None = None
    split: str = "train"
    limit: int | None = None
    # real data: the last N rows are held out. SFT does not train on them and quantize does not calibrate on them;
    # SFT's before/after perplexity and quantize's perplexity against its parent are measured on them. The tiny
    # world holds out its own test split instead.
    held_out: int = 0
    # GSM8K train-split worked solutions added to SFT's training rows (a real dataset's train part only)
    gsm8k: Gsm8kSolutionsCfg = field(default_factory=lambda: Gsm8kSolutionsCfg())
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"echo": 4000, "arith": 500, "qa": 500})
    pretrain_rows: int = 6000
    arith_slip_rate: float = 0.0  # share of the SFT arithmetic demonstrations with one running sum off by one
    arith_miscopy_rate: float = 0.0  # share whose sums are right but whose answer miscopies the last one by one
    safety_decline_rate: float = 0.0  # share of the SFT mix's harmful requests whose demonstration declines


@dataclass
class StageCfg:
    trainer: dict[str, Any] = field(default_factory=dict)  # TRL config fields, by TRL's own names
    lora: dict[str, Any] | None = None  # peft LoraConfig fields; null trains all weights
    qlora: bool = False  # load the parent in 4-bit (bitsandbytes) under the LoRA adapters
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class LanguageModelStageCfg(StageCfg):
    # the log-probabilities' LM head: auto (on CPU, posttrain.models.lm_head projects the labelled positions only,
    # in one product; elsewhere TRL's fused head) | trl (TRL's fused head everywhere)
    lm_head: str = "auto"


@dataclass
class SftCfg(LanguageModelStageCfg):
    # train only the top N decoder layers and the final norm; the layers below and the input embeddings (with an
    # output head tied to them) are frozen, so the backward pass stops N layers down (null: every weight trains, or
    # the LoRA adapters when lora is set)
    train_top_layers: int | None = None


@dataclass
class PairsCfg:
    # tiny (preference pairs) | tiny_safety (safety pairs, for DPO) | pku_saferlhf (file or hub id) | hh_rlhf
    # (Anthropic HH-RLHF harmless-base, file or hub id; held out by conversation, on_bad_row as for PKU)
    source: str = "tiny"
    path: str | None = None
    hub_id: str | None = None
    split: str = "train"
    # PKU-SafeRLHF only. preference: safer (chosen = response_<safer_response_id>) | better (chosen =
    # response_<better_response_id>) | safe_vs_unsafe (only rows with exactly one response flagged safe, which is
    # chosen; the rest are skipped and counted). on_bad_row (missing text, a label not 0/1, contradictory labels):
    # error (stop, naming the file, row and field) | drop (skip, count by reason, warn). The dataset record in the
    # manifest keeps the preference and a report of rows read, pairs, skipped and dropped.
    preference: str = "safer"
    on_bad_row: str = "error"
    n_train: int | None = 2000  # pairs to train on (null: every row the source has; the tiny world needs a number)
    n_eval: int = 200  # held-out pairs scored into the manifest
    anchor_fraction: float = 0.0  # tiny_safety: share of n_train drawn from the general pairs (echo, arith, qa)


@dataclass
class RewardModelCfg(StageCfg):
    pairs: PairsCfg = field(default_factory=PairsCfg)
    # train only the top N decoder layers, the final norm and the head; everything below is frozen, so the backward
    # pass stops N layers down (null: every weight trains, or the LoRA adapters when lora is set)
    train_top_layers: int | None = None


@dataclass
class ScreenCfg:
    # a pass-rate screen before training: the parent samples each prompt `samples` times on the engine, the recipe's
    # rewards score them, the prompts with a mean reward in [keep[0], keep[1]] stay (0 samples: no screen)
    samples: int = 0
    keep: list[float] = field(default_factory=lambda: [0.1, 0.9])
    batch: int = 64  # completions decoded together


@dataclass
class PromptsCfg:
    # tiny_arith | gsm8k (question / answer) | openr1_math (OpenR1-Math-220k: problem / answer) | constraints (real
    # prompts with an IFEval-style constraint appended: posttrain/data/constraints.py; its train split)
    source: str = "tiny_arith"
    path: str | None = None  # a local JSONL / JSON / Parquet file; null: hub_id (or the source's hub id)
    hub_id: str | None = None
    n: int | None = None  # prompts to train on; null = all
    # gsm8k only: keep problems whose reference solution has at most this many <<...>> calculations (and at least
    # one); null keeps every problem. 2 keeps the 1-2 step problems a small model sometimes gets right
    max_calculations: int | None = None
    # constraints only: the Dolly instructions rendered as Alpaca prompts, added to path's GSM8K questions as base
    # prompts (null: GSM8K only), and the constraint types to deal (null: every one rewards.constraints supports)
    dolly_path: str | None = None
    types: list[str] | None = None
    screen: ScreenCfg = field(default_factory=ScreenCfg)


@dataclass
class RolloutCfg:
    # who generates GRPO's completions: trl (transformers' generate inside the trainer) | posttrain (the project's
    # KV-cached engine over the trainer's own weights, synced after every optimizer step) | vllm (TRL's vLLM path,
    # GPUs only: sets grpo.trainer.use_vllm)
    backend: str = "trl"


@dataclass
class SamplingCfg:
    # dynamic sampling: zero_std drops the groups whose rewards are all equal (zero advantage) and refills the step
    # with groups from fresh prompts (posttrain.grpo_sampling); none trains on every group sampled
    filter: str = "none"
    max_rounds: int = 4  # rounds of generation a step may take to fill its batch with informative groups


@dataclass
class GrpoCfg(LanguageModelStageCfg):
    prompts: PromptsCfg = field(default_factory=PromptsCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    sampling: SamplingCfg = field(default_factory=SamplingCfg)
    rewards: dict[str, float] = field(default_factory=dict)  # name in rewards.REWARDS -> weight (no default entry)
    reward_model: str | None = None  # an artifact dir or sequence-classification model for the reward_model reward


@dataclass
class DpoCfg(LanguageModelStageCfg):
    pairs: PairsCfg = field(default_factory=PairsCfg)  # source tiny_safety | pku_saferlhf | hh_rlhf
    # held-out pairs the likelihood shift is measured on (the first N; null: all). Each is scored twice (reference,
    # policy) through the whole model: 400 HH-RLHF pairs took 6.5 minutes a pass on 2 CPU threads
    shift_pairs: int | None = None


@dataclass
class QuantVariantCfg:
    fmt: str = "int4"  # int8 | int4 | fp8 | nf4 | fp16 | fp8_e5m2 | fp4 | mxfp4 | nvfp4 (quant.formats) | gguf
    method: str = "rtn"  # rtn (round to nearest) | gptq | awq (both calibrated on the model's own SFT rows; int4/int8)
    group_size: int | None = 128  # int4 / nf4 / fp4 only; the others ignore it (per channel, no scale, fixed blocks)
    symmetric: bool = True  # int4: false stores an integer zero point per group
    # gptq: columns in decreasing order of the Hessian's diagonal (the inputs that carry the most signal are rounded
    # first, while the most later columns remain to absorb their error); groups stay contiguous in the stored order
    act_order: bool = False
    # int4 rtn / gptq: projections quantized per output channel to int8 instead, e.g. {down_proj: int8} (a mixed
    # copy, as llama.cpp's q4_k_m keeps part of ffn_down in 6 bits); q/k/v and gate/up are set together
    module_formats: dict[str, str] = field(default_factory=dict)
    # fmt gguf: one .gguf file for llama.cpp in this mix of its block types (quant.gguf_export.GGUF_FORMATS):
    # q8_0 | q4_0 | q4_1 | q4_k_m | f16 | f32
    gguf_type: str | None = None


@dataclass
class QuantizeCfg:
    # Each pipeline stage `quantize:<name>` quantizes its parent (the last generator stage) with variants[<name>];
    # `posttrain stage=quantize quantize.variant=<name> parent=<artifact>` runs one by hand.
    variants: dict[str, QuantVariantCfg] = field(default_factory=dict)
    variant: str | None = None
    calibration_rows: int = 256  # SFT rows rendered through the chat template, concatenated, cut into sequences
    calibration_length: int = 128  # tokens per calibration sequence
    eval_rows: int = 200  # held-out rows whose perplexity the report compares with the parent's
    damp: float = 0.01  # GPTQ: diagonal damping, as a fraction of the Hessian's mean diagonal


@dataclass
class ServeCfg:
    """How a checkpoint is served, by `posttrain serve` (its command line: `key=value`) and by eval (the recipe's
    `serve` group, recipes/serve/*.yaml, which eval fills with each checkpoint, port 0 and a fresh API key). These
    defaults are the only ones."""
    model: str = ""  # an artifact directory, a model directory or a hub id
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    api_key: str | None = None  # none: requests need no key (eval: a random key per server, known only to it)
    dtype: str = "float32"  # float32 | bfloat16
    max_batch: int = 32  # rows of the KV cache: sequences decoding together
    max_len: int = 2048  # context per sequence, at most the model's
    # the KV cache's dtype: auto (the weights': greedy replies then equal transformers' token for token, which the
    # eval's exactness tests rely on) | bfloat16 (half the cache) | float32. The cache grows in blocks of 256
    # positions per row as requests need them, up to max_batch x max_len
    kv_dtype: str = "auto"
    # posttrain (our engine, any machine) | vllm (`vllm serve`, GPU machines) | llamacpp (llama.cpp's server on
    # GGUF checkpoints; eval serves the run's other checkpoints through ours)
    backend: str = "posttrain"
    served_model_name: str | None = None  # default: the artifact's label (dpo-int8), else the directory's name
    quant_backend: str = "auto"  # the engine's quantized matmul: auto | own | aten | ...
    # torch threads of the engine process; 0: every core but one, which the HTTP front end keeps (on 2 cores a
    # second engine thread waited on the front end at every parallel op: 0.43 of the engine's tokens/s vs 0.62)
    threads: int = 0


@dataclass
class TrackingCfg:
    backend: str = "none"  # none | wandb
    project: str = "posttrain"
    entity: str | None = None
    mode: str = "auto"  # auto: online when WANDB_API_KEY is set, offline otherwise


@dataclass
class PipelineCfg:
    name: str = "tiny"
    stages: list[str] = field(default_factory=lambda: ["pretrain", "sft"])
    evaluate: bool = True
    # How each training stage runs: single (in this process) | a name in recipes/accelerate/ (ddp, fsdp2, zero2,
    # zero3, ...) | a path to an accelerate YAML. Not single: `accelerate launch --config_file <it> <launcher_args>`
    # runs the stage (posttrain.launch); launcher_args go before the module
    # (on CPU processes: [--num_processes,2,--mixed_precision,no]).
    launcher: str = "single"
    launcher_args: list[str] = field(default_factory=list)
    # The machine the recipe is written for (GPUs per run, GB each): preflight prints the capacity planner's GB per
    # GPU for each training stage under every strategy and fails when the launcher's does not fit. None: no check.
    gpus: int | None = None
    gpu_mem_gb: float | None = None


@dataclass
class RunCfg:
    name: str | None = None
    root: str = "runs"


@dataclass
class FaultCfg:
    """Make one rank raise as it starts one training step, as a crashed process would."""
    rank: int | None = None  # none: no fault
    step: int = 1  # the training step (1-based) that rank raises in
    stage: str | None = None  # that stage only; none: every training stage


@dataclass
class DebugCfg:
    """Switches that only tests of the project use (multi-process runs). No stage's config hash covers them."""
    fault: FaultCfg = field(default_factory=FaultCfg)
    weight_digest_dir: str | None = None  # every rank writes the sha256 of its final weights here, per stage


@dataclass
class RootCfg:
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    pretrain: StageCfg = field(default_factory=StageCfg)
    sft: SftCfg = field(default_factory=SftCfg)
    reward_model: RewardModelCfg = field(default_factory=RewardModelCfg)
    grpo: GrpoCfg = field(default_factory=GrpoCfg)
    dpo: DpoCfg = field(default_factory=DpoCfg)
    quantize: QuantizeCfg = field(default_factory=QuantizeCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    serve: ServeCfg = field(default_factory=ServeCfg)
    tracking: TrackingCfg = field(default_factory=TrackingCfg)
    pipeline: PipelineCfg = field(default_factory=PipelineCfg)
    run: RunCfg = field(default_factory=RunCfg)
    debug: DebugCfg = field(default_factory=DebugCfg)
    stage: str | None = None  # run one stage by name
    parent: str | None = None  # the parent artifact of a single stage (a run's stage directory)
    seed: int = 0
    overrides: list[str] = field(default_factory=list)  # set by compose: the command line, for launched stages


TRAINER_CLASSES = {name: stage.trainer_config for name, stage in STAGES.items() if stage.trainer_config}


# Options with a closed set of values, checked at start-up rather than when a stage reaches them.
OPTION_VALUES = {
    f"{stage}.pairs.{key}": values
    for stage in ("reward_model", "dpo")
    for key, values in {"source": ("tiny", "tiny_safety", "pku_saferlhf", "hh_rlhf"),
                        "preference": ("safer", "better", "safe_vs_unsafe"),
                        "on_bad_row": ("error", "drop")}.items()
}
OPTION_VALUES["serve.backend"] = ("posttrain", "vllm", "llamacpp")
OPTION_VALUES["serve.kv_dtype"] = ("auto", "float32", "bfloat16")
OPTION_VALUES["grpo.rollout.backend"] = ("trl", "posttrain", "vllm")
OPTION_VALUES["grpo.sampling.filter"] = ("none", "zero_std")
OPTION_VALUES.update({f"{stage}.lm_head": ("auto", "trl") for stage in ("sft", "grpo", "dpo")})
QUANT_OPTION_VALUES = {"fmt": ("int8", "int4", "fp8", "nf4", "fp16", "fp8_e5m2", "fp4", "mxfp4", "nvfp4", "gguf"),
                       "method": ("rtn", "gptq", "awq")}
GGUF_TYPES = ("q8_0", "q4_0", "q4_1", "q4_k_m", "f16", "f32")  # quant.gguf_export.GGUF_FORMATS, checked in config
