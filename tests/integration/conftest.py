"""Fixtures the multi-process tests share: one tiny base, and the four training stages trained on it in one
process with the global batch (2B rows), the reference every launcher's run is compared with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import posttrain
from tests.integration.launching import B, pipeline_args, pretrain_base


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    return pretrain_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="session")
def one_process(tiny_base, tmp_path_factory) -> dict[str, Path]:
    """SFT, reward model, DPO and GRPO in one process with a batch of 2B; each stage's weight digest."""
    root = tmp_path_factory.mktemp("one")
    result = posttrain(*pipeline_args(root, "one", tiny_base, 2 * B), f"debug.weight_digest_dir={root / 'digest'}",
                       timeout=600, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"run": root / "one", "digest": root / "digest", "base": tiny_base}
