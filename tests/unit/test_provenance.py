"""The scorecard's header names the base model: the root of the evaluated checkpoints' chain, its id or path and
revision, the sha256 of its weights from what can be checked, and what its name claims."""

from __future__ import annotations

import json

from posttrain.artifacts import sha256_file
from posttrain.evaluation.provenance import base_model, render_base_model
from posttrain.evaluation.scorecard import render_markdown


def manifest(stage_dir, stage, parent=None, model=None, base=None, weights=None):
    stage_dir.mkdir(parents=True)
    (stage_dir / "manifest.json").write_text(json.dumps({
        "stage": stage, "parent": {"path": str(parent), "manifest_sha256": "x"} if parent else None,
        "config": {"model": model or {}}, "base_model": base, "weights": weights or {}}))
    return stage_dir


def test_the_tiny_worlds_root_built_the_model_and_its_manifest_hashes_it(tmp_path):
    root = manifest(tmp_path / "00-pretrain", "pretrain", model={"source": "tiny"},
                    weights={"model/model.safetensors": "ab" * 32})
    sft = manifest(tmp_path / "01-sft", "sft", parent=root, model={"source": "tiny"}, base=str(root / "model"))
    dpo = manifest(tmp_path / "04-dpo", "dpo", parent=sft, base=str(sft / "model"))
    info = base_model([tmp_path / "missing", dpo])
    assert info["root_stage"] == "pretrain" and info["files"] == {"model/model.safetensors": "ab" * 32}
    text = "\n".join(render_base_model(info))
    assert "Base model: built by the pretrain stage (source tiny" in text and "ab" * 32 in text


def test_a_local_base_is_hashed_and_a_claiming_name_points_at_the_safety_suites(tmp_path):
    base = tmp_path / "Llama-3-8B-Instruct-abliterated"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"weights")
    sft = manifest(tmp_path / "run" / "01-sft", "sft", model={"source": "hf", "name_or_path": str(base),
                                                            "revision": "main"}, base=str(base))
    info = base_model([sft])
    assert info["files"] == {"model.safetensors": sha256_file(base / "model.safetensors")}
    assert info["refusals_removed"] == ["abliterated"]
    card = {"run": "r", "suites": ["safety"], "rows": [{"checkpoint": "sft", "safety": 0.5, "size_mb": 1.0}],
            "base_model": info}
    text = render_markdown(card)
    assert text.index("Base model: ") < text.index("| checkpoint |")  # the header, above the table
    assert f"Base model: {base} at revision main (source hf" in text
    assert "Its name says 'abliterated'" in text and "safety suites in the table below" in text
    assert render_markdown({**card, "base_model": None}).count("Base model") == 0
