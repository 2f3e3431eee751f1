"""Data cards: `data_cards/<id>.md`, YAML front matter a program reads and prose a person reads.

The front matter says what a dataset must look like (columns with type, allowed values, pattern, checksums; row
counts per split; what counts as a duplicate; how rows become conversations or pairs; which eval sets it must not
overlap). `posttrain data check` and every stage's start-up check hold the data to it. A card that does not parse
is an error naming the card and the key, never a silent pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from posttrain.data.dolly import read_rows

REPO = Path(__file__).resolve().parents[2]
CARDS_DIR = REPO / "data_cards"
SHARED_DATA = REPO.parent / "shared" / "data"  # real data slices beside the repo (see each folder's README)
TYPES = {"str": str, "int": int, "bool": bool, "float": float, "list": list, "dict": dict}
MAPPING_KINDS = ("dolly", "gsm8k", "math500", "messages", "pku_pairs", "hh_pairs", "pairs", "prompt", "text")
COLUMN_KEYS = {"type", "meaning", "nonempty", "required", "values", "pattern", "sha256_of"}


class CardError(ValueError):
    """A card is missing, does not parse, or breaks the card schema; the message names the card and the key."""


@dataclass
class Column:
    name: str
    type: str
    meaning: str = ""
    required: bool = True  # a missing key (or None) is an error
    nonempty: bool = False  # a blank string or empty list is an error
    values: list | None = None  # the only values allowed (labels, categories)
    pattern: str | None = None  # a regex the value must contain (re.search)
    sha256_of: list[str] | None = None  # the value is sha256 of these fields concatenated (UTF-8)


@dataclass
class Spec:
    """One dataset the card describes: the whole card, or one family of the tiny world."""

    card_id: str
    name: str  # card id, or "tiny_world/<family>"
    columns: dict[str, Column]
    mapping: dict
    splits: dict[str, int] = field(default_factory=dict)  # exact row counts of the full set per split
    rows: int | None = None  # rows a generated family must have (tiny world)
    unique: list[str] = field(default_factory=list)
    max_duplicate_fraction: float = 0.0
    eval_overlap: list[str] = field(default_factory=list)  # "<card id>:<split>" or "tiny:<suite>"
    stages: list[str] = field(default_factory=list)


@dataclass
class LocalFile:
    path: Path
    split: str
    rows: int
    sample: bool  # a slice of the split, not the whole of it


@dataclass
class Card:
    id: str
    path: Path
    meta: dict
    spec: Spec | None  # None for a card of families
    families: dict[str, Spec]
    local: list[LocalFile]
    prose: str

    @property
    def hub_id(self) -> str | None:
        return self.meta.get("hub_id")

    def specs(self) -> list[Spec]:
        return [self.spec] if self.spec else list(self.families.values())

    def family(self, name: str) -> Spec:
        if name not in self.families:
            raise CardError(f"{self.path}: no family '{name}' (families: {', '.join(self.families)})")
        return self.families[name]


def _columns(raw: object, where: str) -> dict[str, Column]:
    if not isinstance(raw, dict) or not raw:
        raise CardError(f"{where}: 'columns' must be a mapping of column name to its description")
    out = {}
    for name, desc in raw.items():
        if not isinstance(desc, dict):
            raise CardError(f"{where}: columns.{name} must be a mapping with at least 'type'")
        unknown = set(desc) - COLUMN_KEYS
        if unknown:
            raise CardError(f"{where}: columns.{name}: unknown keys {sorted(unknown)} (known: {sorted(COLUMN_KEYS)})")
        if desc.get("type") not in TYPES:
            raise CardError(f"{where}: columns.{name}.type is {desc.get('type')!r}, not one of {sorted(TYPES)}")
        if desc.get("pattern") is not None:
            try:
                re.compile(desc["pattern"])
            except re.error as err:
                raise CardError(f"{where}: columns.{name}.pattern does not compile: {err}") from None
        out[name] = Column(name=name, **desc)
    for col in out.values():
        missing = [f for f in col.sha256_of or [] if f not in out]
        if missing:
            raise CardError(f"{where}: columns.{col.name}.sha256_of names unknown columns {missing}")
    return out


def _spec(card_id: str, name: str, raw: dict, where: str) -> Spec:
    mapping = raw.get("mapping")
    if not isinstance(mapping, dict) or mapping.get("kind") not in MAPPING_KINDS:
        raise CardError(f"{where}: mapping.kind must be one of {MAPPING_KINDS}, got {mapping!r}")
    columns = _columns(raw.get("columns"), where)
    unique = list(raw.get("unique") or [])
    if any(u not in columns for u in unique):
        raise CardError(f"{where}: 'unique' names columns the card does not list: {[u for u in unique if u not in columns]}")
    splits = raw.get("splits") or {}
    if not isinstance(splits, dict) or any(not isinstance(v, int) for v in splits.values()):
        raise CardError(f"{where}: 'splits' must map split names to row counts (integers), got {splits!r}")
    return Spec(card_id=card_id, name=name, columns=columns, mapping=mapping, splits=splits, rows=raw.get("rows"),
                unique=unique, max_duplicate_fraction=float(raw.get("max_duplicate_fraction", 0.0)),
                eval_overlap=list(raw.get("eval_overlap") or []), stages=list(raw.get("stages") or []))


def parse_card(path: Path) -> Card:
    path = Path(path)
    if not path.exists():
        raise CardError(f"{path}: no such card")
    text = path.read_text()
    match = re.match(r"---\n(.*?)\n---\n(.*)", text, re.S)
    if not match:
        raise CardError(f"{path}: no YAML front matter (a card starts with '---', the YAML, then '---')")
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        raise CardError(f"{path}: front matter is not valid YAML: {err}") from None
    if not isinstance(meta, dict):
        raise CardError(f"{path}: front matter must be a mapping")
    for key in ("id", "license", "stages"):
        if not meta.get(key):
            raise CardError(f"{path}: front matter key '{key}' is missing or empty")
    card_id = meta["id"]
    if card_id != path.stem:
        raise CardError(f"{path}: id '{card_id}' must equal the file name '{path.stem}'")
    if "families" in meta:
        spec = None
        families = {name: _spec(card_id, f"{card_id}/{name}", raw, f"{path}: families.{name}")
                    for name, raw in meta["families"].items()}
    else:
        spec, families = _spec(card_id, card_id, meta, str(path)), {}
    local = []
    for i, entry in enumerate(meta.get("local") or [], start=1):
        try:
            local.append(LocalFile(path=SHARED_DATA / entry["path"], split=entry["split"], rows=int(entry["rows"]),
                                   sample=bool(entry.get("sample", False))))
        except (KeyError, TypeError, ValueError) as err:
            raise CardError(f"{path}: local entry {i} needs path, split and rows ({err})") from None
    prose = match.group(2).strip()
    if not prose:
        raise CardError(f"{path}: the card has no prose for a person to read")
    return Card(id=card_id, path=path, meta=meta, spec=spec, families=families, local=local, prose=prose)


def all_cards(cards_dir: Path = CARDS_DIR) -> dict[str, Card]:
    return {p.stem: parse_card(p) for p in sorted(Path(cards_dir).glob("*.md")) if p.name != "README.md"}


def load_card(name: str, cards_dir: Path = CARDS_DIR) -> Card:
    """A card by id ("gsm8k"), by file ("data_cards/gsm8k.md") or by hub id ("openai/gsm8k")."""
    if name.endswith(".md"):
        return parse_card(Path(name))
    path = Path(cards_dir) / f"{name}.md"
    if path.exists():
        return parse_card(path)
    for card in all_cards(cards_dir).values():
        if card.hub_id and card.hub_id.lower() == name.lower():
            return card
    known = ", ".join(all_cards(cards_dir))
    raise CardError(f"no data card for '{name}' in {cards_dir} (cards: {known})")


def card_for_file(path: Path, cards_dir: Path = CARDS_DIR) -> tuple[Card, LocalFile | None]:
    """The card that lists `path` among its local files, else the one whose required columns the file's first row
    has (exactly one must match)."""
    path = Path(path).resolve()
    cards = all_cards(cards_dir)
    for card in cards.values():
        for entry in card.local:
            if entry.path.resolve() == path:
                return card, entry

    rows = read_rows(path)
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    matches = [card for card in cards.values() if card.spec
               and all(c.name in first for c in card.spec.columns.values() if c.required)]
    if len(matches) != 1:
        found = ", ".join(c.id for c in matches) or "none"
        raise CardError(f"{path}: cannot tell which card describes it from its columns {sorted(first)} "
                        f"(matching cards: {found}); name one with --card")
    return matches[0], None
