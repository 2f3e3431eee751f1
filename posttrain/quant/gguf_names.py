"""What a GGUF model directory is called and holds, without the `gguf` package (the `gguf` extra): the scorecard,
the engine and the server look for the file on an install that may not have the writer
(`posttrain.quant.gguf_export`)."""

from __future__ import annotations

from pathlib import Path

GGUF_NAME = "model.gguf"  # the file in a model directory the quantize stage's GGUF variants write


def gguf_file(model_dir: str | Path) -> Path | None:
    """The GGUF file of a model directory the GGUF variants wrote, or None for any other directory."""
    path = Path(model_dir) / GGUF_NAME
    return path if path.is_file() else None
