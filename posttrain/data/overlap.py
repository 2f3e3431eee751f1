"""Overlap between training prompts and eval prompts: exact after normalisation, and near-duplicate.

Near-duplicates are found with word-trigram shingles and Jaccard similarity through an inverted index, which is
exact (no hashing approximation as in MinHash) and fast enough for the sizes a card check sees (tens of
thousands of training prompts against a few thousand eval prompts).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field

NEAR_JACCARD = 0.8  # shingle-set similarity at or above which two prompts count as near-duplicates
SHINGLE = 3  # words per shingle
EXAMPLES = 3  # pairs quoted in a report


def normalise(text: str) -> str:
    """Lower case, Unicode-compatibility folded, punctuation dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w]+", " ", text).split())


def shingles(norm: str) -> frozenset[str]:
    words = norm.split()
    if len(words) < SHINGLE:
        return frozenset([norm]) if norm else frozenset()
    return frozenset(" ".join(words[i:i + SHINGLE]) for i in range(len(words) - SHINGLE + 1))


@dataclass
class Overlap:
    eval_set: str
    eval_prompts: int
    exact: list[int] = field(default_factory=list)  # training row numbers (from 1) whose prompt is an eval prompt
    near: list[int] = field(default_factory=list)  # rows with a near-duplicate (and no exact match)
    examples: list[tuple[int, str, str]] = field(default_factory=list)  # (row, training prompt, eval prompt)

    def to_dict(self) -> dict:
        return {"eval_set": self.eval_set, "eval_prompts": self.eval_prompts, "exact": len(self.exact),
                "near": len(self.near), "exact_rows": self.exact[:10], "near_rows": self.near[:10],
                "examples": [{"row": r, "train": t, "eval": e} for r, t, e in self.examples]}


class EvalIndex:
    """The normalised prompts of one eval set, indexed for exact and near-duplicate lookup."""

    def __init__(self, name: str, prompts: list[str]):
        self.name, self.prompts = name, prompts
        self.norm = [normalise(p) for p in prompts]
        self.exact = {n: i for i, n in enumerate(self.norm)}
        self.sets = [shingles(n) for n in self.norm]
        self.index: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(self.sets):
            for sh in s:
                self.index[sh].append(i)

    def nearest(self, norm: str) -> tuple[int, float] | None:
        """(eval prompt index, Jaccard) of the most similar eval prompt at or above NEAR_JACCARD, else None."""
        mine = shingles(norm)
        if not mine:
            return None
        shared: Counter[int] = Counter()
        for sh in mine:
            shared.update(self.index.get(sh, ()))
        best = None
        for i, k in shared.items():
            jaccard = k / (len(mine) + len(self.sets[i]) - k)
            if jaccard >= NEAR_JACCARD and (best is None or jaccard > best[1]):
                best = (i, jaccard)
        return best

    def compare(self, prompts: list[tuple[int, str]]) -> Overlap:
        """prompts: (row number, prompt text) of the training data."""
        out = Overlap(self.name, len(self.prompts))
        for row, text in prompts:
            norm = normalise(text)
            if norm in self.exact:
                out.exact.append(row)
                if len(out.examples) < EXAMPLES:
                    out.examples.append((row, text, self.prompts[self.exact[norm]]))
                continue
            hit = self.nearest(norm)
            if hit is not None:
                out.near.append(row)
                if len(out.examples) < EXAMPLES:
                    out.examples.append((row, text, self.prompts[hit[0]]))
        return out


def prompt_text(example: dict) -> str | None:
    """The user side of an example (its user turns joined); None for plain text, which has no prompt."""
    turns = example.get("prompt") or example.get("messages")
    if not turns:
        return None
    return "\n".join(str(t.get("content", "")) for t in turns if t.get("role") == "user")
