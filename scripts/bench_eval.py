"""Seconds per checkpoint of `posttrain eval` against the engine's own batch generation of the same requests.

    python scripts/bench_eval.py runs/demo                      every generator checkpoint of the run
    python scripts/bench_eval.py runs/demo --checkpoints dpo sft --json runs/bench_eval.json

For each checkpoint, in one process and one after the other:
- eval: `score_checkpoint`, what `posttrain eval` runs per checkpoint: start a server on the weights, send every
  suite's requests (greedy, then the sampled suite's `n` choices per prompt) and the latency probe through the
  OpenAI client, score them. Timed from the call to its return, server start-up and shutdown included.
- engine: the same requests straight into the engine: load it as the server does, render each prompt with the chat
  template, `Engine.generate` the greedy and the sampled replies (same max_tokens, temperature and per-choice
  seeds) in batches of `serve.max_batch`, then the probe's streamed requests one at a time. Timed the same way,
  the load included.
The ratio eval / engine is what serving costs on top of generation. Asserts nothing; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.artifacts import read_manifest  # noqa: E402  (after the checkout is on the path)
from posttrain.config import compose  # noqa: E402
from posttrain.evaluation.run import quiet_eval_output, select, stage_dirs_of  # noqa: E402
from posttrain.evaluation.scorecard import build_suites, score_checkpoint  # noqa: E402
from posttrain.registry import is_generator  # noqa: E402
from posttrain.serve.engine import SamplingParams, load_engine  # noqa: E402


def engine_pass(stage_dir: Path, suites, eval_cfg, serve_cfg, seed: int) -> dict:
    """The eval's requests through `Engine.generate`: returns the wall time and the tokens generated."""
    start = time.perf_counter()
    engine = load_engine(stage_dir / "model", dtype=serve_cfg.dtype, max_batch=serve_cfg.max_batch,
                         max_len=serve_cfg.max_len, quant_backend=serve_cfg.quant_backend)
    tok = engine.tokenizer
    tokens = 0
    for suite in suites:
        ids = [tok.encode(tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for r in suite.rows]
        max_new = eval_cfg.max_new_tokens or suite.max_new_tokens
        tokens += sum(len(c.token_ids) for c in engine.generate(ids, SamplingParams(max_tokens=max_new)))
        if suite.samples:
            params = [SamplingParams(max_tokens=max_new, temperature=suite.temperature, seed=seed + 1000 * i + k)
                      for i in range(len(ids)) for k in range(suite.samples)]
            repeated = [p for p in ids for _ in range(suite.samples)]
            tokens += sum(len(c.token_ids) for c in engine.generate(repeated, params))
    if eval_cfg.latency.requests:
        probe = suites[0].rows[0]["messages"]
        ids = tok.encode(tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        for _ in range(eval_cfg.latency.requests):
            tokens += len(engine.generate([ids], SamplingParams(max_tokens=eval_cfg.latency.max_tokens,
                                                                 ignore_eos=True))[0].token_ids)
    wall = time.perf_counter() - start
    engine.release()
    return {"wall_s": wall, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a finished run directory (runs/<name>)")
    parser.add_argument("--checkpoints", nargs="*", default=[], help="labels, stages or directories; default all")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    run = Path(args.run)
    cfg = compose([f"run.root={run.parent}", f"run.name={run.name}"])
    quiet_eval_output()
    dirs = [d for d in select(stage_dirs_of(run), args.checkpoints)
            if is_generator((read_manifest(d) or {}).get("stage", ""))]
    if not dirs:
        raise SystemExit(f"{run}: no generator checkpoint to time")
    suites = build_suites(cfg.eval, cfg.seed)
    rows = []
    for stage_dir in dirs:
        start = time.perf_counter()
        score_checkpoint(stage_dir, suites, cfg.eval, cfg.serve, cfg.seed)
        served = time.perf_counter() - start
        alone = engine_pass(stage_dir, suites, cfg.eval, cfg.serve, cfg.seed)
        rows.append({"checkpoint": stage_dir.name, "eval_s": served, "engine_s": alone["wall_s"],
                     "tokens": alone["tokens"], "ratio": served / alone["wall_s"]})
        print(f"{stage_dir.name}: eval {served:.1f} s, engine {alone['wall_s']:.1f} s "
              f"({alone['tokens']} tokens), {served / alone['wall_s']:.2f}x", flush=True)
    print(f"\n`posttrain eval` vs the engine's own batch generation, {run}, serve.max_batch {cfg.serve.max_batch}")
    print("| checkpoint | eval s | engine s | eval / engine |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['checkpoint']} | {r['eval_s']:.1f} | {r['engine_s']:.1f} | {r['ratio']:.2f} |")
    total_eval, total_engine = sum(r["eval_s"] for r in rows), sum(r["engine_s"] for r in rows)
    print(f"| all | {total_eval:.1f} | {total_engine:.1f} | {total_eval / total_engine:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
