"""Score every checkpoint of a run on the same suites and write `scorecard.json` and `scorecard.md`."""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.artifacts import now, verify_artifact, weight_files, write_json_atomic
from posttrain.evaluation.generate import greedy_generate
from posttrain.evaluation.suites import build_suite

log = logging.getLogger("posttrain")
ROW_LABELS = {"pretrain": "base"}  # the tiny world's pretrain artifact is the base model


def checkpoint_label(stage: str) -> str:
    return ROW_LABELS.get(stage, stage)


def score_checkpoint(stage_dir: Path, suites, eval_cfg) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = verify_artifact(stage_dir)
    model = AutoModelForCausalLM.from_pretrained(stage_dir / "model")
    tokenizer = AutoTokenizer.from_pretrained(stage_dir / "model")
    label = checkpoint_label(manifest["stage"])
    row = {
        "checkpoint": label,
        "stage": manifest["stage"],
        "artifact": str(stage_dir),
        "size_mb": round(sum(p.stat().st_size for p in weight_files(stage_dir / "model")) / 2**20, 2),
    }
    for suite in suites:
        completions = greedy_generate(model, tokenizer, [r["messages"] for r in suite.rows], eval_cfg.max_new_tokens,
                                      eval_cfg.batch_size, desc=f"{label}/{suite.name}")
        scores = suite.score(completions)
        applicable = [s for s in scores if s is not None]
        row[suite.name] = sum(applicable) / len(applicable)
        row[f"{suite.name}_n"] = len(applicable)
        row[f"{suite.name}_examples"] = [
            {"prompt": r["messages"][-1]["content"], "completion": c, "score": s}
            for r, c, s in list(zip(suite.rows, completions, scores))[:3]
        ]
    return row


def write_scorecard(run_dir: Path, stage_dirs: list[Path], eval_cfg, seed: int) -> dict:
    suites = [build_suite(name, eval_cfg.n_prompts, seed) for name in eval_cfg.suites]
    rows = [score_checkpoint(d, suites, eval_cfg) for d in stage_dirs]
    card = {"run": Path(run_dir).name, "suites": list(eval_cfg.suites), "rows": rows, "written_at": now()}
    write_json_atomic(Path(run_dir) / "scorecard.json", card)
    markdown = render_markdown(card)
    tmp = Path(run_dir) / ".scorecard.md.tmp"
    tmp.write_text(markdown)
    tmp.replace(Path(run_dir) / "scorecard.md")
    return card


def render_markdown(card: dict) -> str:
    suites = card["suites"]
    head = ["checkpoint"] + [f"{s} (n)" for s in suites] + ["size MB"]
    lines = [f"# Scorecard: run {card['run']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in card["rows"]:
        cells = [row["checkpoint"]] + [f"{row[s]:.3f} ({row[f'{s}_n']})" for s in suites] + [f"{row['size_mb']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
