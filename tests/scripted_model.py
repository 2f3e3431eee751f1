"""A tiny Qwen3 trained to memorise a few chat replies, so server tests know what a real model will answer.

Each reply exercises one part of the API: plain content, reasoning inside <think>…</think>, a <tool_call>.
Training is a few hundred full-batch steps on the replies' tokens (the prompt is masked), checked by greedy decoding
before the model is saved: a fixture that did not learn its script fails loudly instead of making tests flaky.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.tools.calculator import SCHEMA

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

def calculator_script() -> list:
    """Two calculator round trips, then the answer: (2 + 3) * 4 as a tool-using model would work it out."""
    def call(k: int, expression: str) -> dict:
        return {"id": f"call_{k}", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expression}}}

    user = [{"role": "user", "content": "What is (2 + 3) * 4?"}]
    first = {"role": "assistant", "content": "", "tool_calls": [call(0, "2 + 3")]}
    second = {"role": "assistant", "content": "", "tool_calls": [call(1, "5 * 4")]}
    after_first = user + [first, {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    after_second = after_first + [second, {"role": "tool", "tool_call_id": "call_1", "content": "20"}]
    options = {"tools": [SCHEMA]}
    return [(user, first, options), (after_first, second, options),
            (after_second, {"role": "assistant", "content": "The answer is 20."}, options)]


SCRIPT = [  # (prompt messages, the assistant turn it must produce, template options)
    ([{"role": "user", "content": "Say hello."}], {"role": "assistant", "content": "Hello there, friend."}, {}),
    ([{"role": "user", "content": "What is 2 plus 3?"}],
     {"role": "assistant", "reasoning_content": "2 plus 3 makes 5.", "content": "The answer is 5."}, {}),
    ([{"role": "user", "content": "What is the weather in Paris?"}],
     {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"tools": [WEATHER_TOOL]}),
    *calculator_script(),
]


def rendered(tokenizer, prompt, reply, options) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids including the end-of-turn token)."""
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **options)
    full = tokenizer.apply_chat_template(prompt + [reply], tokenize=False, **options)
    if not full.startswith(head):
        raise AssertionError(f"the template's prompt is not a prefix of the full chat:\n{head!r}\n{full!r}")
    tail = full[len(head):].rstrip("\n")  # ends with <|im_end|>
    return (tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(tail, add_special_tokens=False))


def build_scripted_model(out: Path, steps: int = 400, script: list | None = None) -> Path:
    """Train and save the model on `script` (default: all of SCRIPT); a test that needs fewer replies trains on
    fewer, which is faster."""
    import torch

    from posttrain.data.tiny_world import build_tiny_tokenizer
    from posttrain.models.tiny import TinyArch, build_tiny_model

    tokenizer = build_tiny_tokenizer()
    arch = TinyArch(hidden_size=64, intermediate_size=192, num_hidden_layers=2, head_dim=16, max_position_embeddings=512)
    model = build_tiny_model(arch, tokenizer, seed=0)
    pairs = [rendered(tokenizer, *item) for item in (SCRIPT if script is None else script)]
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), width), -100)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
        mask[i, : len(p) + len(r)] = 1
    torch.manual_seed(0)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    with torch.no_grad():
        for p, r in pairs:
            got = model.generate(torch.tensor([p]), max_new_tokens=len(r), do_sample=False)[0, len(p):].tolist()
            if got != r:
                raise AssertionError(f"the scripted model did not learn its reply (loss {loss.item():.4f}): "
                                     f"{tokenizer.decode(got)!r} != {tokenizer.decode(r)!r}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
