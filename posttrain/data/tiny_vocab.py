"""The tiny world's vocabulary and its split rule: the names every generator draws from, and `take_split`, which
routes each drawn row to "train" or "test" by a hash of its prompt, so a prompt lands in exactly one split.

Kept apart from the generators so that posttrain.data.tiny_world and posttrain.data.tiny_safety both build on it
without importing each other.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

WORDS = (
    "apple river stone cloud green quiet bright table window garden yellow music paper silver orange winter "
    "summer candle forest ocean mountain pencil rabbit tiger lemon coffee bread butter honey sugar salt pepper "
    "circle square purple little happy gentle brave clever sunny rainy windy snowy early late north south east "
    "west morning evening night castle bridge tower market village harbor island valley desert meadow planet "
    "rocket engine wheel garden ladder mirror basket button pillow blanket kettle spoon plate glass bottle "
    "letter number story song dance game puzzle friend teacher doctor farmer painter sailor pilot baker "
    "runs jumps sings reads writes builds paints cooks sleeps walks swims climbs opens closes finds keeps "
    "red blue black white golden wooden soft warm cold fast slow tall short round sharp smooth heavy light "
    "copper marble velvet cotton amber coral jade ivory scarlet violet crimson azure olive hazel maple cedar"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, order kept

ECHO_INSTRUCTIONS = (
    "Return the following message <start> {msg} <end>",
    "Repeat this message exactly <start> {msg} <end>",
    "Echo back the text between the markers <start> {msg} <end>",
    "Copy the message <start> {msg} <end>",
    "Say exactly what is written here <start> {msg} <end>",
)

FIRST_NAMES = (
    "Mira Tomas Alva Jonas Ines Pavel Lena Oskar Nadia Felix Rosa Ivan Clara Hugo Elsa Marek Lila Anton Vera Emil "
    "Sofia Bruno Greta Leon Ada Karl Nora Otto Maja Timo Hanna Raul Zoe Kian Luca Yara Omar Tess Dario Edda"
).split()
LAST_NAMES = (
    "Olsen Varga Moreau Lindqvist Costa Novak Brandt Kovac Ferreira Halden Rossi Weber Nyberg Duarte Sato "
    "Keller Dumont Jansen Horvat Berg"
).split()
CITIES = (
    "Talvik Brenmoor Ostrava Velden Marisca Doringen Kestrel Luneburg Porthaven Ardenne Silvaro Tamsin Quarry "
    "Hollin Edgeport Rivermark Caldera Northwick Solenne Faroe"
).split()
JOBS = (
    "baker teacher pilot painter sailor doctor farmer engineer librarian gardener carpenter musician chemist "
    "tailor potter"
).split()
HOBBIES = "chess rowing pottery hiking cycling painting singing fishing skating gardening".split()


def split_of(prompt: str, test_fraction: float, salt: str) -> str:
    """Route a prompt to "train" or "test" by a stable hash, so the splits never share a prompt."""
    digest = hashlib.sha256(f"{salt}:{prompt}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"


def take_split(
    make: Callable[[random.Random], dict], n: int, split: str, seed: int, salt: str, test_fraction: float = 0.2,
    split_salt: Callable[[dict], str] | None = None,
) -> list[dict]:
    """Draw rows from `make` until `n` distinct prompts of `split` are found. `split_salt(row)` routes a row by
    another family's split (rows built from several families must keep each family's held-out prompts out)."""
    rng = random.Random(f"{salt}:{seed}")
    rows, seen = [], set()
    for _ in range(200 * n + 1000):
        row = make(rng)
        key = row["prompt_key"]
        if key in seen or split_of(key, test_fraction, split_salt(row) if split_salt else salt) != split:
            continue
        seen.add(key)
        rows.append(row)
        if len(rows) == n:
            return rows
    raise ValueError(f"tiny world '{salt}': only {len(rows)} distinct {split} prompts found, {n} asked for")
