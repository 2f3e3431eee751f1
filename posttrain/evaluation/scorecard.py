"""Score every checkpoint of a run on the same suites and write `scorecard.json` and `scorecard.md`.

Each suite gives a greedy score per checkpoint; a suite that samples (arith) also gives pass@1, the mean score of
`eval.samples` replies per prompt drawn at `eval.temperature`. Stages whose artifact is not a generator (the reward
model) have no row.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from pathlib import Path

from omegaconf import OmegaConf

from posttrain.artifacts import manifest_sha256, now, read_manifest, verify_artifact, weight_files, write_json_atomic
from posttrain.config_schema import ServeCfg
from posttrain.evaluation import harness
from posttrain.evaluation.client import CheckpointProgress, chat_replies, latency_probe
from posttrain.evaluation.comparisons import changes, judged, render_changes, render_judged
from posttrain.evaluation.earlier import earlier_rows, row_stage_dir, with_earlier_rows
from posttrain.evaluation.provenance import base_model, render_base_model
from posttrain.evaluation.stats import mean_interval
from posttrain.evaluation.tool_loop import tool_figures, tool_loop_replies
from posttrain.evaluation.suites import build_suite, render_ifeval_types
from posttrain.models.likelihood import render_shift
from posttrain.models.loading import load_tokenizer
from posttrain.quant.gguf_names import gguf_file
from posttrain.registry import checkpoint_label, is_generator
from posttrain.serve.server import background_server

log = logging.getLogger("posttrain")
HEADERS = {"safety": "safe replies", "over_refusal": "benign answered", "pku_saferlhf": "PKU safe replies",
           "hh_harmful": "HH harmful refused", "benign": "real benign answered", "ifeval": "ifeval strict",
           "ifeval_loose": "ifeval loose", "ifeval_grounded": "ifeval grounded"}  # what the suite's score is a rate of


def mean(scores: list[float | None]) -> tuple[float, int]:
    applicable = [s for s in scores if s is not None]
    if not applicable:
        raise ValueError("no prompt of the suite was scorable")
    return sum(applicable) / len(applicable), len(applicable)


def requests_of(suites, eval_cfg) -> int:
    """Requests one checkpoint's eval sends: a greedy reply per prompt, the sampled replies of a sampling suite
    (one request with `n` choices per prompt) and the latency probe's."""
    return sum(len(s.rows) * (2 if s.samples else 1) for s in suites) + (eval_cfg.latency.requests or 0)


def score_summary(row: dict, suites) -> str:
    """The checkpoint's scores in one line: `echo 0.950, arith 0.400 (pass@1 0.312), ...`."""
    parts = []
    for suite in suites:
        sampled = row.get(f"{suite.name}_pass@1")
        parts.append(f"{suite.name} {row[suite.name]:.3f}" + ("" if sampled is None else f" (pass@1 {sampled:.3f})"))
    return ", ".join(parts)


def score_checkpoint(stage_dir: Path, suites, eval_cfg, serve_cfg, seed: int = 0) -> dict:
    """Serve one checkpoint, run every suite through the OpenAI API, and time it through the same endpoint.
    Progress: one bar (on a terminal) and one summary line for the checkpoint, not a line per request."""
    manifest = verify_artifact(stage_dir)
    label = manifest.get("label") or checkpoint_label(manifest["stage"])
    row = {"checkpoint": label, "stage": manifest["stage"], "artifact": str(stage_dir)}
    return score_model(row, stage_dir / "model", suites, eval_cfg, serve_cfg, seed)


def score_base(location: Path, suites, eval_cfg, serve_cfg, seed: int = 0) -> dict:
    """The model the chain started from (`eval.base`), scored like a checkpoint as the row "base"."""
    row = {"checkpoint": "base", "stage": "base", "artifact": str(location)}
    return score_model(row, location, suites, eval_cfg, serve_cfg, seed)


def base_location(stage_dirs: list[Path]) -> Path:
    """The local directory the chain's first stage loaded its model from, for `eval.base`."""
    info = base_model(stage_dirs) or {}
    location = info.get("location")
    if info.get("source") == "tiny" or not location:
        raise ValueError("eval.base: this chain's base model was built by its first stage, which has its own row; "
                         "eval.base scores a base model the first stage loaded (a hub model, a GGUF copy, a path)")
    if not Path(location).is_dir():
        raise ValueError(f"eval.base: the base model {location} is not a local directory to serve")
    return Path(location)


def score_model(row: dict, model_dir: Path, suites, eval_cfg, serve_cfg, seed: int) -> dict:
    """Serve the weights in `model_dir` as `row["checkpoint"]`, run every suite through the OpenAI API, and time it
    through the same endpoint; the scores go into `row`."""
    label = row["checkpoint"]
    row["size_mb"] = round(sum(p.stat().st_size for p in weight_files(model_dir)) / 2**20, 2)
    backend = checkpoint_backend(serve_cfg.backend, model_dir)
    row["backend"] = backend
    key = serve_cfg.api_key or secrets.token_hex(16)  # a fresh key per server: only this client talks to it
    # the recipe's serve options, on these weights (a checkpoint's were verified above: the server does not hash
    # them again)
    recipe = {f.name: getattr(serve_cfg, f.name) for f in dataclasses.fields(ServeCfg) if hasattr(serve_cfg, f.name)}
    opts = ServeCfg(**{**recipe, "model": str(model_dir), "port": 0, "api_key": key,
                       "served_model_name": label, "backend": backend})
    with background_server(opts) as server:
        log.info("%s: serving %s at %s (%s)", label, row["artifact"], server.base_url, backend)
        progress = CheckpointProgress(label, requests_of(suites, eval_cfg))
        ask = dict(base_url=server.base_url, api_key=key, model=server.name, concurrency=eval_cfg.concurrency,
                   progress=progress, extra_body=BACKEND_SAMPLING.get(backend))
        try:
            # Every suite's greedy requests go out together: the server batches them into one decode loop, where
            # suite after suite would run as many loops, each as long as its longest reply. A greedy reply is the
            # same alone or among others (the scheduler's per-row cache), so the scores do not depend on this. The
            # cost: prompts of different suites share a prefill padded to the longest (on SmolLM2, about 15 s of the
            # chain test's 44 s of eval; the tiny world's eval took 2-4 s longer a checkpoint in CI).
            progress.stage("greedy")
            plain = [suite for suite in suites if not suite.tools]
            budgets = [eval_cfg.max_new_tokens or suite.max_new_tokens for suite in plain]
            replies = chat_replies(conversations=[r["messages"] for suite in plain for r in suite.rows],
                                   max_tokens=[b for suite, b in zip(plain, budgets) for _ in suite.rows],
                                   desc=f"{label}/greedy", **ask)
            for suite in (s for s in suites if s.tools):  # each prompt through the OpenAI tool loop
                progress.stage(suite.name)
                transcripts = tool_loop_replies(server.base_url, key, server.name, [r["messages"] for r in suite.rows],
                                                list(suite.tools), eval_cfg.max_new_tokens or suite.max_new_tokens,
                                                eval_cfg.concurrency, suite.max_calls, progress=progress)
                record_greedy(row, suite, [t.final for t in transcripts], seed)
                row.update(tool_figures(suite.name, transcripts))
            start = 0
            for suite, max_new in zip(plain, budgets):
                completions, start = replies[start:start + len(suite.rows)], start + len(suite.rows)
                record_greedy(row, suite, completions, seed)
                if suite.samples:
                    progress.stage(f"{suite.name} sampled")
                    sampled = chat_replies(conversations=[r["messages"] for r in suite.rows], max_tokens=max_new,
                                           samples=suite.samples, temperature=suite.temperature, seed=seed,
                                           desc=f"{label}/{suite.name} sampled", **ask)
                    record_sampled(row, suite, sampled, seed)
            if getattr(eval_cfg, "lm_eval", None) is not None and eval_cfg.lm_eval.tasks:
                progress.stage("lm-eval")
                row["lm_eval"] = harness.run_tasks(server.base_url, key, server.name, str(model_dir),
                                                   eval_cfg.lm_eval, seed)
            if eval_cfg.latency.requests:
                progress.stage("latency")
                probe = suites[0].rows[0]["messages"] if suites else [{"role": "user", "content": "Hello"}]
                row["latency"] = latency_probe(server.base_url, key, server.name, probe, eval_cfg.latency.requests,
                                               eval_cfg.latency.max_tokens, progress=progress)
        finally:
            progress.close(score_summary(row, [s for s in suites if s.name in row]))
    return row


def record_greedy(row: dict, suite, completions: list[str], seed: int) -> None:
    """A suite's greedy scores into the checkpoint's row: the mean and its interval, the per-prompt scores (what
    changes are paired on), the replies where the suite keeps them, and three examples."""
    scores = suite.score(completions)
    row[suite.name], row[f"{suite.name}_n"] = mean(scores)
    row[f"{suite.name}_ci"] = mean_interval(scores, seed)
    row[f"{suite.name}_scores"] = scores  # per prompt, in the suite's order
    if suite.keep_replies:
        row[f"{suite.name}_replies"] = list(completions)
    row[f"{suite.name}_examples"] = [{"prompt": r["messages"][-1]["content"], "completion": c, "score": s}
                                     for r, c, s in list(zip(suite.rows, completions, scores))[:3]]
    if suite.details is not None:
        row.update(suite.details(suite.rows, completions, seed))


def record_sampled(row: dict, suite, sampled: list[list[str]], seed: int) -> None:
    """A sampled suite's pass@1 (the mean over each prompt's samples) into the checkpoint's row."""
    per_prompt = suite.score_samples(sampled)
    row[f"{suite.name}_pass@1"], _ = mean(per_prompt)
    row[f"{suite.name}_pass@1_ci"] = mean_interval(per_prompt, seed)
    row[f"{suite.name}_pass@1_scores"] = per_prompt
    row[f"{suite.name}_samples"] = suite.samples
    row[f"{suite.name}_temperature"] = suite.temperature


# llama-cpp-python's server samples with repeat_penalty 1.1, top_k 40 and min_p 0.05 unless told otherwise: its
# greedy replies then repeat less than the model does (arith chains repeat numbers: 0.500 against our engine's 0.805
# on the same file), and its samples come from a truncated distribution. These make both the plain model's.
BACKEND_SAMPLING = {"llamacpp": {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}}


def checkpoint_backend(backend: str, model_dir: Path) -> str:
    """The server a checkpoint is scored through: llama.cpp serves GGUF files only, so with serve.backend=llamacpp
    the run's other checkpoints go through our engine, and the scorecard shows both side by side."""
    return "posttrain" if backend == "llamacpp" and gguf_file(model_dir) is None else backend


def check_context(suites, model_dir: Path, eval_cfg, serve_cfg) -> None:
    """Before any checkpoint is served: every suite's longest prompt, rendered through the model's chat template,
    plus the reply budget must fit the server's context (issue 8's SmolLM2 run failed on MATH-500 here, after an
    hour of training, because serve.max_len was 512)."""
    from transformers import AutoConfig  # eval loads transformers only once it has checkpoints to serve

    tokenizer = load_tokenizer(model_dir)
    context = min(serve_cfg.max_len, AutoConfig.from_pretrained(model_dir).max_position_embeddings)
    for suite in suites:
        longest = max(len(render_ids(tokenizer, row["messages"])) for row in suite.rows)
        budget = eval_cfg.max_new_tokens or suite.max_new_tokens
        if longest + budget > context:
            raise ValueError(f"eval suite {suite.name}: its longest prompt is {longest} tokens and replies may take "
                             f"{budget} (max_new_tokens), over the served context of {context} (serve.max_len="
                             f"{serve_cfg.max_len}); raise serve.max_len or lower the suite's max_new_tokens")


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def build_suites(eval_cfg, seed: int, names: list[str] | None = None) -> list:
    """The suites `eval.suites` names (or `names`), each with its `eval.n_prompts` held-out prompts."""
    suites = []
    for name in eval_cfg.suites if names is None else names:
        if name not in eval_cfg.n_prompts:
            raise ValueError(f"eval.n_prompts has no entry for suite '{name}' (has {sorted(eval_cfg.n_prompts)})")
        kwargs = {}
        if name == "arith":
            kwargs = {"samples": eval_cfg.samples, "temperature": eval_cfg.temperature}
        elif name in ("pku_saferlhf", "gsm8k", "gsm8k_tools", "math500", "hh_harmful", "benign", "ifeval",
                      "humaneval"):
            kwargs = dict(eval_cfg[name])
            if name in ("gsm8k", "gsm8k_tools", "math500", "humaneval"):
                kwargs["temperature"] = eval_cfg.temperature
        suites.append(build_suite(name, eval_cfg.n_prompts[name], seed, **kwargs))
    return suites


def check_suites(eval_cfg, seed: int) -> list[str]:
    """Build every suite the run's eval will ask before the first stage trains, so a missing file, a bad row or a
    suite with too few prompts stops the run now rather than after the training. pku_saferlhf without
    eval.pku_saferlhf.reward_model waits for the reward model the run itself trains. Returns the suites built."""
    names = [n for n in eval_cfg.suites if not (n == "pku_saferlhf" and not eval_cfg.pku_saferlhf.reward_model)]
    return [s.name for s in build_suites(eval_cfg, seed, names)]


def recordable(eval_cfg) -> dict | None:
    """The eval config as the scorecard records it: everything but `checkpoints`, which picks rows, not scores."""
    if not OmegaConf.is_config(eval_cfg):
        return None
    return {k: v for k, v in OmegaConf.to_container(eval_cfg, resolve=True).items() if k != "checkpoints"}


def write_scorecard(run_dir: Path, stage_dirs: list[Path], eval_cfg, serve_cfg, seed: int) -> dict:
    suites = build_suites(eval_cfg, seed)
    if getattr(eval_cfg, "lm_eval", None) is not None:
        harness.require_lm_eval(eval_cfg.lm_eval)
    generators = [d for d in stage_dirs if is_generator((read_manifest(d) or {}).get("stage", ""))]
    if generators and serve_cfg.backend != "vllm":
        check_context(suites, generators[0] / "model", eval_cfg, serve_cfg)
    rows = []
    if getattr(eval_cfg, "base", False):
        rows.append(score_base(base_location(stage_dirs), suites, eval_cfg, serve_cfg, seed))
        rows[-1]["manifest_sha256"] = None
    for stage_dir in stage_dirs:
        manifest = read_manifest(stage_dir) or {}
        if is_generator(manifest.get("stage", "")):
            rows.append(score_checkpoint(stage_dir, suites, eval_cfg, serve_cfg, seed))
            rows[-1]["manifest_sha256"] = manifest_sha256(stage_dir)
    rows = with_earlier_rows(rows, earlier_rows(Path(run_dir), recordable(eval_cfg), seed))
    shifts, quantization = link_rows(Path(run_dir), rows)
    card = {"run": Path(run_dir).name, "suites": list(eval_cfg.suites), "rows": rows, "likelihood_shift": shifts,
            "quantization": quantization, "backend": serve_cfg.backend, "base_model": base_model(stage_dirs),
            "changes": changes(rows, list(eval_cfg.suites), seed), "judged": judged(rows, suites, eval_cfg, seed),
            "written_at": now(),
            "eval_config": recordable(eval_cfg), "seed": seed}  # what `posttrain eval` rescores the run with
    write_json_atomic(Path(run_dir) / "scorecard.json", card)
    markdown = render_markdown(card)
    tmp = Path(run_dir) / ".scorecard.md.tmp"
    tmp.write_text(markdown)
    tmp.replace(Path(run_dir) / "scorecard.md")
    return card


def link_rows(run_dir: Path, rows: list[dict]) -> tuple[dict, dict]:
    """Give each row its parent row (the artifact its manifest names, or "base" for the chain's first stage) and
    collect DPO's likelihood shifts and the quantized copies' reports, keyed by checkpoint; in place."""
    shifts, quantization = {}, {}
    by_sha = {r["manifest_sha256"]: r["checkpoint"] for r in rows if r.get("manifest_sha256")}
    for row in rows:
        if row["checkpoint"] == "base":
            continue
        manifest = read_manifest(row_stage_dir(run_dir, row)) or {}
        parent = by_sha.get((manifest.get("parent") or {}).get("manifest_sha256"))
        if parent:
            row["parent"] = parent
        elif not manifest.get("parent") and rows[0]["checkpoint"] == "base":
            row["parent"] = "base"  # the first stage trained the base model
        if "likelihood_shift" in manifest.get("metrics", {}):  # DPO's report on its held-out pairs
            shifts[row["checkpoint"]] = manifest["metrics"]["likelihood_shift"]
        if manifest.get("stage") == "quantize":
            quantization[row["checkpoint"]] = quantization_summary(manifest)
    return shifts, quantization


REFUSAL_NOTE = ("HH harmful refused and real benign answered: rewards/refusal.py reads a reply's first two sentences "
                "for declining phrases (\"I can't\", \"I won't\", \"I'm sorry, but\", \"As an AI\", ...) and "
                "ignores look-alikes (\"sorry to hear\", \"I can't believe\"). It misses refusals worded otherwise "
                "and reads English only; an empty reply counts as neither a refusal nor an answer.")
def score_cell(row: dict, key: str) -> str:
    """`0.735 [0.670, 0.791] (200)`: the score, its 95% interval where the row has one, its n where it has one."""
    text = f"{row[key]:.3f}"
    if row.get(f"{key}_ci"):
        low, high = row[f"{key}_ci"]
        text += f" [{low:.3f}, {high:.3f}]"
    n = row.get(f"{key}_n")
    return text + (f" ({n})" if n is not None else "")


def quantization_summary(manifest: dict) -> dict:
    m = manifest["metrics"]
    parent = (read_manifest(Path(manifest["parent"]["path"])) or {}) if manifest.get("parent") else {}
    return {
        "label": m["label"], "parent": parent.get("label") or checkpoint_label(parent.get("stage", "?")),
        "size_mb": m["size_bytes"] / 2**20, "parent_size_mb": m["parent_size_bytes"] / 2**20,
        "bytes_per_param": m["bytes_per_param"], "mean_of_spread": m["mean_of_spread"],
        "perplexity": m["perplexity"], "format_errors": m["format_errors"],
        "format_errors_rows": m.get("format_errors_rows"),
    }


def render_quantization(card: dict) -> list[str]:
    """Per quantized checkpoint: what it saved, what it cost in held-out perplexity and in each suite's score."""
    by_label = {r["checkpoint"]: r for r in card["rows"]}
    suites = card["suites"]
    head = ["checkpoint", "format", "size MB (parent)", "bytes/param", "error / spread", "perplexity change"]
    head += [f"{HEADERS.get(s, s)} vs parent" for s in suites]
    lines = ["", "## Quantization", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, q in card.get("quantization", {}).items():
        parent = by_label.get(q["parent"], {})
        spread = f"{q['mean_of_spread']:.3f}" if q["mean_of_spread"] is not None else "n/a"
        cells = [label, q["label"], f"{q['size_mb']:.2f} ({q['parent_size_mb']:.2f})", f"{q['bytes_per_param']:.3f}",
                 spread, f"{100 * q['perplexity']['change']:+.2f}%"]
        cells += [f"{by_label[label][s] - parent[s]:+.3f}" if s in parent else "n/a" for s in suites]
        lines.append("| " + " | ".join(cells) + " |")
    first = next(iter(card.get("quantization", {}).values()), None)
    if first:
        table = ", ".join(f"{k}: {v['of_spread']:.3f}" for k, v in first["format_errors"].items())
        sample = (f" ({first['format_errors_rows']} evenly spaced rows of each)" if first.get("format_errors_rows")
                  else "")
        lines += ["", f"Round-to-nearest error of each format on {first['parent']}'s weights{sample}, as a fraction "
                      f"of their spread (rms error / std): {table}"]
    return lines


def render_markdown(card: dict) -> str:
    """One row per checkpoint: each suite's greedy score (n prompts), and pass@1 where the suite samples."""
    rows = card["rows"]
    columns: list[tuple[str, str]] = []  # (header, key)
    ci = " [95% CI]" if rows and any(k.endswith("_ci") for k in rows[0]) else ""
    for s in card["suites"]:
        sampled = rows and f"{s}_pass@1" in rows[0]
        name = HEADERS.get(s, s)
        columns.append((f"{name} greedy{ci} (n)" if sampled else f"{name}{ci} (n)", s))
        if sampled:
            columns.append((f"{s} pass@1{ci} (k={rows[0][f'{s}_samples']}, T={rows[0][f'{s}_temperature']})",
                            f"{s}_pass@1"))
    servers = {row.get("backend", card.get("backend", "posttrain")) for row in rows}
    head = ["checkpoint"] + [h for h, _ in columns] + ["size MB", "TTFT ms", "decode tok/s"]
    head += ["server"] if len(servers) > 1 else []
    lines = [f"# Scorecard: run {card['run']}", *render_base_model(card.get("base_model")), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["checkpoint"]]
        cells += [score_cell(row, key) for _, key in columns]
        cells.append(f"{row['size_mb']:.1f}")
        latency = row.get("latency") or {}
        cells.append(f"{latency['ttft_ms']:.1f}" if latency.get("ttft_ms") is not None else "n/a")
        cells.append(f"{latency['decode_tok_s']:.0f}" if latency.get("decode_tok_s") is not None else "n/a")
        cells += [row.get("backend", "posttrain")] if len(servers) > 1 else []
        lines.append("| " + " | ".join(cells) + " |")
    probe = next((r["latency"] for r in rows if r.get("latency")), None)
    if probe:
        backend = " and ".join(sorted(servers))
        lines += ["", f"Every score above was measured through an OpenAI-compatible server ({backend} backend). "
                      f"TTFT and decode tok/s: medians over {probe['requests']} streamed greedy requests of "
                      f"{probe['max_tokens']} tokens sent one at a time, timed by the client."]
    for label, shift in card.get("likelihood_shift", {}).items():
        lines += ["", f"Likelihood shift of {label} against its reference: {render_shift(shift)}"]
    if ci:
        lines += ["", "Intervals: Wilson for a rate (every per-prompt score 0 or 1), a percentile bootstrap over "
                      "prompts for a mean of fractional scores (pass@1)."]
    if {"hh_harmful", "benign"} & set(card["suites"]):
        lines += ["", REFUSAL_NOTE]
    for row in (r for r in rows if r.get("gsm8k_tools_calls_per_prompt") is not None):
        share = row["gsm8k_tools_calls_ok_share"]
        lines += ["", f"{row['checkpoint']}, gsm8k_tools: {row['gsm8k_tools_calls_per_prompt']:.2f} calculator calls "
                      f"per problem, {'n/a' if share is None else f'{share:.1%}'} of them parsed and ran, "
                      f"{row['gsm8k_tools_hit_call_limit']} problems cut at the bound on calls"]
    lines += render_ifeval_types(rows)
    lines += harness.render(rows)
    lines += render_changes(card, HEADERS)
    lines += render_judged(card)
    if card.get("quantization"):
        lines += render_quantization(card)
    return "\n".join(lines) + "\n"
