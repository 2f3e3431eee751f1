"""The optional dependencies as the tests see them: each extra's top-level modules, read from pyproject.toml and the
installed distributions' metadata, and a `sitecustomize` that hides them from a child interpreter as if they were
not installed (what a bare `pip install posttrain` gives)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_RUNTIME = {"all", "dev"}  # `all` names the others; `dev` holds the test tools


def extra_modules() -> dict[str, str]:
    """top-level module -> the extra whose requirements install it, for every installed optional dependency."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    by_distribution: dict[str, list[str]] = {}
    for module, distributions in packages_distributions().items():
        for distribution in distributions:
            by_distribution.setdefault(normalize(distribution), []).append(module)
    modules = {}
    for extra, requirements in extras.items():
        if extra in NOT_RUNTIME:
            continue
        for requirement in requirements:
            name = normalize(re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0])
            for module in by_distribution.get(name, []):
                if not module.startswith("_") and module.isidentifier():
                    modules[module] = extra
    return modules


def normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


HIDER = '''import sys
HIDDEN = {hidden!r}


class Hiding:
    """Python's path finder, except that it finds nothing of HIDDEN (so import raises ModuleNotFoundError)."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else self.inner.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)


sys.meta_path[:] = [Hiding(f) if getattr(f, "__name__", "") == "PathFinder" else f for f in sys.meta_path]
'''


def write_hider(folder: Path, hidden: set[str]) -> Path:
    """A folder whose sitecustomize.py hides `hidden`; put it on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HIDER.format(hidden=sorted(hidden)))
    return folder
