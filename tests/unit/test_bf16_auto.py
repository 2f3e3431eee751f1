"""`bf16: auto` in a trainer block: bf16 autocast on hardware with bf16 arithmetic, float32 elsewhere, resolved where
the TRL config is built (so preflight checks what the stage will run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain import training
from posttrain.models import precision


@pytest.fixture(autouse=True)
def new_machine():
    """The decision is made once a process: each case here is a new machine, and none leaves its made-up flags'
    decision to the tests that run after it in this process."""
    precision._bf16_here.cache_clear()
    yield
    precision._bf16_here.cache_clear()


def sft_args(tmp_path, monkeypatch, flags: set[str], **block):
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    return build_args(tmp_path, {"max_steps": 1, "bf16": "auto", **block})


def build_args(tmp_path, block: dict):
    run = training.StageRun(name="sft", out_dir=tmp_path / "sft", parent=None, config={}, config_hash="",
                            run_name="t")
    return training.trl_args("SFTConfig", block, run, SimpleNamespace(backend="none"), 0)


@pytest.mark.parametrize("flags, expected", [
    ({"avx512f", "avx512_bf16"}, True),   # AMD Zen 4
    ({"avx512f", "amx_bf16", "amx_tile"}, True),  # Intel Sapphire / Emerald Rapids
    ({"avx2", "fma", "avx512f"}, False),  # AVX-512 without BF16: torch would emulate it
    (set(), False),  # no /proc/cpuinfo
])
def test_auto_is_bf16_on_a_cpu_exactly_when_it_has_bf16_dot_products(tmp_path, monkeypatch, flags, expected):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    args = sft_args(tmp_path, monkeypatch, flags)
    assert args.bf16 is expected
    assert args.use_cpu is expected  # TRL refuses bf16 off a GPU without use_cpu; float32 leaves it as it was


def test_auto_keeps_a_recipe_that_asked_for_the_cpu_on_it(tmp_path, monkeypatch):
    args = sft_args(tmp_path, monkeypatch, {"avx512_bf16"}, use_cpu=True)
    assert args.bf16 is True and args.use_cpu is True


def test_an_explicit_bf16_is_left_alone(tmp_path, monkeypatch):
    args = sft_args(tmp_path, monkeypatch, {"avx512_bf16"}, bf16=False, use_cpu=True)
    assert args.bf16 is False


def test_the_decision_is_logged_once_though_preflight_and_the_stage_both_build_the_config(tmp_path, monkeypatch,
                                                                                       caplog):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with caplog.at_level("INFO", logger="posttrain"):
        first = sft_args(tmp_path, monkeypatch, {"avx512_bf16"})
        second = build_args(tmp_path, {"max_steps": 1, "bf16": "auto"})
    assert first.bf16 is second.bf16 is True and second.use_cpu is True
    assert [r.getMessage() for r in caplog.records if "bf16: auto" in r.getMessage()] == ["bf16: auto -> True (CPU)"]


def test_cpu_flags_reads_this_machine():
    flags = precision.cpu_flags()
    assert isinstance(flags, set)
    if flags:  # Linux: every x86-64 CPU lists sse2, every arm64 one fp
        assert {"sse2", "fp"} & flags
