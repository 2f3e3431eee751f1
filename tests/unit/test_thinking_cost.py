"""`posttrain template cost`: context tokens and KV bytes per turn with think blocks dropped and kept, from the
template's own rendering and the planner's KV bytes per token."""

from __future__ import annotations

import json

from posttrain.chat.render import load_template
from posttrain.chat.thinking_cost import thinking_cost, thinking_text
from posttrain.data.tiny_world import build_tiny_tokenizer
from posttrain.template_cli import main

# Writes reasoning only for assistant turns after the last user message, and has no preserve_thinking knob.
DROPPING = ("{%- for m in messages -%}<{{ m.role }}>{%- if m.role == 'assistant' and loop.last and m.reasoning_content "
            "-%}<think>{{ m.reasoning_content }}</think>{%- endif -%}{{ m.content }}</{{ m.role }}>{%- endfor -%}")
CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=64,
              intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="bfloat16")


def test_kept_thinking_grows_by_each_turns_think_block():
    tokenizer = build_tiny_tokenizer()
    assert len(tokenizer(thinking_text(tokenizer, 50), add_special_tokens=False)["input_ids"]) == 50
    rows, has_knob = thinking_cost(load_template("tiny"), tokenizer, 4, 50, kv_bytes_per_token=1000)
    assert has_knob  # the tiny template's preserve_thinking
    assert rows[0].kept_tokens == rows[0].dropped_tokens
    per_turn = {b.dropped_tokens - a.dropped_tokens for a, b in zip(rows, rows[1:])}
    kept_extra = [r.kept_tokens - r.dropped_tokens for r in rows]
    assert len(per_turn) == 1 and per_turn.pop() < 50  # dropped: a question and an answer per turn
    assert kept_extra[1] >= 50 and kept_extra == [i * kept_extra[1] for i in range(4)]  # + one think block a turn
    assert all(r.kept_kv_bytes == 1000 * r.kept_tokens and r.dropped_kv_bytes == 1000 * r.dropped_tokens
               for r in rows)


def test_a_template_without_the_knob_gets_the_kept_cost_computed():
    tokenizer = build_tiny_tokenizer()
    rows, has_knob = thinking_cost(DROPPING, tokenizer, 3, 40, kv_bytes_per_token=10, state_bytes=7)
    assert not has_knob
    block = len(tokenizer("<think>" + thinking_text(tokenizer, 40) + "</think>", add_special_tokens=False)["input_ids"])
    assert block > 40  # this template writes no tags around an empty reasoning, so they count
    assert [r.kept_tokens - r.dropped_tokens for r in rows] == [0, block, 2 * block]
    assert rows[2].kept_kv_bytes == 10 * rows[2].kept_tokens + 7


def test_cost_command_prints_the_table_from_a_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert main(["--config", str(tmp_path / "config.json"), "--turns", "3", "--thinking-tokens", "30"], "cost") == 0
    out = capsys.readouterr().out
    assert "3 full-attention layers x 2 (k, v) x 2 kv heads x 16 head_dim x 2 B = 384 B" in out
    assert "kept: the template's preserve_thinking knob" in out and out.count("\n| ") == 4
    assert main(["--config", str(tmp_path / "config.json"), "--turns", "0"], "cost") == 2
    assert "--turns and --thinking-tokens must be positive" in capsys.readouterr().err
