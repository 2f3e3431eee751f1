"""grpo: instruct -> reasoning with TRL's GRPOTrainer; rewards by name and weight from the recipe.

Prompts are rendered through the model's chat template by TRL (conversational prompts); each is sampled
`num_generations` times and every completion is scored by the recipe's rewards (`grpo.rewards`: name in
`rewards.REWARDS` -> weight; `reward_model` scores with a reward-model artifact). TRL's own knobs keep their names
under `grpo.trainer`.

Every scored completion goes to `completions.jsonl` in the stage directory (and to W&B as a table when tracking
is on, through TRL's `log_completions`). Per generation batch the stage logs, beside TRL's own reward metrics, the
fraction of groups whose rewards are all equal (they have zero advantage and teach nothing) and advantage
statistics computed with `rewards.advantages.group_advantages`.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from pathlib import Path

from posttrain import sharding, training
from posttrain.data.prompts import load_prompts
from posttrain.data.startup import prompt_jobs, startup_check
from posttrain.grpo_record import StepTimer, sampling_summary, step_split
from posttrain.grpo_sampling import dynamic_sampling_trainer
from posttrain.models.lm_head import use_compact_lm_heads
from posttrain.models.loading import load_model
from posttrain.moe import MoeRouterCallback
from posttrain.resume import checkpoint_step, cut_step_rows, last_checkpoint, train_from_checkpoint
from posttrain.serve.engine import Engine, SamplingParams, default_stop_ids, model_from_hf
from posttrain.serve.rollout import EngineRollout
from posttrain.training import StageRun
from rewards import REWARDS
from rewards.advantages import equal_reward_fraction, group_advantages
from rewards.reward_model import RewardModelScorer
from rewards.text import completion_text

log = logging.getLogger("posttrain")
COMPLETIONS = "completions.jsonl"
FIRE_BATCHES = 2  # generation batches after which a reward that never gave a non-zero score is reported


# --- rewards, and the table of every scored completion -------------------------------------------------------------
class RewardTable:
    """Wraps the recipe's reward functions for TRL and records what they gave.

    TRL calls the reward functions one after another on the same generation batch; when the last one has
    answered, the weighted reward, the group advantages and the completions are written out and logged.
    """

    def __init__(self, funcs: dict[str, tuple], group_size: int, scale: str, path: Path):
        self.funcs, self.group_size, self.scale, self.path = funcs, group_size, scale, path
        self.pending: dict[str, list] = {}
        self.history: list[dict] = []  # per generation batch: step, mean reward, equal-group fraction
        self.fire_batches, self.fired = 0, {}  # check_rewards_fire's count and which rewards gave a non-zero score

    def check_rewards_fire(self, per_func: dict[str, list]) -> None:
        """Warn once, after the first FIRE_BATCHES generation batches, about each reward that gave 0 (or no score)
        to every completion so far: it cannot fire on what this model writes (say, a format reward for a block the
        SFT data never taught), so it only adds noise to the weights' sum."""
        if self.fire_batches >= FIRE_BATCHES:
            return
        self.fire_batches += 1
        for name, scores in per_func.items():
            self.fired[name] = self.fired.get(name, False) or any(s not in (None, 0, 0.0) for s in scores)
        if self.fire_batches == FIRE_BATCHES:
            for name in (n for n, fired in self.fired.items() if not fired):
                log.warning("grpo: reward '%s' scored 0 on every completion of the first %d generation batches: it "
                            "cannot fire on this model's replies; drop it from grpo.rewards or teach its format "
                            "first", name, FIRE_BATCHES)

    def wrapped(self) -> list:
        out = []
        for name, (fn, _) in self.funcs.items():
            def call(prompts, completions, _name=name, _fn=fn, **kwargs):
                scores = _fn(prompts=prompts, completions=completions, **kwargs)
                self.pending[_name] = scores
                if len(self.pending) == len(self.funcs):
                    self.flush(prompts, completions, kwargs)
                return scores

            call.__name__ = name  # TRL logs rewards/<name>/mean
            out.append(call)
        return out

    def flush(self, prompts, completions, kwargs) -> None:
        per_func, self.pending = self.pending, {}
        if training.world_size() > 1:
            # each process scored its own slice of the generation batch: gather them in rank order (the trainer's
            # global order, so groups stay whole); every rank logs the same statistics, rank 0 writes the table
            names = list(per_func)
            rows = training.gather_rows([list(r) for r in zip(prompts, completions, *(per_func[n] for n in names))])
            prompts, completions = [r[0] for r in rows], [r[1] for r in rows]
            per_func = {n: [r[2 + k] for r in rows] for k, n in enumerate(names)}
        totals = []
        for i in range(len(completions)):
            parts = [(per_func[n][i], w) for n, (_, w) in self.funcs.items() if per_func[n][i] is not None]
            totals.append(sum(r * w for r, w in parts) if parts else math.nan)
        # TRL's own advantages (sum_then_normalize, its default): unscorable completions out of the baseline
        advantages = group_advantages(totals, self.group_size, scale=self.scale)
        equal = equal_reward_fraction(advantages, self.group_size)  # groups whose advantages are all 0
        self.check_rewards_fire(per_func)
        state = kwargs.get("trainer_state")
        step = state.global_step if state is not None else None
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            log_metric("equal_reward_groups", equal)
            log_metric("advantages/abs_mean", sum(map(abs, advantages)) / len(advantages))
            log_metric("advantages/max", max(advantages))
            log_metric("advantages/min", min(advantages))
        scored = [t for t in totals if not math.isnan(t)]
        self.history.append({"step": step, "reward": sum(scored) / len(scored) if scored else None,
                             "equal_reward_groups": equal})
        if not training.is_main_process():
            return
        with self.path.open("a") as f:
            for i, completion in enumerate(completions):
                prompt = prompts[i]
                f.write(json.dumps({
                    "step": step,
                    "prompt": prompt[-1]["content"] if isinstance(prompt, list) else prompt,
                    "completion": completion_text(completion),
                    "rewards": {n: per_func[n][i] for n in self.funcs},
                    "reward": None if math.isnan(totals[i]) else totals[i],
                    "advantage": advantages[i],
                }) + "\n")


def build_rewards(cfg, run: StageRun) -> dict[str, tuple]:
    """name -> (function, weight) from `grpo.rewards`; `reward_model` loads the scorer named by the recipe."""

    funcs = {}
    for name, weight in cfg.grpo.rewards.items():
        if name == "reward_model":
            path = cfg.grpo.reward_model or run.inputs.get("reward_model")
            if path is None:
                raise ValueError("grpo.rewards names reward_model, but there is no reward_model stage in this "
                                 "pipeline and grpo.reward_model (an artifact or model path) is empty")
            with sharding.loading_whole():  # each rank scores its own completions with a whole, frozen copy
                funcs[name] = (RewardModelScorer(path), float(weight))
        elif name in REWARDS:
            funcs[name] = (REWARDS[name], float(weight))
        else:
            raise ValueError(f"grpo.rewards: unknown reward '{name}'; valid: {', '.join([*REWARDS, 'reward_model'])}")
    if not funcs:
        raise ValueError("grpo.rewards is empty: GRPO needs at least one reward")
    return funcs


def screen_prompts(rows: list[dict], screen, model, tokenizer, funcs: dict[str, tuple], args,
                   template_kwargs: dict) -> tuple[list[dict], dict | None]:
    """Keep the prompts the parent model passes some of the time: each is sampled `screen.samples` times on the
    engine (grpo.trainer's temperature, top-p / top-k and max_completion_length), scored by the recipe's weighted
    rewards, and kept when the mean lies in `screen.keep`. A group of a prompt the model always or never solves has
    zero advantage; screening spends generation once, before training, instead of every step. Returns the rows kept
    and the screen's record (each screened row's pass rate, in the manifest); with 0 samples, every row and None."""
    if not screen.samples:
        return rows, None
    lo, hi = screen.keep
    if training.world_size() > 1:
        raise ValueError("grpo.prompts.screen runs on one process (each would draw its own samples and keep other "
                         "prompts); screen in a one-process run, or set grpo.prompts.screen.samples=0")
    if not 0 <= lo <= hi <= 1 or screen.samples < 2:
        raise ValueError(f"grpo.prompts.screen: keep must be [lo, hi] within [0, 1] and samples at least 2, got "
                         f"keep {list(screen.keep)}, samples {screen.samples}")
    engine = Engine(model_from_hf(model), tokenizer, max_batch=screen.batch)
    params = SamplingParams(max_tokens=args.max_completion_length, temperature=args.temperature,
                            top_p=args.top_p if args.top_p is not None else 1.0, top_k=args.top_k or 0,
                            stop_token_ids=default_stop_ids(tokenizer))
    prompt_ids = tokenizer.apply_chat_template([r["prompt"] for r in rows], add_generation_prompt=True, tokenize=True,
                                               return_dict=True, **template_kwargs)["input_ids"]
    started = time.perf_counter()
    repeated = [list(ids) for ids in prompt_ids for _ in range(screen.samples)]
    texts = [c.text for c in engine.generate(repeated, params, progress=True)]
    columns = {k: [r[k] for r in rows for _ in range(screen.samples)] for k in rows[0] if k != "prompt"}
    prompts = [r["prompt"] for r in rows for _ in range(screen.samples)]
    totals = [0.0] * len(texts)
    for fn, weight in funcs.values():
        for i, score in enumerate(fn(prompts=prompts, completions=texts, **columns)):
            totals[i] += weight * (score or 0.0)
    rates = [sum(totals[i * screen.samples:(i + 1) * screen.samples]) / screen.samples for i in range(len(rows))]
    kept = [r for r, rate in zip(rows, rates) if lo <= rate <= hi]
    check_prompts_fill_a_step(len(kept), args, training.world_size())
    log.info("grpo: the screen kept %d of %d prompts with a pass rate in [%.2f, %.2f] (%d samples each, %.0f s); "
             "%d never passed, %d always did", len(kept), len(rows), lo, hi, screen.samples,
             time.perf_counter() - started, sum(r == 0 for r in rates), sum(r >= 1 for r in rates))
    return kept, {"samples": screen.samples, "keep": [lo, hi], "screened": len(rows), "kept": len(kept),
                  "pass_rates": [round(r, 4) for r in rates]}


def scale_name(scale_rewards) -> str:
    """TRL's scale_rewards (group | batch | none, or a bool in older recipes) as group_advantages' `scale`."""
    return {True: "group", False: "none"}.get(scale_rewards, str(scale_rewards))


SHARDED_ROLLOUT = ("grpo.rollout.backend=posttrain runs the engine on each process's own whole model, which DeepSpeed "
                   "and FSDP take over. Use rollout.backend=trl (or vllm on GPUs) with those launchers, or ddp")


def engine_rollout(tokenizer) -> EngineRollout:
    """The `posttrain` roll-out backend: TRL's rollout_func on the engine (built over the trainer's model at the
    first generation batch)."""
    warnings.filterwarnings("ignore", message="You are using 'rollout_func'")  # TRL marks it experimental
    return EngineRollout(tokenizer)


# --- the stage -----------------------------------------------------------------------------------------------------
def check_prompts_fill_a_step(n_prompts: int, args, world_size: int) -> None:
    """One optimizer step samples per_device_train_batch_size x gradient_accumulation_steps completions on each
    process, num_generations per prompt. With fewer prompts than that, the trainer's epoch ends before the first
    step and the stage "finishes" at global_step 0 with the weights untouched (seen on SmolLM2: 2 prompts against a
    step of 8), so this fails first, naming the keys."""
    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    needed = -(-completions // args.num_generations)
    if n_prompts < needed:
        raise ValueError(
            f"grpo: {n_prompts} prompts cannot fill one optimizer step, which samples {completions} completions "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x {world_size} processes) of num_generations "
            f"{args.num_generations} each, so {needed} prompts; raise grpo.prompts.n or lower those")


def load_step_prompts(cfg, args) -> tuple[list[dict], dict]:
    """grpo.prompts' rows and their dataset record, failing when they cannot fill one optimizer step."""
    rows, record = load_prompts(cfg.grpo.prompts, cfg.data.seed)
    check_prompts_fill_a_step(len(rows), args, training.world_size())
    return rows, record


def planned_length(args) -> int:
    return (getattr(args, "max_prompt_length", None) or 512) + args.max_completion_length


def adjust_args(args, cfg) -> dict:
    """TRL's GRPOConfig given the recipe's chat-template arguments (returned), completion tables when W&B records,
    and vLLM when the roll-outs use it."""
    template_kwargs = dict(cfg.grpo.chat_template_kwargs or {})
    if template_kwargs:
        args.chat_template_kwargs = template_kwargs
    args.log_completions = args.log_completions or "wandb" in (args.report_to or [])
    args.use_vllm = args.use_vllm or cfg.grpo.rollout.backend == "vllm"
    return template_kwargs


def open_reward_table(run: StageRun, funcs: dict, args) -> tuple[RewardTable, str | None]:
    """The completions table and the checkpoint to resume from: a fresh start owns the table; a resumed one keeps
    the rows up to its checkpoint's step and drops what the killed attempt scored after it."""
    table_path = run.out_dir / COMPLETIONS
    resume = last_checkpoint(run)
    if training.is_main_process():
        if not resume:
            table_path.unlink(missing_ok=True)
        elif dropped := cut_step_rows(table_path, checkpoint_step(resume)):
            log.info("grpo: dropped %d completions the killed attempt scored after %s", dropped, resume)
    return RewardTable(funcs, args.num_generations, scale_name(args.scale_rewards), table_path), resume


def log_setup(rows: list[dict], args, funcs: dict, cfg) -> None:
    sampling = cfg.grpo.sampling
    log.info("grpo: %d prompts x %d generations; rewards %s; roll-outs by %s; dynamic sampling %s", len(rows),
             args.num_generations, {n: w for n, (_, w) in funcs.items()}, cfg.grpo.rollout.backend,
             "off" if sampling.filter == "none" else f"{sampling.filter} (up to {sampling.max_rounds} rounds a step)")


def trained_metrics(trainer, moe: MoeRouterCallback, rows: list[dict], cfg) -> dict:
    """The manifest's GRPO metrics, all from the trainer's log_history (so a resumed run's cover the steps before
    its checkpoint): TRL's own, the reward curve, the step split and the sampling record; both split and curve are
    logged."""
    history = trainer.state.log_history
    step_seconds = step_split(history)
    log.info("grpo: seconds per step (%d steps): %s", step_seconds.pop("steps", 0),
             ", ".join(f"{k} {v:.3f}" for k, v in step_seconds.items()))
    curve = [{"step": h["step"], "reward": h["reward"], **{k: h[k] for k in h if k.startswith("rewards/")}}
             for h in history if "reward" in h]
    if curve:
        log.info("grpo: mean reward by logging step: %s", " ".join(f"{c['step']}:{c['reward']:.2f}" for c in curve))
    return {**training.train_metrics(trainer), **moe.metrics(), "reward_curve": curve,
            "completions_table": COMPLETIONS, "step_seconds": step_seconds, "prompts": len(rows),
            "rollout_backend": cfg.grpo.rollout.backend,
            "sampling": sampling_summary(history, trainer.args.num_generations)}


def main(cfg, run: StageRun) -> dict:
    from datasets import Dataset
    from trl import GRPOTrainer

    # --- config ------------------------------------------------------------------------------------------------
    args, location, tokenizer = training.open_stage(cfg, run, "GRPOConfig", seq_len=planned_length)
    template_kwargs = adjust_args(args, cfg)

    # --- model, prompts, rewards ---------------------------------------------------------------------------------
    model = load_model(location, cfg.model)
    rows, record = load_step_prompts(cfg, args)
    record["check"] = startup_check("grpo", prompt_jobs(cfg.grpo.prompts, rows), tokenizer,
                                    getattr(args, "max_prompt_length", None), template_kwargs, cfg.get("eval"),
                                    cfg.data.seed)
    funcs = build_rewards(cfg, run)
    rows, record["screen"] = screen_prompts(rows, cfg.grpo.prompts.screen, model, tokenizer, funcs, args,
                                            template_kwargs)
    table, resume = open_reward_table(run, funcs, args)
    args.reward_weights = [w for _, w in funcs.values()]  # TRL weights the rewards; the table records the same
    log_setup(rows, args, funcs, cfg)

    # --- train (resumes from the last checkpoint of a killed attempt) ------------------------------------------
    moe = MoeRouterCallback()  # MoE models: expert shares per logging step, per-layer balance loss
    rollout = engine_rollout(tokenizer) if cfg.grpo.rollout.backend == "posttrain" else None
    trainer_cls = dynamic_sampling_trainer(GRPOTrainer, cfg.grpo.sampling)  # TRL's own GRPOTrainer with filter none
    peft_config = training.lora_config(cfg.grpo.lora)
    trainer = trainer_cls(model=model, reward_funcs=table.wrapped(), args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[moe], rollout_func=rollout)
    if rollout is not None and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        raise ValueError(SHARDED_ROLLOUT)
    use_compact_lm_heads(trainer, "grpo", cfg.grpo.lm_head)  # on CPU, TRL's head scores every position, in tiles
    training.install_test_hooks(trainer, run)  # no-op unless the recipe's debug.fault names a rank
    StepTimer().attach(trainer)
    train_from_checkpoint(trainer, run, resume)

    # --- save ----------------------------------------------------------------------------------------------------
    model = trainer.model
    if peft_config is not None:  # sharded (FSDP, ZeRO-3): the merged model exists on rank 0 only
        model = sharding.merge_lora(trainer, lambda: load_model(location, cfg.model))
    reward_model = str(run.inputs.get("reward_model")) if "reward_model" in funcs else None
    return training.finish(run, model, tokenizer, trainer=trainer, datasets=[record],
                           metrics=trained_metrics(trainer, moe, rows, cfg),
                           extra={"resumed_from": resume, "base_model": str(location), "reward_model": reward_model})
