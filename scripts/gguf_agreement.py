"""llama.cpp against our engine on a GGUF artifact's weights: greedy agreement on held-out tiny-world prompts.

    python scripts/gguf_agreement.py runs/demo/07-quantize-gguf-q4_k_m
    python scripts/gguf_agreement.py runs/demo/07-quantize-gguf-q4_k_m --prompts 10 --tokens 16 --json out.json

Prints, per prompt, whether llama.cpp's rendering of the file's chat template tokenizes to our prompt ids, whether
the first `--tokens` greedy tokens agree (llama.cpp's quantized matmuls against our engine on the dequantized
weights), and llama.cpp's chat-completion reply. Needs `make llamacpp`. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.data.tiny_world import eval_rows  # noqa: E402  (after the checkout is on the path)
from posttrain.serve.gguf_check import greedy_agreement  # noqa: E402
from posttrain.quant.gguf_names import gguf_file  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="a quantize stage directory of a GGUF variant")
    parser.add_argument("--prompts", type=int, default=10, help="held-out prompts, half arith and half echo")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = args.artifact / "model"
    path = gguf_file(model_dir)
    if path is None:
        parser.error(f"{model_dir} holds no GGUF file: give a quantize stage of a GGUF variant")
    half = args.prompts // 2
    conversations = [r["messages"] for r in eval_rows("arith", args.prompts - half, 0) + eval_rows("echo", half, 0)]
    records = greedy_agreement(path, model_dir, conversations, tokens=args.tokens)
    for i, record in enumerate(records):
        print(f"{i}: prompt ids equal {record['prompt_ids_equal']}, first {args.tokens} tokens agree "
              f"{record['agree']}, chat reply {record['chat_reply']!r}")
    agree = sum(r["agree"] for r in records)
    print(f"{path}: greedy agreement {agree}/{len(records)} on the first {args.tokens} tokens; prompt ids equal "
          f"{sum(r['prompt_ids_equal'] for r in records)}/{len(records)}; chat replies equal to our tokens' text "
          f"{sum(r['chat_reply_matches'] for r in records)}/{len(records)}")
    if args.json:
        args.json.write_text(json.dumps({"gguf": str(path), "records": records}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
