"""Dolly-style instruction rows (instruction, context, response, category) from the hub or a local file.

Online, `databricks/databricks-dolly-15k` loads through `datasets`; offline the same adapter reads a local
JSON / JSONL / Parquet file. Every row is checked before training: a missing or non-string field is an error
naming the file, the row and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.data.tiny_world import qa_messages

DOLLY_FIELDS = ("instruction", "context", "response", "category")


class DataError(ValueError):
    """A dataset row is malformed; the message names the file, the row and the field."""


def read_rows(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: data file not found")
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
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
    raise DataError(f"{path}: unsupported file type '{path.suffix}' (use .jsonl, .json or .parquet)")


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
