"""A bare install: with every extra's modules hidden from the interpreter (as `pip install posttrain` without
extras leaves them out), `posttrain stage=sft` still trains the tiny model, and a command that needs an extra stops
with the pip line that adds it. The hiding is checked first, so the test cannot pass by hiding nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.extras import extra_modules, write_hider
from tests.helpers import REPO, cli_env, posttrain


def test_sft_trains_without_any_extra_and_serve_names_its_extra(tiny_base, tmp_path):
    hidden = set(extra_modules())
    assert {"wandb", "deepspeed", "fastapi", "gguf", "matplotlib"} <= hidden
    env = {"PYTHONPATH": str(write_hider(tmp_path / "hide", hidden))}
    probe = subprocess.run([sys.executable, "-c", "import wandb"], cwd=REPO, env=cli_env(**env), capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'wandb'" in probe.stderr

    result = posttrain("stage=sft", "pipeline=tiny-ci", f"parent={tiny_base}", "sft.trainer.max_steps=2",
                       f"run.root={tmp_path}", "run.name=bare", timeout=300, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "bare" / "01-sft" / "manifest.json").read_text())
    assert manifest["metrics"]["global_step"] == 2
    before = load_file(tiny_base / "model" / "model.safetensors")
    after = load_file(tmp_path / "bare" / "01-sft" / "model" / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before)  # the two steps moved the weights

    served = posttrain("serve", str(tmp_path / "bare" / "01-sft"), timeout=120, **env)
    assert served.returncode == 2
    assert "the `serve` extra installs: pip install 'posttrain[serve]'" in served.stderr
