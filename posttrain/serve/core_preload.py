"""Imported once by the forkserver that forks every engine process (`posttrain.serve.core`): what loading a model
imports, so that each engine process starts with it already imported. Without it, each checkpoint an eval serves
spent about 2.5 s importing transformers' model classes before it loaded 15 MB of weights."""

import transformers.models.llama.modeling_llama  # noqa: F401  (SmolLM2 and the other Llama-family models)
import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (the tiny world's models, Qwen3)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

import posttrain.quant.export_read  # noqa: F401
import posttrain.quant.linear  # noqa: F401
import posttrain.serve.core  # noqa: F401
import posttrain.serve.server  # noqa: F401
