"""lm-evaluation-harness through our server (posttrain/evaluation/harness.py): its `local-completions` model runs a
log-likelihood task and a generative task on local task YAMLs, and its scores equal what transformers' own forward
pass on the same weights implies, document by document. A random tiny Llama (SmolLM2's shape); nothing trained."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra posttrain[lmeval]; `make venv` installs it")

from posttrain.config_schema import ServeCfg  # noqa: E402
from posttrain.evaluation import harness  # noqa: E402
from posttrain.serve.server import background_server  # noqa: E402

KEY = "lm-eval-key"
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "to", "park", "bird", "sang", "a", "song"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=tiny_tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("lm-eval-model")
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def docs(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    pick = lambda k: " ".join(WORDS[i] for i in torch.randint(len(WORDS), (k,), generator=g).tolist())  # noqa: E731
    return [{"context": pick(6), "a": " " + pick(3), "b": " " + pick(2)} for _ in range(n)]


def write_tasks(root, mc_docs, gen_docs) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc_docs))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in gen_docs))
    (root / "pairs_mc.yaml").write_text(f"""task: pairs_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
doc_to_choice: "{{{{[a, b]}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
    higher_is_better: true
""")
    (root / "continue_gen.yaml").write_text(f"""task: continue_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["<never>"]
  max_gen_toks: 4
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")


def test_lm_eval_scores_through_the_server_equal_transformers(model_dir, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = tiny_tokenizer

    def loglikelihood(context: str, continuation: str) -> float:
        ctx = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + continuation, add_special_tokens=False)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
        return sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))

    def greedy(context: str) -> str:
        ids = tok.encode(context, add_special_tokens=False)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                          pad_token_id=tok.eos_token_id)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)

    mc = docs(8, seed=1)
    expected_acc = sum(loglikelihood(d["context"], d["a"]) > loglikelihood(d["context"], d["b"]) for d in mc) / 8
    gen = docs(6, seed=2)
    for i, d in enumerate(gen):  # half the targets are the model's greedy continuation, half are not
        d["target"] = greedy(d["context"]) if i % 2 == 0 else "no such words"
    write_tasks(tmp_path, mc, gen)
    cfg = SimpleNamespace(tasks=["pairs_mc", "continue_gen"], include_path=str(tmp_path), include_defaults=False,
                          limit=None, num_concurrent=2)
    harness.require_lm_eval(cfg)
    with pytest.raises(ValueError, match="no_such_task"):  # before any server starts
        harness.require_lm_eval(SimpleNamespace(tasks=["no_such_task"], include_path=str(tmp_path),
                                                include_defaults=False))
    opts = ServeCfg(model=str(model_dir), port=0, api_key=KEY, served_model_name="tiny", max_batch=4, max_len=256,
                    threads=1)
    with background_server(opts) as server:
        results = harness.run_tasks(server.base_url, KEY, server.name, str(model_dir), cfg, seed=0)
    assert results["pairs_mc"]["n"] == 8 and results["continue_gen"]["n"] == 6
    assert results["pairs_mc"]["metrics"]["acc"] == pytest.approx(expected_acc)
    assert 0 < expected_acc < 1  # the documents tell the two choices apart both ways
    assert results["pairs_mc"]["stderr"]["acc"] > 0
    assert results["continue_gen"]["metrics"]["exact_match"] == pytest.approx(0.5)
    lines = harness.render([{"checkpoint": "tiny", "lm_eval": results}])
    assert any("| tiny | pairs_mc | acc |" in line for line in lines)

