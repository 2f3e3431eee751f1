"""Dolly-style instruction rows (instruction, context, response, category) from the hub or a local file.

Online, `databricks/databricks-dolly-15k` loads through `datasets`; offline the same adapter reads a local
JSON / JSONL (plain or .jsonl.gz) / Parquet file. Every row is checked before training: a missing or non-string
field is an error naming the file, the row and the field.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from posttrain.data.tiny_world import qa_messages

DOLLY_FIELDS = ("instruction", "context", "response", "category")


class DataError(ValueError):
    """A dataset row is malformed; the message names the file, the row and the field."""


def _read_text(path: Path) -> str:
    """A text file's contents; `.gz` files are decompressed first (a broken archive is a DataError)."""
    if path.suffix != ".gz":
        return path.read_text()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError; a cut-off archive ends in EOFError
        raise DataError(f"{path}: not a readable gzip file ({err})") from None


def read_rows(path: Path) -> list[dict]:
    """Rows of a JSONL file (one object a line, blank lines skipped; gzip-compressed when it ends in .jsonl.gz),
    a JSON list or a Parquet file. A line that is not JSON is a DataError naming the file and the row."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: data file not found")
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        rows = []
        for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: row {lineno}: not valid JSON ({err.msg})") from None
        return rows
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        return data
    if path.suffix == ".parquet":
        from datasets import load_dataset

        return list(load_dataset("parquet", data_files=str(path), split="train"))
    raise DataError(f"{path}: unsupported file type '{path.suffix}' (use .jsonl, .jsonl.gz, .json or .parquet)")


def validate_dolly(rows: list[dict], source: str) -> list[dict]:
    """Check the four fields of every row; rows are numbered from 1 as in the file."""
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{source}: row {i}: expected an object with fields {DOLLY_FIELDS}")
        for name in DOLLY_FIELDS:
            if name not in row or row[name] is None:
                raise DataError(f"{source}: row {i}: field '{name}' is missing")
            if not isinstance(row[name], str):
                raise DataError(f"{source}: row {i}: field '{name}' must be a string, got {type(row[name]).__name__}")
        if not row["instruction"].strip() or not row["response"].strip():
            raise DataError(f"{source}: row {i}: field 'instruction' or 'response' is empty")
    return rows


def load_dolly(path: str | None, hub_id: str | None, split: str = "train", limit: int | None = None) -> tuple[list[dict], str]:
    """Return (rows, source) with rows validated and turned into conversations (`messages`)."""
    if path:
        source = str(path)
        rows = read_rows(Path(path))
    elif hub_id:
        from datasets import load_dataset

        source = f"{hub_id}:{split}"
        rows = list(load_dataset(hub_id, split=split))
    else:
        raise DataError("data.path and data.hub_id are both empty: nothing to load")
    rows = validate_dolly(rows, source)
    rows = rows[:limit] if limit else rows
    return [dict(r, messages=qa_messages(r), family=r["category"]) for r in rows], source
