"""KV-cached generation: prefill the prompts, then decode one token per step for every running row.

prefill -> decode_one_token -> generate, each a small function over `serve.model.Transformer` (gpt-fast's
shape). Rows of one batch may have prompts of different lengths: prompts are padded on the right, every row
keeps its own cache position, and the causal mask over cache positions hides both the padding and the stale
slots a row has not reached yet, so a prompt gives the same greedy tokens alone or inside a mixed batch.
"""

from __future__ import annotations

import ctypes
import gc
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from posttrain.models.loading import load_gguf_model, load_tokenizer, torch_dtype
from posttrain.quant.export_read import load_quantized
from posttrain.quant.gguf_names import gguf_file
from posttrain.quant.linear import swap_linears
from posttrain.serve.model import ModelArgs, Transformer, rope_inv_freq
# SamplingParams: the engine's callers take it from here too
from posttrain.serve.sampling import SamplingParams, accept_token, greedy_tokens, sample, sample_rows, top_logprobs


CACHE_BLOCK = 256  # the KV cache grows by this many positions per row at a time


@dataclass
class Completion:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (stop token or string) or "length"
    ttft_s: float  # request start to first token: the prefill
    decode_s: float  # first token to last token
    stop_token_id: int | None = None  # the stop token that ended it (not in token_ids)
    # with SamplingParams.logprobs: one per token of token_ids, then one for stop_token_id when there is one
    logprobs: list[float] | None = None

    @property
    def tbt_s(self) -> float | None:
        """Mean time between tokens after the first."""
        return self.decode_s / (len(self.token_ids) - 1) if len(self.token_ids) > 1 else None


class Engine:
    """Generation over one model: `generate(prompts, params)` -> one `Completion` per prompt."""

    def __init__(self, model: Transformer, tokenizer, max_batch: int = 16, max_len: int | None = None,
                 stop_token_ids: list[int] | None = None, compile: bool = False, kv_dtype: torch.dtype | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        model.kv_dtype = kv_dtype  # None: the weights' dtype
        # compile: the decode step through torch.compile (Inductor fuses the norms, rotations and residual adds
        # into a few C++ loops: far fewer calls per token). It then attends over the whole cache, so the shapes
        # stay fixed and the step compiles once per batch size; the first call takes tens of seconds.
        self.decode_step = torch.compile(model.forward, dynamic=False) if compile else model.forward
        self.compiled = compile
        self.max_batch = max_batch
        self.max_len = min(max_len or model.args.max_position, model.args.max_position)
        self.eos_ids = set(stop_token_ids if stop_token_ids is not None else default_stop_ids(tokenizer))
        self.device = model.model.norm.weight.device

    def release(self) -> None:
        """Drop the model and its KV cache once the engine is done. A stopped server can stay referenced (FastAPI
        keeps its endpoints, and their closures over the engine, in caches of its own), and an eval serves one
        checkpoint after another in one process: without this each one's weights and cache would outlive it."""
        self.model = self.decode_step = None
        gc.collect()
        trim_heap()


    def reserve(self, positions: int, keep: bool = False) -> None:
        """Make the KV cache hold at least `positions` per row (of max_batch rows): it grows in blocks of
        CACHE_BLOCK positions up to max_len, and never shrinks, so it is as large as the longest request so far
        needed rather than max_len (a compiled step attends over the whole cache, so it gets max_len at once).
        keep: the cache holds running rows whose keys must survive the growth."""
        rows, current = self.model.max_batch, self.model.max_len
        if self.compiled:
            length = self.max_len
        elif rows == self.max_batch and positions <= current:
            return
        else:
            length = min(self.max_len, max(current if rows == self.max_batch else 0,
                                           -(-positions // CACHE_BLOCK) * CACHE_BLOCK))
        self.model.setup_cache(self.max_batch, length, keep=keep and rows == self.max_batch)

    # ---- the steps ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], rows: torch.Tensor | None = None,
                every_position: bool = False) -> torch.Tensor:
        """Run the prompts (into cache rows `rows`, default 0..B-1) and return the logits of each one's last
        token: [B, vocab]; every_position: of every position, [B, S, vocab] (the prompt's own log-probabilities)."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        padded = [p + [0] * (width - len(p)) for p in prompts]  # right padding; the mask never reads it
        tokens = torch.tensor(padded, dtype=torch.long, device=self.device)
        pos = torch.arange(width, device=self.device).expand(len(prompts), width)
        return self.model(tokens, pos, slice(0, len(prompts)) if rows is None else rows, width,
                          last=None if every_position else lengths - 1)

    def prompt_logprobs(self, prompt: list[int], logits: torch.Tensor, k: int) -> list:
        """The prompt's tokens scored by the logits of the positions before them ([S, vocab] from
        `prefill(every_position=True)`): None for the first token (nothing precedes it), then `top_logprobs`."""
        if len(prompt) < 2:
            return [None]
        chosen = torch.tensor(prompt[1:], device=logits.device)
        return [None] + top_logprobs(logits[: len(prompt) - 1], chosen, k)

    @torch.inference_mode()
    def decode_one_token(self, tokens: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """tokens, pos: [B] (the newest token of each row and its cache position; length > every pos)
        -> logits [B, vocab]."""
        return self.decode_step(tokens[:, None], pos[:, None], slice(0, tokens.shape[0]),
                                self.max_len if self.compiled else length, last=torch.zeros_like(pos))

    # ---- requests ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams | list[SamplingParams],
                 progress: bool = False) -> list[Completion]:
        """Complete each prompt (token ids, or text tokenized without special tokens added)."""
        ids = [self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in prompts]
        per_prompt = params if isinstance(params, list) else [params] * len(ids)
        if len(per_prompt) != len(ids):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(ids)} prompts")
        for i, (prompt, p) in enumerate(zip(ids, per_prompt)):
            p.check()
            if p.top_logprobs is not None or p.prompt_logprobs is not None or p.logit_bias or p.frequency_penalty \
                    or p.presence_penalty:
                raise ValueError("Engine.generate applies neither logit_bias, the penalties nor the server's "
                                 "log-probabilities; the server's scheduler (serve.scheduler) does")
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) + p.max_tokens > self.max_len:
                raise ValueError(f"prompt {i}: {len(prompt)} prompt tokens + max_tokens {p.max_tokens} exceed the "
                                 f"context of {self.max_len} tokens")
        out: list[Completion] = []
        starts = range(0, len(ids), self.max_batch)
        for start in tqdm(starts, desc="generate", unit="batch", disable=not progress or len(starts) < 2):
            end = start + self.max_batch
            out += self._generate_batch(ids[start:end], per_prompt[start:end])
        return out

    def _generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        n = len(prompts)
        self.reserve(max(len(p) + q.max_tokens for p, q in zip(prompts, params)))
        generators = [torch.Generator(device=self.device).manual_seed(p.seed) if p.seed is not None else None
                      for p in params]
        greedy = all(p.temperature == 0 for p in params)
        # rows without seeds that share their sampling parameters (a GRPO roll-out) are drawn in one call
        knobs = {(p.temperature, p.top_p, p.top_k) for p in params}
        together = not greedy and len(knobs) == 1 and all(p.seed is None for p in params)
        new: list[list[int]] = [[] for _ in range(n)]
        reason: list[str | None] = [None] * n
        texts: list[str | None] = [None] * n
        token_time = [[0.0, 0.0] for _ in range(n)]  # first and last token times per row

        want_logprobs = any(p.logprobs for p in params)
        logprobs: list[list[float]] = [[] for _ in range(n)]
        stop_ids: list[int | None] = [None] * n
        # log-probabilities of the distribution sampled from: the logits over the temperature (1 for greedy rows)
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=self.device)[:, None]

        t0 = time.perf_counter()
        logits = self.prefill(prompts)
        pos = torch.tensor([len(p) for p in prompts], device=self.device)
        while True:
            chosen = (greedy_tokens(logits) if greedy else sample_rows(logits, params[0]).tolist() if together
                      else [sample(logits[r], params[r], generators[r]) for r in range(n)])
            chosen_lp = (torch.log_softmax(logits.float() / temps, dim=-1)
                         .gather(1, torch.tensor(chosen, device=self.device)[:, None])[:, 0].tolist()
                         if want_logprobs else None)
            now = time.perf_counter()
            for r, token in enumerate(chosen):
                if reason[r] is None:
                    kept = len(new[r])
                    self._accept(r, token, new, reason, texts, params[r])
                    if len(new[r]) == kept and reason[r] == "stop" and texts[r] is None:
                        stop_ids[r] = token  # a stop token ended the row
                    if chosen_lp is not None and (len(new[r]) > kept or stop_ids[r] is not None):
                        logprobs[r].append(chosen_lp[r])
                    token_time[r][0] = token_time[r][0] or now
                    token_time[r][1] = now
            if all(reason):
                break
            length = int(pos.max()) + 1
            logits = self.decode_one_token(torch.tensor(chosen, device=self.device), pos, length)
            pos = pos + 1
        return [
            Completion(len(prompts[r]), new[r], texts[r] if texts[r] is not None else self._text(new[r]),
                       reason[r], token_time[r][0] - t0, token_time[r][1] - token_time[r][0],
                       stop_ids[r], logprobs[r] if params[r].logprobs else None)
            for r in range(n)
        ]

    def _accept(self, r, token, new, reason, texts, p: SamplingParams) -> None:
        """Append one token to row r, or finish the row on a stop token, a stop string or the token limit."""
        reason[r], cut = accept_token(token, new[r], p, self.eos_ids, self._text)
        if cut is not None:
            texts[r] = cut

    def _text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:  # token-level use (benchmarks, tests on random configs)
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim). Freed tensors below glibc's mmap threshold stay
    in the heap, which glibc returns only from its top: without this a process that served one SmolLM2 checkpoint
    after another kept ~370 MB of the first one's freed weights resident. No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer is not None and tokenizer.eos_token_id is not None else set()
    return sorted(ids)


# ---- loading ------------------------------------------------------------------------------------------------
def model_from_hf(hf_model, state: dict | None = None) -> Transformer:
    """Our Transformer holding the same tensors as a transformers causal LM (no copy), or the tensors of `state`
    (checkpoint names) under that model's config."""
    config = hf_model.config
    args = ModelArgs.from_hf_config(config)
    inv_freq, scale = rope_inv_freq(config)
    with torch.device("meta"):
        model = Transformer(args, inv_freq, float(scale))
    state = split_fused_experts(dict(hf_model.state_dict() if state is None else state), args)
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inv_freq.float().to(state["model.norm.weight"].device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def split_fused_experts(state: dict, args: ModelArgs) -> dict:
    """transformers 5 keeps a Qwen3-MoE layer's experts as two 3-D tensors; the engine (like the checkpoints on
    disk) has one gate/up/down projection per expert, so each expert is a Linear a quantizer can swap."""
    inter = args.moe_intermediate_size
    for layer in args.sparse_layers:
        prefix = f"model.layers.{layer}.mlp.experts."
        if prefix + "gate_up_proj" not in state:
            continue
        gate_up, down = state.pop(prefix + "gate_up_proj"), state.pop(prefix + "down_proj")  # [E, 2I, H], [E, H, I]
        for e in range(args.num_experts):
            state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter]
            state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:]
            state[f"{prefix}{e}.down_proj.weight"] = down[e]
    return state


def model_from_checkpoint(config, tensors: dict, dtype: torch.dtype) -> Transformer:
    """Our Transformer from a config and checkpoint tensors (checkpoint names; quantized linears absent)."""
    args = ModelArgs.from_hf_config(config)
    inv_freq, scale = rope_inv_freq(config)
    with torch.device("meta"):
        model = Transformer(args, inv_freq, float(scale))
    state = split_fused_experts({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, args)
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"checkpoint tensors the {args.family} engine does not know: {unexpected[:5]}")
    model.inv_freq = inv_freq.float()
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, missing


def load_engine(location, dtype: str = "float32", max_batch: int = 16, max_len: int | None = None,
                quant_backend: str = "auto", kv_dtype: str | None = None) -> Engine:
    """An engine for a model directory: a pipeline artifact's model/ or any HF directory of a supported family,
    float or quantized (the quantize stage's exports, `quant.export`: compressed-tensors, bitsandbytes or the own
    layout; an fp16 export is a float directory), whose quantized linears become dequant-matmul modules
    (`posttrain.quant.linear`: fused kernels for int8 / int4 / fp8, a reference path for the other float formats)."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    config_path = Path(location) / "config.json"
    quantized_dir = config_path.exists() and "quantization_config" in json.loads(config_path.read_text())
    if quantized_dir:
        config, quantized, tensors = load_quantized(location)
        model, missing = model_from_checkpoint(config, tensors, torch_dtype(dtype))
        absent = sorted(set(missing) - {f"{name}.weight" for name in quantized})
        if absent:
            raise ValueError(f"{location}: checkpoint lacks {absent[:5]}")
        swap_linears(model, quantized, torch_dtype(dtype), backend=quant_backend)
        model.fuse_projections()  # q/k/v and gate/up each one kernel call where the layouts allow
        model.eval()
    elif gguf_file(location) is not None:  # a GGUF variant's model/: its weights, dequantized
        model = model_from_hf(load_gguf_model(gguf_file(location), torch_dtype(dtype)))
    else:
        model = model_from_hf(AutoModelForCausalLM.from_pretrained(str(location), dtype=torch_dtype(dtype)))
    return Engine(model, load_tokenizer(location), max_batch=max_batch, max_len=max_len,
                  kv_dtype=torch_dtype(kv_dtype) if kv_dtype else None)
