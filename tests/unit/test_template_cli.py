"""`posttrain template render` (posttrain.template_cli.main) on the tiny template and the six real templates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from posttrain import template_cli as cli
from posttrain.chat.render import load_template, render_chat

TEMPLATE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "reference" / "chat_templates"
# name -> the end-of-turn marker the output must list among the control tokens
REAL = {
    "qwen3-0.6b": "<|im_end|>",
    "qwen2.5-7b-instruct": "<|im_end|>",
    "llama-3.1-8b-instruct": "<|eot_id|>",
    "llama-3.2-3b-instruct": "<|eot_id|>",
    "gemma-2-2b-it": "<end_of_turn>",
    "qwen3.5-4b": "<|im_end|>",
}
NO_SYSTEM = [m for m in cli.EXAMPLE_MESSAGES if m["role"] != "system"]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from posttrain.data.tiny_world import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def reuse_tiny_tokenizer(monkeypatch, tiny_tokenizer):
    # Building the tiny tokenizer takes seconds; every main() call here would rebuild it.
    monkeypatch.setattr("posttrain.template_cli.build_tiny_tokenizer", lambda: tiny_tokenizer)


def _real(name: str) -> Path:
    path = TEMPLATE_DIR / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{path} absent: the real chat templates live in ../shared (not checked out here)")
    return path


def test_tiny_default_prints_text_token_count_control_ids_and_mask(capsys, tiny_tokenizer):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    text = render_chat(load_template("tiny"), cli.EXAMPLE_MESSAGES, eos_token="<|im_end|>")
    assert text in out
    assert "<think>\nDoubling 42" in text  # the example's reasoning turn is rendered
    assert f"tokens: {len(tiny_tokenizer(text, add_special_tokens=False)['input_ids'])}\n" in out
    assert "  <|im_start|>  id 1  x5" in out and "  <|im_end|>  id 2  x5" in out and "  <think>  id 2042  x1" in out
    assert re.search(r"assistant mask: \d+/\d+ tokens \(0\.\d{3}\)", out)
    assert "note:" not in out


def test_tiny_knobs_reach_the_template(capsys, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "add"}}]))
    argv = ["--add-generation-prompt", "--no-enable-thinking", "--reasoning-effort", "low", "--tools", str(tools)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n\n--- end ---" in out
    assert "Reasoning effort: low." in out and '"name": "add"' in out


@pytest.mark.shared
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_templates_render_with_control_tokens_listed(capsys, tmp_path, name):
    path = _real(name)
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps(NO_SYSTEM if name.startswith("gemma") else cli.EXAMPLE_MESSAGES))
    assert cli.main(["--template", str(path), "--messages", str(messages)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: no --tokenizer given, using the tiny tokenizer")
    expected = render_chat(load_template(str(path)), json.loads(messages.read_text()), eos_token="<|im_end|>")
    assert expected in out
    assert re.search(r"^tokens: \d+$", out, re.M)
    end = REAL[name]
    vocab_note = "id 2" if end == "<|im_end|>" else "not in vocabulary"
    assert re.search(rf"^  {re.escape(end)}  {vocab_note}", out, re.M)
    assert "assistant mask: " in out and "unavailable" not in out


@pytest.mark.shared
def test_gemma_system_role_is_a_one_line_error(capsys):
    assert cli.main(["--template", str(_real("gemma-2-2b-it"))]) == 2
    err = capsys.readouterr().err.strip()
    assert "System role not supported" in err and "\n" not in err and "Traceback" not in err


def test_missing_template_and_bad_knob_return_2(capsys):
    assert cli.main(["--template", "does/not/exist.jinja"]) == 2
    assert "does/not/exist.jinja" in capsys.readouterr().err
    assert cli.main(["--reasoning-effort", "extreme"]) == 2


def test_prompt_only_messages_render_and_report_the_mask_unavailable(capsys, tmp_path):
    messages = tmp_path / "prompt.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    assert cli.main(["--messages", str(messages), "--add-generation-prompt"]) == 0
    assert "assistant mask: unavailable: conversation: assistant mask is empty" in capsys.readouterr().out
