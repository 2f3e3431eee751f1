"""The data check every training stage runs at start-up: the checks of `posttrain data check`, on the rows the
stage is about to train on, with the stage's own tokenizer, chat-template options and max_length.

A report that breaks the card stops the stage before any training step (DataError with the report); a passing
one is logged and its summary goes into the stage manifest's dataset record under `check`.

Row counts: rows from the hub are held to the card's split count unless the recipe takes a `limit`; a local file
the card lists is held to its listed count; any other local file is reported as a sample of its split, since a
user's own slice is not the full dataset and is not an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from posttrain.data.cards import load_card
from posttrain.data.check import Report, check_rows
from posttrain.data.dolly import DataError, read_rows
from posttrain.data.gsm8k import solution_rows
from posttrain.data.hh_rlhf import hh_pairs
from posttrain.data.jobs import Job, eval_prompt_sets
from posttrain.data.prompts import PROMPT_SOURCES, prompt_rows

log = logging.getLogger("posttrain")


def tiny_jobs(rows: list[dict], family_of: Callable[[dict], str], expected: dict[str, int], source: str) -> list[Job]:
    """Generated rows grouped by the tiny-world family (card spec) each belongs to."""
    card = load_card("tiny_world")
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(family_of(row), []).append(row)
    return [Job(card.family(name), group, f"{source} ({name} rows)", None, expected_rows=expected.get(name))
            for name, group in groups.items()]


def file_job(card_id: str, rows: list[dict], path: str | None, hub_id: str | None, split: str,
             limited: bool) -> Job:
    """Rows read from a local file or the hub, with the split and sample status the card gives them."""
    card = load_card(card_id)
    if path:
        resolved = Path(path).resolve()
        entry = next((f for f in card.local if f.path.resolve() == resolved), None)
        if entry is not None:
            return Job(card.spec, rows, str(path), entry.split, sample=entry.sample or limited)
        return Job(card.spec, rows, str(path), split, sample=True)
    return Job(card.spec, rows, f"{hub_id}:{split}", split, sample=limited)


def summary(report: Report) -> dict:
    tokens = report.stats.get("tokens") or {}
    return {"dataset": report.dataset, "ok": report.ok, "rows": report.rows, "row_note": report.row_note,
            "tokens": {k: tokens[k] for k in ("p50", "p99", "max", "over_max_len") if k in tokens},
            "trained_fraction": tokens.get("trained_fraction"),
            "overlap": {o["eval_set"]: {"exact": o["exact"], "near": o["near"]}
                        for o in report.stats.get("overlap", [])},
            "warnings": [f.message for f in report.findings if f.level == "warning"]}


def startup_check(stage: str, jobs: list[Job], tokenizer, max_len: int | None, template_kwargs: dict | None,
                  eval_cfg, seed: int) -> list[dict]:
    """Check each job; log the reports; raise DataError naming the broken card and its findings."""
    max_len = max_len or (tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 2048)
    tiny_n = dict(eval_cfg.n_prompts) if eval_cfg is not None and "n_prompts" in eval_cfg else None
    summaries = []
    for job in jobs:
        exclude = f"{job.spec.card_id}:{job.split}" if job.split else None
        sets, unavailable = eval_prompt_sets(job.spec.eval_overlap, exclude, tiny_n, seed)
        # eval sets of the tiny world are only compared when the recipe sizes them (a tiny eval recipe)
        report = check_rows(job.rows, job.spec, source=job.source, split=job.split, sample=job.sample,
                            expected_rows=job.expected_rows, tokenizer=tokenizer,
                            model=getattr(tokenizer, "name_or_path", "") or stage, max_len=max_len,
                            completion_loss=stage != "reward_model",
                            template_kwargs=template_kwargs, eval_sets=sets, unavailable=unavailable,
                            token_rows=job.token_rows)
        log.info("%s: data check\n%s", stage, report.text())
        if not report.ok:
            raise DataError(f"{stage}: {job.source} breaks its data card ({job.spec.name}); fix the data or the "
                            f"card:\n" + "\n".join("  " + f.line() for f in report.errors()))
        summaries.append(summary(report))
    return summaries


# --- what each stage trains on, as jobs ----------------------------------------------------------------------------
def sft_jobs(data_cfg, rows: list[dict]) -> list[Job]:
    if data_cfg.name == "tiny":
        return tiny_jobs(rows, lambda r: r["family"], dict(data_cfg.counts), "tiny_world/sft")
    dolly = [r for r in rows if r.get("source") != "gsm8k"]
    jobs = [file_job("databricks-dolly-15k", dolly, data_cfg.path, data_cfg.hub_id, data_cfg.split,
                     limited=bool(data_cfg.limit))]
    gsm8k_cfg = getattr(data_cfg, "gsm8k", None)
    if gsm8k_cfg is not None and gsm8k_cfg.n > 0:
        # the card checks the problems as they are in the split (questions, '####' answers) and their overlap with
        # the eval sets; the replies SFT trains on are those solutions with the annotations stripped
        _, raw, _ = solution_rows(gsm8k_cfg)
        jobs.append(file_job("gsm8k", raw, gsm8k_cfg.path, "openai/gsm8k", "train", limited=True))
    return jobs


def pair_jobs(pairs_cfg, train_pairs: list[dict]) -> list[Job]:
    """The file the reward model's or DPO's training pairs come from. For HH-RLHF the check tokenizes only the rows
    that became `train_pairs` (held-out pairs are evaluation data); a PKU-SafeRLHF file is tokenized whole."""
    if pairs_cfg.source == "tiny":
        return tiny_jobs(train_pairs, lambda r: "preference_pairs", {"preference_pairs": len(train_pairs)},
                         "tiny_world/preference_pairs")
    if pairs_cfg.source == "tiny_safety":
        n_anchor = sum(p["family"] != "safety" for p in train_pairs)
        return tiny_jobs(train_pairs, lambda r: "safety_pairs" if r["family"] == "safety" else "preference_pairs",
                         {"safety_pairs": len(train_pairs) - n_anchor, "preference_pairs": n_anchor},
                         "tiny_world/safety_pairs")
    hh = pairs_cfg.source == "hh_rlhf"
    if pairs_cfg.path:
        raw = read_rows(Path(pairs_cfg.path))
    else:
        from datasets import load_dataset

        extra = {"data_dir": "harmless-base"} if hh else {}
        raw = list(load_dataset(pairs_cfg.hub_id, split=pairs_cfg.split, **extra))
    job = file_job("hh-rlhf" if hh else "pku-saferlhf", raw, pairs_cfg.path, pairs_cfg.hub_id,
                   pairs_cfg.split or "train", limited=bool(pairs_cfg.n_train))
    # the recipe's bad-row policy (and PKU's preference) decide which rows are bad pairs, as in the stage itself
    policy = {"on_bad_row": pairs_cfg.on_bad_row} | ({} if hh else {"preference": pairs_cfg.preference})
    return [replace(job, spec=replace(job.spec, mapping={**job.spec.mapping, **policy}),
                    token_rows=hh_training_rows(raw, train_pairs) if hh else None)]


def hh_training_rows(raw: list[dict], train_pairs: list[dict]) -> frozenset[int]:
    """The numbers (from 1) of the HH-RLHF rows that became `train_pairs`. The check reads every row of the file
    (its count, bad rows, duplicates, overlap) but tokenizes only these: the held-out conversations are eval data,
    and DPO trains on 64 of the file's 2,312 rows."""
    def identity(pair: dict) -> str:
        return json.dumps([pair["prompt"], pair["chosen"], pair["rejected"]])

    wanted = {identity(p) for p in train_pairs}
    rows = set()
    for number, row in enumerate(raw, start=1):
        parsed, _ = hh_pairs([row], "", on_bad_row="drop", quiet=True)
        if parsed and identity(parsed[0]) in wanted:
            rows.add(number)
    return frozenset(rows)


def prompt_jobs(prompts_cfg, rows: list[dict]) -> list[Job]:
    if prompts_cfg.source == "tiny_arith":
        return tiny_jobs(rows, lambda r: "arith_prompts", {"arith_prompts": prompts_cfg.n or 2000},
                         "tiny_world/arith_prompts")
    if prompts_cfg.source == "constraints":
        # the GSM8K file the constrained prompts' questions come from, checked against its card (the Dolly Alpaca
        # rows are parsed, and refused by row, by posttrain.data.constraints itself)
        raw = read_rows(Path(prompts_cfg.path)) if prompts_cfg.path else []
        return [file_job("gsm8k", raw, prompts_cfg.path, "openai/gsm8k", "train", limited=True)] if raw else []
    source, raw = prompt_rows(prompts_cfg)
    raw = raw[: prompts_cfg.n] if prompts_cfg.n else raw  # the rows the stage takes
    card = PROMPT_SOURCES[prompts_cfg.source][1]
    return [file_job(card, raw, prompts_cfg.path, source.rsplit(":", 1)[0], "train", limited=bool(prompts_cfg.n))]
