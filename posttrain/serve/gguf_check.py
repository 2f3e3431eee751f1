"""Does llama.cpp run our GGUF file as our engine runs the same weights? Prompt by prompt, through llama-cpp-python:

- the chat template embedded in the file, rendered by llama-cpp-python's formatter, gives the same text as the
  tokenizer's own template, and llama.cpp tokenizes that text to the same ids as transformers;
- llama.cpp's greedy continuation (its quantized matmuls) and our engine's greedy continuation (the file's
  weights dequantized to float) agree on the first `tokens` tokens;
- `create_chat_completion`, llama.cpp's whole chat path, replies with the text those tokens decode to.

`greedy_agreement(gguf_path, model_dir, conversations)` returns one record per conversation; the integration
tests and scripts/gguf_agreement.py count them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.serve.engine import SamplingParams, load_engine


def llama_greedy(llm, prompt: list[int], tokens: int, eos: int) -> list[int]:
    """llama.cpp's greedy tokens after `prompt` (top-k 1), up to `tokens` or its end-of-sequence token."""
    llm.reset()
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        if token == eos or len(out) == tokens:
            break
        out.append(token)
    return out


def greedy_agreement(gguf_path: str | Path, model_dir: str | Path, conversations: list[list[dict]],
                     tokens: int = 16, threads: int | None = None) -> list[dict]:
    """Per conversation: whether the prompts agree, llama.cpp's and our engine's first `tokens` greedy tokens, and
    llama.cpp's chat-completion reply beside our tokens' text. llama.cpp runs on `threads` threads, by default as
    many as torch uses here (OMP_NUM_THREADS when set): its threads wait for each other by spinning, so two of them
    beside another busy process on two cores mostly wait."""
    # optional: llama-cpp-python exists only after `make llamacpp`
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    engine = load_engine(model_dir, max_batch=len(conversations), max_len=512)
    tokenizer = engine.tokenizer
    threads = threads or torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False, seed=0)
    eos = tokenizer.eos_token_id
    formatter = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token=tokenizer.eos_token,
                                    bos_token=tokenizer.bos_token or "", add_generation_prompt=True)
    ours_prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                    for c in conversations]
    ours = engine.generate(ours_prompts, SamplingParams(max_tokens=tokens))
    records = []
    for conversation, prompt, completion in zip(conversations, ours_prompts, ours):
        rendered = formatter(messages=conversation).prompt
        llama_prompt = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        theirs = llama_greedy(llm, llama_prompt, tokens, eos)
        mine = [t for t in completion.token_ids if t != eos][:tokens]
        llm.reset()
        reply = llm.create_chat_completion(messages=conversation, max_tokens=tokens, temperature=0.0, top_k=1,
                                           repeat_penalty=1.0)["choices"][0]["message"]["content"] or ""
        records.append({"prompt_ids_equal": llama_prompt == prompt, "llamacpp": theirs, "posttrain": mine,
                        "agree": theirs == mine, "chat_reply": reply,
                        "chat_reply_matches": reply.strip() == tokenizer.decode(mine, skip_special_tokens=True).strip()})
    return records
