"""Bad rows of a preference file under the recipe's `on_bad_row` policy, shared by every pairs source.

`error` stops at the first bad row with a DataError naming the source, the row (from 1) and what is wrong. `drop`
counts bad rows by reason, keeps the first few row numbers, and warns once for the whole file; a bad row is never
passed on.
"""

from __future__ import annotations

import logging
from collections import Counter

from posttrain.data.dolly import DataError

log = logging.getLogger("posttrain")

ON_BAD_ROW = ("error", "drop")
MAX_DROPPED_ROWS = 10  # row numbers kept in the report; the counts cover every dropped row


class BadRow(Exception):
    """One row's problem: `reason` keys the report's `dropped` counts, the message says what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BadRows:
    """The bad rows of one file. quiet: no warning (a caller that reports each bad row itself, the data check)."""

    def __init__(self, source: str, on_bad_row: str, quiet: bool = False):
        if on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"reward_model.pairs.on_bad_row '{on_bad_row}' is not one of {', '.join(ON_BAD_ROW)}")
        self.source, self.on_bad_row, self.quiet = source, on_bad_row, quiet
        self.dropped: Counter = Counter()
        self.rows: list[int] = []

    def add(self, row: int, bad: BadRow, message: str) -> None:
        """Row `row` is bad: raise (`error`) with `message`, or count it (`drop`)."""
        if self.on_bad_row == "error":
            raise DataError(f"{self.source}: row {row}: {message}") from None
        self.dropped[bad.reason] += 1
        if len(self.rows) < MAX_DROPPED_ROWS:
            self.rows.append(row)

    def report(self, rows_read: int) -> dict:
        """{"dropped": {reason: count}, "dropped_rows": [...]}, after one warning for the file when rows dropped."""
        if self.dropped and not self.quiet:
            reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.dropped.items()))
            log.warning("%s: dropped %d of %d rows as bad (%s); first dropped rows: %s", self.source,
                        sum(self.dropped.values()), rows_read, reasons, ", ".join(map(str, self.rows)))
        return {"dropped": dict(self.dropped), "dropped_rows": self.rows}
