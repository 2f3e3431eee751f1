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
"""

from __future__ import annotations

from rewards.text import completion_text

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
