"""Shared test fixtures: paths, the shared data folder, a fast tiny pipeline run reused by several tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared_path(*parts: str) -> Path:
    """A path under ../shared, skipping the test with a clear reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"needs {path} (the shared data folder beside the repository), which is absent")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from posttrain.data.tiny_world import build_tiny_tokenizer

    return build_tiny_tokenizer()
