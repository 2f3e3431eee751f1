"""Verifiable instruction constraints (IFEval's kind: "answer in lowercase", "end with this phrase", "no commas"),
checked by Google's own IFEval checker classes as the PyPI package `if-verifiable` ships them.

A row's `constraints` column lists `{"id": <IFEval instruction id>, "kwargs": {...}}`; a reply meets a constraint
when the checker built with those kwargs accepts it. `instruction_strict` checks the reply as it is;
`instruction_loose` applies IFEval's loose rule (the reply also counts when it passes with its first or last line
removed, or with markdown asterisks dropped: a model's "Sure!" line or bold markup does not decide the score).

Not every IFEval type is supported here: `length_constraints:number_sentences` loads NLTK's punkt sentence model and
`change_case:capital_word_frequency` calls `nltk.word_tokenize` (punkt again), and punkt is data NLTK downloads at
run time, which these machines cannot; `language:response_language` is left out because the prompts are English
and langdetect is unreliable on short replies; the combination types and `keywords:key_sentences` need the prompt
or are disabled upstream.

`instruction_grounded` also asks that the reply be about the prompt it was given: the IFEval checkers credit a stock
"I'm ready to help. What's your question?" under a no-comma or lowercase constraint, and the instruction's own
example copied ("* This is point 1.", "<<poem of joy>>") under a bullet or title constraint. SmolLM2-135M-Instruct
found both within 24 GRPO steps on `instruction_strict` alone.
"""

from __future__ import annotations

import re

from rewards.text import completion_text

# a hand-written rule, since no maintained package scores "is this reply about its prompt" offline without a model
MIN_SHARED_WORDS = 2  # distinct content words of the base prompt a grounded reply must use
COPY_SPAN = 3  # words in a row of the instruction's own wording that a grounded reply must not repeat
WORD = re.compile(r"[a-z]+|\d+(?:\.\d+)?")

SUPPORTED = (
    "change_case:english_lowercase",
    "change_case:english_capital",
    "punctuation:no_comma",
    "detectable_format:json_format",
    "detectable_format:title",
    "startend:quotation",
    "startend:end_checker",
    "length_constraints:number_words",
    "length_constraints:number_paragraphs",
    "keywords:existence",
    "keywords:forbidden_words",
    "keywords:frequency",
    "keywords:letter_frequency",
    "detectable_format:number_bullet_lists",
    "detectable_format:number_highlighted_sections",
    "detectable_content:postscript",
)


def _registry() -> dict:
    # imported on first use: it pulls in nltk and langdetect, a few seconds that a run without constraints never pays
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    from langdetect import DetectorFactory

    # the lowercase and capitals checkers also ask langdetect whether the reply is English; langdetect samples, so
    # without a fixed seed the same reply can score differently from call to call
    DetectorFactory.seed = 0

    return INSTRUCTION_DICT


def build_checker(constraint: dict):
    """IFEval's checker for one `{"id", "kwargs"}` constraint, its parameters set (none left to chance: IFEval's
    `build_description` picks a random value for any parameter it is not given)."""
    if not isinstance(constraint, dict) or "id" not in constraint:
        raise ValueError(f"a constraint must be a dict with 'id' and 'kwargs', got {constraint!r}")
    cid = constraint["id"]
    if cid not in SUPPORTED:
        raise ValueError(f"constraint id '{cid}' is not supported; supported: {', '.join(SUPPORTED)}")
    checker = _registry()[cid](cid)
    # a `datasets` column of constraints holds the union of every type's kwargs, None where a type has no such
    # parameter (as google/IFEval's own rows do): None means absent
    kwargs = {k: v for k, v in (constraint.get("kwargs") or {}).items() if v is not None}
    checker.build_description(**kwargs)
    expected = checker.get_instruction_args_keys()
    if missing := [k for k in expected if k not in kwargs]:
        raise ValueError(f"constraint '{cid}' needs kwargs {expected}; missing {missing}")
    return checker


def describe(constraint: dict) -> str:
    """The instruction text IFEval words for the constraint ("Answer with less than 40 words.")."""
    checker = build_checker(constraint)
    return checker.build_description(**{k: v for k, v in constraint["kwargs"].items() if v is not None})


def check_reply(reply: str, constraints: list[dict]) -> list[dict]:
    """Per constraint: {"id", "strict", "loose"} for one reply. An empty reply meets nothing."""
    from if_verifiable.common import get_loose_transformations

    out = []
    variants = [v for v in get_loose_transformations(reply) if v.strip()]
    for constraint in constraints:
        checker = build_checker(constraint)
        strict = bool(reply.strip()) and bool(checker.check_following(reply))
        loose = strict or any(checker.check_following(v) for v in variants)
        out.append({"id": constraint["id"], "strict": strict, "loose": loose})
    return out


def words(text: str) -> set[str]:
    """The distinct lower-cased words and numbers of a text, thousands separators dropped ("1,200" -> "1200")."""
    return set(WORD.findall(re.sub(r"(?<=\d),(?=\d)", "", text.lower())))


def _spans(text: str) -> set[tuple[str, ...]]:
    tokens = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(tokens[i:i + COPY_SPAN]) for i in range(len(tokens) - COPY_SPAN + 1)}


def copied_example(reply: str, constraint: dict) -> bool:
    """Whether the reply repeats COPY_SPAN words in a row of the constraint's instruction text that its parameters
    do not require (an end phrase or a postscript marker must be written out; "such as <<poem of joy>>" need not).

    >>> title = {"id": "detectable_format:title", "kwargs": {}}
    >>> copied_example("<<poem of joy>> Roses.", title), copied_example("<<Roses>> Roses are red.", title)
    (True, False)
    """
    required = " ".join(str(v) for v in (constraint.get("kwargs") or {}).values() if v is not None)
    return bool((_spans(reply) & _spans(describe(constraint))) - _spans(required))


def grounded(reply: str, base_words: list[str], constraints: list[dict]) -> bool:
    """Whether a reply uses at least MIN_SHARED_WORDS of its base prompt's content words (`base_words`, the row's
    column: the words a reply that takes up the prompt would use) and copies none of its constraints' wording."""
    return (len(words(reply) & set(base_words)) >= MIN_SHARED_WORDS
            and not any(copied_example(reply, c) for c in constraints))


def _score(completions, constraints, mode: str) -> list[float | None]:
    if constraints is None:
        return [None] * len(completions)
    scores = []
    for completion, row in zip(completions, constraints, strict=True):
        if not row:
            scores.append(None)
            continue
        results = check_reply(completion_text(completion), row)
        scores.append(float(all(r[mode] for r in results)))
    return scores


def instruction_strict(completions, constraints=None, **kwargs) -> list[float | None]:
    """1.0 when the reply meets every constraint of its row as written, else 0.0; None for a row without any.

    >>> c = [{"id": "punctuation:no_comma", "kwargs": {}}]
    >>> instruction_strict(["Yes it is.", "Yes, it is.", ""], constraints=[c, c, c])
    [1.0, 0.0, 0.0]
    """
    return _score(completions, constraints, "strict")


def instruction_loose(completions, constraints=None, **kwargs) -> list[float | None]:
    """IFEval's loose accuracy: as `instruction_strict`, but the reply also counts when it meets the constraints
    without its first line, its last line, both, or its markdown asterisks.

    >>> c = [{"id": "punctuation:no_comma", "kwargs": {}}]
    >>> reply = "Sure, here it is:\\nit is four"
    >>> instruction_strict([reply], constraints=[c]), instruction_loose([reply], constraints=[c])
    ([0.0], [1.0])
    """
    return _score(completions, constraints, "loose")


def instruction_grounded(completions, constraints=None, base_words=None, **kwargs) -> list[float | None]:
    """`instruction_strict`, credited only when the reply is also `grounded` in its base prompt; None for a row
    without constraints. Rows need the `base_words` column (posttrain.data.constraints writes it).

    >>> c = [{"id": "punctuation:no_comma", "kwargs": {}}]
    >>> w = ["natalia", "clips", "april"]
    >>> instruction_grounded(["Natalia sold 48 clips in April.", "I am ready to help. What is your question?"],
    ...                      constraints=[c, c], base_words=[w, w])
    [1.0, 0.0]
    """
    strict = _score(completions, constraints, "strict")
    if constraints is None:
        return strict
    if base_words is None:
        raise ValueError("instruction_grounded needs the rows' 'base_words' column (constrained prompts have it)")
    return [s if not s else float(grounded(completion_text(c), w, row))
            for s, c, w, row in zip(strict, completions, base_words, constraints, strict=True)]
