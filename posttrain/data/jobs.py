"""Rows to check, as jobs: the rows, the card spec they are held to and where they came from; the tiny world's
families made as the tiny recipes make them; and the eval prompt sets a card names for the overlap check. Both
`posttrain data check` and the stages' start-up check build on these.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from posttrain.data import tiny_safety
from posttrain.data import tiny_world as tw
from posttrain.data.cards import REPO, CardError, Spec, load_card
from posttrain.data.check import Collector, map_rows
from posttrain.data.dolly import read_rows
from posttrain.data.overlap import prompt_text
from posttrain.data.tiny_world import eval_rows


@dataclass
class Job:
    spec: Spec
    rows: list
    source: str
    split: str | None
    sample: bool = False
    expected_rows: int | None = None
    token_rows: frozenset[int] | None = None  # the rows (numbered from 1) the stage trains on; None: every row


# --- the tiny world's families, made as the tiny recipes make them -------------------------------------------------
def tiny_recipe() -> dict:
    return OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "data" / "tiny.yaml"))


def tiny_family_rows(family: str, n: int, seed: int, data: dict | None = None) -> list[dict]:
    """Rows of one tiny-world family, split train, as the stage that uses it builds them."""
    data = data or tiny_recipe()
    makers = {
        "plain_text": lambda: [{"text": t} for t in tw.plain_text(n, seed)],
        "echo": lambda: tw.take_split(tw.make_echo, n, "train", seed, "echo"),
        "arith": lambda: tw.take_split(tw.make_arith(data["arith_slip_rate"], data.get("arith_miscopy_rate", 0.0)),
                                       n, "train", seed, "arith"),
        "qa": lambda: tw.take_split(tw.make_qa, n, "train", seed, "qa"),
        "safety": lambda: tiny_safety.sft_safety_rows("train", n, seed, data["safety_decline_rate"]),
        "arith_prompts": lambda: [{"prompt": r["messages"][:1], "answer": r["answer"]}
                                  for r in tw.take_split(tw.make_arith(0.0), n, "train", seed, "arith")],
        "preference_pairs": lambda: tw.preference_pairs("train", n, seed),
        "safety_pairs": lambda: tiny_safety.safety_pairs("train", n, seed),
    }
    if family not in makers:
        raise CardError(f"tiny_world has no generator for family '{family}' (families: {', '.join(makers)})")
    return makers[family]()


# --- eval prompt sets ----------------------------------------------------------------------------------------------
def eval_prompt_sets(names: list[str], exclude: str | None, tiny_n: dict | None = None,
                     seed: int = 0) -> tuple[dict[str, list[str]], list[str]]:
    """({eval set: prompts}, [eval sets not available here]). Names are "tiny:<suite>" (the held-out tiny-world
    suites, sized as the eval recipe sizes them) or "<card id>:<split>" (that card's local file of the split)."""
    sets, unavailable = {}, []
    for name in names:
        if name == exclude:
            continue  # a split is not contamination of itself
        prefix, _, part = name.partition(":")
        if prefix == "tiny":
            n = (tiny_n or {}).get(part) or OmegaConf.load(REPO / "recipes" / "eval" / "tiny.yaml").n_prompts[part]
            sets[name] = [prompt_text(r) for r in eval_rows(part, n, seed)]
            continue
        card = load_card(prefix)
        files = [f for f in card.local if f.split == part and f.path.exists()]
        if not files:
            unavailable.append(name)
            continue
        rows = [r for f in files for r in read_rows(f.path)]
        _, examples = map_rows(rows, card.spec, list(range(1, len(rows) + 1)), str(files[0].path), Collector())
        sets[name] = [t for _, ex in examples if (t := prompt_text(ex))]
    return sets, unavailable
