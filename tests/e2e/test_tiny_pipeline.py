"""The tiny pipeline end to end (fewer steps than `make demo`): every artifact, the scorecard, skip on rerun."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from posttrain.artifacts import manifest_sha256, verify_artifact
from tests.helpers import posttrain

pytestmark = pytest.mark.slow
MANIFEST_KEYS = {"stage", "parent", "config", "config_hash", "datasets", "metrics", "weights", "packages",
                 "git_revision", "started_at", "finished_at"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    result = posttrain("run", "pipeline=tiny-ci", f"run.root={root}", "run.name=ci")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "ci", result


def test_every_stage_wrote_a_complete_manifest(tiny_run):
    run_dir, _ = tiny_run
    pretrain, sft = run_dir / "00-pretrain", run_dir / "01-sft"
    for stage_dir, stage in ((pretrain, "pretrain"), (sft, "sft")):
        manifest = verify_artifact(stage_dir)
        assert MANIFEST_KEYS <= set(manifest)
        assert manifest["stage"] == stage
        assert manifest["datasets"] and manifest["datasets"][0]["content_sha256"]
        assert manifest["metrics"]["global_step"] == manifest["config"][stage]["trainer"]["max_steps"]
        assert not (stage_dir / "checkpoints").exists()
    assert json.loads((pretrain / "manifest.json").read_text())["parent"] is None
    sft_manifest = json.loads((sft / "manifest.json").read_text())
    assert sft_manifest["parent"]["manifest_sha256"] == manifest_sha256(pretrain)
    assert 0 < sft_manifest["metrics"]["assistant_token_fraction"] < 1


def test_scorecard_has_base_and_sft_rows(tiny_run):
    run_dir, result = tiny_run
    card = json.loads((run_dir / "scorecard.json").read_text())
    assert [r["checkpoint"] for r in card["rows"]] == ["base", "sft"]
    for row in card["rows"]:
        assert 0.0 <= row["echo"] <= 1.0 and row["echo_n"] == 20 and row["size_mb"] > 0
        assert len(row["echo_examples"]) == 3
    markdown = (run_dir / "scorecard.md").read_text()
    assert "| base |" in markdown and "| sft |" in markdown
    assert "| checkpoint | echo (n) | size MB |" in result.stdout  # printed at the end of the run


def test_sft_changed_weights_and_lowered_heldout_echo_loss(tiny_run):
    """Weights moved, and the held-out echo answers became more likely (teacher-forced NLL on assistant tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.chat.render import tokenize_with_assistant_mask
    from posttrain.data.tiny_world import make_echo, take_split

    run_dir, _ = tiny_run
    base_w = load_file(run_dir / "00-pretrain/model/model.safetensors")
    sft_w = load_file(run_dir / "01-sft/model/model.safetensors")
    assert set(base_w) == set(sft_w)
    assert sum(not torch.equal(base_w[k], sft_w[k]) for k in base_w) == len(base_w)

    rows = take_split(make_echo, 40, "test", 0, "echo")

    def heldout_nll(stage_dir):
        model = AutoModelForCausalLM.from_pretrained(stage_dir / "model").eval()
        tok = AutoTokenizer.from_pretrained(stage_dir / "model")
        total, count = 0.0, 0
        for row in rows:
            enc = tokenize_with_assistant_mask(tok, row["messages"])
            ids = torch.tensor([enc["input_ids"]])
            labels = torch.where(torch.tensor([enc["assistant_masks"]]) == 1, ids, -100)
            with torch.no_grad():
                loss = model(input_ids=ids, labels=labels).loss
            n = int((labels[0, 1:] != -100).sum())
            total, count = total + loss.item() * n, count + n
        return total / count

    base_nll, sft_nll = heldout_nll(run_dir / "00-pretrain"), heldout_nll(run_dir / "01-sft")
    assert sft_nll < base_nll - 0.3, (base_nll, sft_nll)


def test_rerun_skips_finished_stages(tiny_run):
    run_dir, _ = tiny_run
    before = {d: json.loads((run_dir / d / "manifest.json").read_text())["finished_at"] for d in ("00-pretrain", "01-sft")}
    result = posttrain("run", "pipeline=tiny-ci", f"run.root={run_dir.parent}", "run.name=ci")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pretrain: up to date" in result.stderr and "sft: up to date" in result.stderr
    after = {d: json.loads((run_dir / d / "manifest.json").read_text())["finished_at"] for d in before}
    assert before == after
