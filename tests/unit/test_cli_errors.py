"""A model that cannot be loaded stops `run`, `stage` and `serve` in one line naming it, before anything starts."""

from __future__ import annotations

import logging

import pytest

from posttrain.models.loading import check_model_reachable, warn_if_refusals_removed
from tests.helpers import posttrain


@pytest.mark.parametrize("argv", [
    ("stage=sft", "model=/nonexistent/model", "data=tiny"),
    ("run", "pipeline=smollm2", "model=/nonexistent/model"),
    ("serve", "/nonexistent/model"),
])
def test_a_missing_model_path_is_one_line_naming_it(argv, tmp_path):
    result = posttrain(*argv, f"run.root={tmp_path}" if argv[0] != "serve" else "port=0", timeout=120)
    assert result.returncode == 2
    assert "model /nonexistent/model: no such file or directory" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())


def test_model_reachability(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="a directory without config.json"):
        check_model_reachable(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    check_model_reachable(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="runs/x/model: no such file or directory"):
        check_model_reachable("runs/x/model")
    with pytest.raises(FileNotFoundError, match="neither an existing local path nor a hub id"):
        check_model_reachable("not a hub id!")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match=r"posttrain-test/absent: not a local path, and not in the Hugging "
                                                r"Face cache .*HF_HUB_OFFLINE=1"):
        check_model_reachable("posttrain-test/absent")
    # online, with no route to the hub (as on a machine without internet) or a hub without the model: one line
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_route(*args, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr("huggingface_hub.file_exists", no_route)
    with pytest.raises(FileNotFoundError, match=r"posttrain-test/absent: not a local path, not in the Hugging Face "
                                                r"cache .* the hub could not be asked for it \(ConnectionError"):
        check_model_reachable("posttrain-test/absent")
    monkeypatch.setattr("huggingface_hub.file_exists", lambda *args, **kwargs: False)
    with pytest.raises(FileNotFoundError, match="the hub has no config.json for it"):
        check_model_reachable("posttrain-test/absent")


def test_a_name_that_claims_refusals_were_removed_is_warned_about(tmp_path, caplog):
    model = tmp_path / "Qwen3-0.6B-Abliterated"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        check_model_reachable(str(model))
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "the name says 'abliterated'" in message and "projected out of the weights" in message
    assert "pku_saferlhf" in message and str(model) in message
    assert warn_if_refusals_removed("someone/Llama-3-8B-heretic-uncensored") == ["heretic", "uncensored"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert warn_if_refusals_removed("HuggingFaceTB/SmolLM2-135M-Instruct") == []
    assert not caplog.records
