"""Hold a dataset to its card: schema and types, row counts, empty and duplicate rows, label values, checksums,
the conversations or pairs it maps to, token lengths under the model's chat template, the fraction of tokens
trained on, and overlap with the eval suites' prompts.

`posttrain data check` (posttrain/data/check_cli.py) prints the report and exits non-zero when the data breaks
the card; every training stage runs `check_rows` on its data at start-up (`startup_check`) and stops on an
error. Findings group rows by problem, so a million-row file with one bad column gives one line, not a million.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from posttrain.chat.render import MaskError, render_chat, tokenize_with_assistant_mask
from posttrain.data.cards import TYPES, Spec
from posttrain.data.hh_rlhf import SUBSETS, hh_pairs
from posttrain.data.overlap import EvalIndex, prompt_text
from posttrain.data.preferences import pku_pairs
from posttrain.data.tiny_world import qa_messages

log = logging.getLogger("posttrain")
FIRST_ROWS = 5  # row numbers quoted per finding


@dataclass
class Finding:
    level: str  # "error": the data breaks the card; "warning": worth a look, not a break
    check: str  # schema, rows, empty, duplicates, values, checksum, mapping, tokens, overlap
    message: str
    rows: list[int] = field(default_factory=list)  # the first few row numbers (from 1, in file order)
    count: int = 0

    def line(self) -> str:
        where = f" (rows {', '.join(map(str, self.rows))}{', ...' if self.count > len(self.rows) else ''})" \
            if self.rows else ""
        return f"{self.level.upper():7s} [{self.check}] {self.message}{where}"


@dataclass
class Report:
    dataset: str  # the card's id, or tiny_world/<family>
    source: str  # the file, hub id or generator the rows came from
    rows: int
    row_note: str
    findings: list[Finding] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def text(self) -> str:
        lines = [f"{self.dataset}: {self.source}", f"  rows      {self.row_note}"]
        dup = self.stats.get("duplicates")
        if dup is not None:
            lines.append(f"  unique    {dup['rows'] - dup['duplicates']} of {dup['rows']} by {', '.join(dup['key'])}"
                         f" ({dup['duplicates']} duplicates, {dup['exact_rows']} identical rows)")
        if "examples" in self.stats:
            lines.append(f"  maps to   {self.stats['examples']} {self.stats['example_kind']}")
        tok = self.stats.get("tokens")
        if tok:
            of = f"of the {tok['rows']} trained, " if tok.get("trained_only") else ""
            lines.append(f"  tokens    {of}p50 {tok['p50']}, p90 {tok['p90']}, p99 {tok['p99']}, max {tok['max']} "
                         f"({tok['model']}); {tok['over_max_len']} over max_len {tok['max_len']}")
            if tok.get("trained_fraction") is not None:
                lines.append(f"  trained   {tok['trained_fraction']:.1%} of tokens carry loss")
        for ov in self.stats.get("overlap", []):
            lines.append(f"  overlap   {ov['eval_set']} ({ov['eval_prompts']} prompts): {ov['exact']} exact, "
                         f"{ov['near']} near-duplicate")
        for name in self.stats.get("overlap_unavailable", []):
            lines.append(f"  overlap   {name}: not available here, not compared")
        lines += ["  " + f.line() for f in self.findings]
        lines.append(f"  => {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"dataset": self.dataset, "source": self.source, "rows": self.rows, "row_note": self.row_note,
                "ok": self.ok, "stats": self.stats,
                "findings": [{"level": f.level, "check": f.check, "message": f.message, "count": f.count,
                              "rows": f.rows} for f in self.findings]}


class Collector:
    """Rows grouped by (level, check, message): one finding per problem, with its count and first rows."""

    def __init__(self):
        self.groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)

    def add(self, level: str, check: str, message: str, row: int) -> None:
        self.groups[(level, check, message)].append(row)

    def findings(self) -> list[Finding]:
        out = []
        for (level, check, message), rows in self.groups.items():
            out.append(Finding(level, check, f"{message}: {len(rows)} row{'s' if len(rows) != 1 else ''}",
                               rows[:FIRST_ROWS], len(rows)))
        return out


def _type_ok(value, type_name: str) -> bool:
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[type_name])


def _blank(value) -> bool:
    return (isinstance(value, str) and not value.strip()) or (isinstance(value, (list, dict)) and not value)


def schema_check(rows: list, spec: Spec, collect: Collector) -> list[int]:
    """Types, required and non-empty fields, allowed values, patterns, checksums. Returns the good row numbers."""
    import re

    patterns = {c.name: re.compile(c.pattern) for c in spec.columns.values() if c.pattern}
    good = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            collect.add("error", "schema", f"row is a {type(row).__name__}, not an object", i)
            continue
        bad = False
        texts = [v for v in row.values() if isinstance(v, (str, list, dict))]
        if texts and all(_blank(v) for v in texts):
            collect.add("error", "empty", "every field is empty", i)
            continue
        for col in spec.columns.values():
            value = row.get(col.name)
            if value is None:
                if col.required:
                    collect.add("error", "schema", f"'{col.name}' is missing", i)
                    bad = True
                continue
            if not _type_ok(value, col.type):
                collect.add("error", "schema", f"'{col.name}' is {type(value).__name__}, the card says {col.type}", i)
                bad = True
                continue
            if col.nonempty and _blank(value):
                collect.add("error", "empty", f"'{col.name}' is empty", i)
                bad = True
            if col.values is not None and value not in col.values:
                shown = value if len(repr(value)) < 40 else repr(value)[:37] + "..."
                collect.add("error", "values", f"'{col.name}' = {shown!r} is not one of the card's values", i)
                bad = True
            if col.name in patterns and not patterns[col.name].search(value):
                collect.add("error", "values", f"'{col.name}' does not match /{col.pattern}/", i)
                bad = True
            if col.sha256_of and all(isinstance(row.get(f), str) for f in col.sha256_of):
                digest = hashlib.sha256("".join(row[f] for f in col.sha256_of).encode()).hexdigest()
                if digest != value:
                    collect.add("error", "checksum", f"'{col.name}' is not sha256({' + '.join(col.sha256_of)})", i)
                    bad = True
        if not bad:
            good.append(i)
    return good


def _key(value) -> str:
    if isinstance(value, str):
        return " ".join(value.split())
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def duplicate_check(rows: list, spec: Spec, good: list[int], collect: Collector) -> dict:
    key_fields = spec.unique or sorted(spec.columns)
    seen: dict[str, int] = {}
    whole: set[str] = set()
    dup_rows, exact_rows = [], 0
    for i in good:
        row = rows[i - 1]
        key = "\x1f".join(_key(row.get(f)) for f in key_fields)
        full = _key(row)
        exact_rows += full in whole
        whole.add(full)
        if key in seen:
            dup_rows.append(i)
        else:
            seen[key] = i
    fraction = len(dup_rows) / len(good) if good else 0.0
    if dup_rows:
        over = fraction > spec.max_duplicate_fraction
        level = "error" if over else "warning"
        limit = f"card allows {spec.max_duplicate_fraction:.1%}"
        for i in dup_rows:
            collect.add(level, "duplicates", f"repeat an earlier row's {'+'.join(key_fields)} "
                                             f"({fraction:.2%} of rows, {limit})", i)
    return {"rows": len(good), "duplicates": len(dup_rows), "exact_rows": exact_rows, "key": key_fields,
            "fraction": round(fraction, 6)}


def row_count_note(n: int, spec: Spec, split: str | None, sample: bool, expected: int | None,
                   findings: list[Finding]) -> str:
    """'<n> rows' with what the card pins; a mismatch with a pinned count is an error unless the rows are a sample.
    `expected` (a generated family: what the recipe asked for) overrides the card's count."""
    expected = expected if expected is not None else (spec.rows if split is None else None)
    if expected is not None:
        if n != expected:
            findings.append(Finding("error", "rows", f"{n} rows, {expected} expected"))
        return f"{n} ({expected} expected: exact)"
    full = spec.splits.get(split) if split else None
    if full is None:
        return f"{n} (split {split or '?'}: the card pins no count; reported only)"
    if sample:
        if n > full:
            findings.append(Finding("error", "rows", f"{n} rows, more than the full {split} split's {full}"))
        return f"{n}, a sample of the {full:,}-row {split} split (not the full set)"
    if n != full:
        findings.append(Finding("error", "rows", f"{n} rows, the card pins {full} for split {split} "
                                                 "(pass --sample if this is a slice)"))
    return f"{n} (the card pins {full} for split {split}: exact)"


# --- what the rows become ------------------------------------------------------------------------------------------
def map_rows(rows: list, spec: Spec, good: list[int], source: str, collect: Collector) -> tuple[str, list]:
    """(kind, [(row number, example)]) where an example is {messages} (conversation), {prompt} (prompt only),
    {prompt, chosen, rejected} (pair) or {text}."""

    kind = spec.mapping["kind"]
    picked = [(i, rows[i - 1]) for i in good]
    if kind == "dolly":
        return "conversations", [(i, {"messages": qa_messages(r)}) for i, r in picked]
    if kind in ("gsm8k", "math500"):
        field_name = "question" if kind == "gsm8k" else "problem"
        return "prompts", [(i, {"prompt": [{"role": "user", "content": r[field_name]}]}) for i, r in picked]
    if kind == "messages":
        return "conversations", [(i, {"messages": r["messages"]}) for i, r in picked]
    if kind == "prompt":
        return "prompts", [(i, {"prompt": r["prompt"]}) for i, r in picked]
    if kind == "pairs":
        return "pairs", [(i, {k: r[k] for k in ("prompt", "chosen", "rejected")}) for i, r in picked]
    if kind == "text":
        return "texts", [(i, {"text": r["text"]}) for i, r in picked]
    if kind == "pku_pairs":
        preference = spec.mapping.get("preference", "safer")
        # a recipe with pairs.on_bad_row=drop tolerates bad pairs: reported, not a break
        level = "warning" if spec.mapping.get("on_bad_row") == "drop" else "error"
        out = []
        for i, r in picked:  # one row at a time, so each pair keeps its row number
            pairs, report = pku_pairs([r], source, preference, on_bad_row="drop", quiet=True)
            for reason in report["dropped"]:
                collect.add(level, "values", f"not a valid '{preference}' pair ({reason})", i)
            out += [(i, p) for p in pairs]
        return "pairs", out
    if kind == "hh_pairs":
        # transcripts that do not parse or disagree before the last reply are bad pairs; a card (or recipe) with
        # on_bad_row=drop reports them as warnings, since the stage drops them
        level = "warning" if spec.mapping.get("on_bad_row") == "drop" else "error"
        subset = SUBSETS[spec.mapping.get("subset", "harmless-base")]
        out = []
        for i, r in picked:
            pairs, report = hh_pairs([r], source, on_bad_row="drop", kind=subset, quiet=True)
            for reason in report["dropped"]:
                collect.add(level, "values", f"not a valid pair ({reason})", i)
            out += [(i, p) for p in pairs]
        return "pairs", out
    raise ValueError(f"{spec.name}: mapping kind '{kind}' has no converter")


def _percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def token_stats(examples: list, tokenizer, model: str, max_len: int, template_kwargs: dict,
                collect: Collector) -> dict | None:
    """Token lengths under the model's chat template and the fraction of tokens that carry loss."""
    from tqdm.auto import tqdm

    lengths, trained, total, measured_loss = [], 0, 0, False
    knobs = {**tokenizer.special_tokens_map, **template_kwargs}
    for i, ex in tqdm(examples, desc="tokenize", unit="row", disable=len(examples) < 2000):
        try:
            if "text" in ex:
                n = len(tokenizer(ex["text"], add_special_tokens=False)["input_ids"])
                lengths.append(n)
                trained, total, measured_loss = trained + n, total + n, True
            elif "chosen" in ex:
                pair = [tokenize_with_assistant_mask(tokenizer, ex["prompt"] + ex[side], **template_kwargs)
                        for side in ("chosen", "rejected")]
                lengths.append(max(len(p["input_ids"]) for p in pair))
                trained += sum(sum(p["assistant_masks"]) for p in pair)
                total, measured_loss = total + sum(len(p["input_ids"]) for p in pair), True
            elif "messages" in ex:
                enc = tokenize_with_assistant_mask(tokenizer, ex["messages"], **template_kwargs)
                lengths.append(len(enc["input_ids"]))
                trained, total, measured_loss = trained + sum(enc["assistant_masks"]), total + len(enc["input_ids"]), True
            else:
                text = render_chat(tokenizer.chat_template, ex["prompt"], add_generation_prompt=True, **knobs)
                lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        except MaskError as err:
            collect.add("error", "mapping", f"no assistant tokens to train on ({str(err).split(': ', 1)[-1]})", i)
    if not lengths:
        return None
    ordered = sorted(lengths)
    over = [i for (i, _), n in zip(examples, lengths) if n > max_len]
    for i in over:
        collect.add("warning", "tokens", f"longer than max_len {max_len}: truncated in training", i)
    return {"model": model, "max_len": max_len, "rows": len(lengths), "mean": round(sum(lengths) / len(lengths), 1),
            "p50": _percentile(ordered, 0.5), "p90": _percentile(ordered, 0.9), "p99": _percentile(ordered, 0.99),
            "max": ordered[-1], "over_max_len": len(over),
            "trained_fraction": round(trained / total, 4) if measured_loss and total else None}


# --- the whole check -----------------------------------------------------------------------------------------------
def check_rows(rows: list, spec: Spec, *, source: str, split: str | None = None, sample: bool = False,
               expected_rows: int | None = None, completion_loss: bool = True, tokenizer=None, model: str = "",
               max_len: int = 2048, template_kwargs: dict | None = None,
               eval_sets: dict[str, list[str]] | None = None, unavailable: list[str] = (),
               token_rows: Collection[int] | None = None) -> Report:
    """Check `rows` (as read, before any conversion) against `spec`. `eval_sets` maps an eval set's name to its
    prompts; `unavailable` names eval sets that could not be loaded here (reported, not compared). `token_rows`
    (row numbers, from 1): tokenize only these rows, the ones a stage trains on, when it trains on a few rows of a
    file whose every row the other checks read (tokenizing is the slow part); None tokenizes every row."""
    collect, findings = Collector(), []
    note = row_count_note(len(rows), spec, split, sample, expected_rows, findings)
    if not rows:
        findings.append(Finding("error", "rows", "no rows"))
    good = schema_check(rows, spec, collect)
    stats: dict = {"duplicates": duplicate_check(rows, spec, good, collect)}
    kind, examples = map_rows(rows, spec, good, source, collect)
    stats.update(examples=len(examples), example_kind=kind)
    tokenized = examples if token_rows is None else [(i, ex) for i, ex in examples if i in token_rows]
    if tokenizer is not None and tokenized:
        stats["tokens"] = token_stats(tokenized, tokenizer, model, max_len, template_kwargs or {}, collect)
        if stats["tokens"] and token_rows is not None:
            stats["tokens"]["trained_only"] = True
        if stats["tokens"] and not completion_loss:  # a reward model scores whole sequences: no per-token loss
            stats["tokens"]["trained_fraction"] = None
    prompts = [(i, text) for i, ex in examples if (text := prompt_text(ex))]
    stats["overlap"], stats["overlap_unavailable"] = [], list(unavailable)
    for name, eval_prompts in (eval_sets or {}).items():
        overlap = EvalIndex(name, eval_prompts).compare(prompts)
        stats["overlap"].append(overlap.to_dict())
        if overlap.exact:
            findings.append(Finding("error", "overlap", f"{len(overlap.exact)} prompts are eval prompts of {name} "
                                                        "(after normalisation)", overlap.exact[:FIRST_ROWS],
                                    len(overlap.exact)))
        if overlap.near:
            findings.append(Finding("warning", "overlap", f"{len(overlap.near)} prompts are near-duplicates of "
                                                          f"{name} prompts", overlap.near[:FIRST_ROWS],
                                    len(overlap.near)))
    return Report(spec.name, source, len(rows), note, findings + collect.findings(), stats)
