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


# --- running on two workers (pytest-xdist, as `make test` does) ------------------------------------------------------
# Tests that share an expensive fixture stay on one worker: each file is one group (its module fixtures are built
# once), and the files named together below share a session fixture (the one-process reference run of the four
# training stages), which a second worker would otherwise build again. The longest groups are handed out first, so
# that the last minutes of a run are not one long file on one worker while the other idles.
SHARED_FIXTURE_GROUPS = {
    "tests/integration/test_distributed.py": "one_process",
    "tests/integration/test_sharded_launchers.py": "one_process",
}
LONGEST_FIRST = (  # measured with --durations: the one_process pair ~8 min of one worker, the rest 2-5 min each
    "one_process", "tests/integration/test_smollm2_pipeline.py", "tests/integration/test_resume_and_errors.py",
    "tests/e2e/test_tiny_pipeline.py", "tests/integration/test_gguf_llamacpp.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(config, items):
    def group(item) -> str:
        path = item.nodeid.split("::", 1)[0]
        return SHARED_FIXTURE_GROUPS.get(path, path)

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: file order otherwise unchanged
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
