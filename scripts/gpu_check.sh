#!/usr/bin/env bash
# One-call GPU check of the tiny CI pipeline on the device machine (nvidia-h200; see the workplace's device notes).
# The machine has no internet and lacks trl, datasets, hydra-core, omegaconf, math-verify (and has transformers 5.17),
# so the missing / pinned packages travel as wheels in .whl/ (git-ignored through .git/info/exclude).
#
# Run from the repo root, through the device tool:  command "bash scripts/gpu_check.sh", carry [".whl"],
# timeout_s ~520. It is sized to end in under 8 minutes (TOTAL_BUDGET): the pipeline (~2 minutes), one SFT step and
# one GRPO step on a random ~0.5B Qwen3 (scripts/gpu_train_step.py, up to 100 s), the unit tests in whatever time
# the decode benchmark does not need, then scripts/gpu_decode.py (~3 minutes: Triton kernel checks, bandwidth,
# decode tokens/s of our engine and of transformers for bf16/int8/int4).
# What comes back under $OUT (the device tool returns 8 files at most, so the per-stage manifests travel as one
# file): pipeline.log, scorecard.md, manifests.json ({"NN-<stage>": manifest}), gpu_train_step.json, unit.log,
# gpu_decode.log, gpu_decode.json (gpu_train_step.log is the eighth). The runs themselves (model weights) stay under /tmp/gpu-runs on the machine.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check-out}
RUNS=/tmp/gpu-runs
RUN=gpu
TOTAL_BUDGET=470      # seconds the whole script may take (the device tool's limit is 600)
DECODE_RESERVE=210    # seconds kept for scripts/gpu_decode.py; the unit tests get what is left before it
PIPELINE_LIMIT=200    # seconds for the pipeline itself
TRAIN_LIMIT=100       # seconds for scripts/gpu_train_step.py (one SFT step, one GRPO step at ~0.5B)
mkdir -p "$OUT"
START=$SECONDS
say() { echo "[gpu_check +$((SECONDS - START))s] $*"; }

export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# --- 1. the carried wheels ------------------------------------------------------------------------------------------
if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_check: no wheels under .whl/ (call the device tool with carry [\".whl\"])" >&2
    exit 3
fi
say "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >/tmp/gpu_check_pip.log 2>&1; then
    echo "gpu_check: wheel install failed:" >&2
    cat /tmp/gpu_check_pip.log >&2
    exit 3
fi
export PYTHONPATH=/tmp/site:$PWD

# --- 2. the machine and the packages --------------------------------------------------------------------------------
say "nvidia-smi -L"
nvidia-smi -L || echo "gpu_check: nvidia-smi -L failed (rc $?)"

if ! python3 - <<'PY'; then
import glob, importlib, importlib.metadata as md, os, sys

print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "| cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no device")
failed = []
for mod in ("transformers", "trl", "datasets", "peft", "accelerate", "hydra", "omegaconf", "math_verify",
            "latex2sympy2_extended", "posttrain", "rewards"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:22s} {getattr(m, '__version__', '-'):10s} {os.path.dirname(m.__file__)}")
    except Exception as err:  # report every import problem, then stop
        failed.append(f"{mod}: {type(err).__name__}: {err}")

# Each carried wheel's requirements against what is importable here (carried wheels shadow the machine's).
from packaging.requirements import Requirement
warnings = []
for wheel in sorted(glob.glob(".whl/*.whl")):
    dist = os.path.basename(wheel).split("-")[0]
    try:
        requires = md.requires(dist) or []
    except md.PackageNotFoundError:
        warnings.append(f"{dist}: carried but not found after the install")
        continue
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            warnings.append(f"{dist} needs {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            warnings.append(f"{dist} needs {req}: found {have}")
for w in warnings:
    print("  requirement not met:", w)
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
print("  machine's versions:", {n: version(n) for n in ("huggingface-hub", "tokenizers", "safetensors", "regex",
                                                         "fsspec", "pyarrow", "pandas", "sympy", "numpy", "psutil")})
for f in failed:
    print("  IMPORT FAILED:", f)
if failed:
    sys.exit(4)
if not torch.cuda.is_available():
    print("gpu_check: torch sees no CUDA device; stopping before the pipeline")
    sys.exit(5)
PY
    echo "gpu_check: environment check failed; see above" >&2
    exit 4
fi

# --- 3. the tiny CI pipeline on the GPU ------------------------------------------------------------------------------
OVERRIDES=()
for stage in pretrain sft reward_model grpo dpo; do
    OVERRIDES+=("$stage.trainer.use_cpu=false" "$stage.trainer.bf16=true")
done
rm -rf "$RUNS"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 2 >/tmp/gpu_check_smi.csv 2>&1 &
SMI_PID=$!
say "pipeline: python3 -m posttrain run pipeline=tiny-ci run.root=$RUNS run.name=$RUN ${OVERRIDES[*]}"
PIPE_RC=0
timeout "$PIPELINE_LIMIT" python3 -m posttrain run pipeline=tiny-ci "run.root=$RUNS" "run.name=$RUN" "${OVERRIDES[@]}" \
    2>&1 | tee "$OUT/pipeline.log" || PIPE_RC=$?
kill "$SMI_PID" 2>/dev/null || true
say "pipeline exit status $PIPE_RC (124 = cut at ${PIPELINE_LIMIT}s)"
python3 - <<'PY' || true
import csv
rows = [r for r in csv.reader(open("/tmp/gpu_check_smi.csv")) if len(r) == 3]
def num(field):
    head = field.split()[:1]
    return int(head[0]) if head and head[0].isdigit() else None
mem = [v for v in (num(r[2]) for r in rows) if v is not None]
util = [v for v in (num(r[1]) for r in rows) if v is not None]
print(f"nvidia-smi while the pipeline ran: {len(rows)} samples, max memory.used {max(mem, default=0)} MiB, "
      f"max utilization {max(util, default=0)} %")
PY

# --- 4. the small files back: scorecard and every stage's manifest (in one file) --------------------------------------
cp "$RUNS/$RUN/scorecard.md" "$OUT/scorecard.md" 2>/dev/null || echo "gpu_check: no scorecard.md was written"
python3 - "$RUNS/$RUN" "$OUT/manifests.json" <<'PY' || true
import glob, json, os, sys

manifests = {}
for stage_dir in sorted(glob.glob(os.path.join(sys.argv[1], "[0-9][0-9]-*/"))):
    path = os.path.join(stage_dir, "manifest.json")
    if not os.path.isfile(path):
        print(f"gpu_check: no manifest in {stage_dir}")
        continue
    manifests[os.path.basename(os.path.normpath(stage_dir))] = json.load(open(path))
json.dump(manifests, open(sys.argv[2], "w"), indent=1)
for m in manifests.values():
    metrics, stage = m.get("metrics", {}), m.get("stage")
    trainer = (m.get("config", {}).get(stage) or {}).get("trainer", {})
    summary = next((h for h in reversed(metrics.get("log_history", [])) if "train_runtime" in h), {})
    device = m.get("device") or metrics.get("device") or "not recorded"
    print(f"{stage:13s} global_step={metrics.get('global_step')} train_runtime={summary.get('train_runtime')}s "
          f"samples/s={summary.get('train_samples_per_second')} loss {metrics.get('first_logged_loss')} -> "
          f"{metrics.get('last_logged_loss')} | device: {device} (use_cpu={trainer.get('use_cpu')}, "
          f"bf16={trainer.get('bf16')}) | transformers {m.get('packages', {}).get('transformers')} "
          f"trl {m.get('packages', {}).get('trl')}")
PY
if [ -f "$OUT/scorecard.md" ]; then cat "$OUT/scorecard.md"; fi

# --- 5. one SFT step and one GRPO step on a random Qwen3 of ~0.5B (vLLM colocated rollouts when vLLM is here) -------
LEFT=$((TOTAL_BUDGET - DECODE_RESERVE - (SECONDS - START)))
TRAIN_RC=0
if [ "$LEFT" -gt 60 ]; then
    LIMIT=$((LEFT < TRAIN_LIMIT ? LEFT : TRAIN_LIMIT))
    say "gpu_train_step.py (timeout ${LIMIT}s)"
    timeout "$LIMIT" python3 scripts/gpu_train_step.py --json "$OUT/gpu_train_step.json" 2>&1 \
        | grep -v 'it/s]' | tee "$OUT/gpu_train_step.log" || TRAIN_RC=$?
    say "gpu_train_step.py exit status $TRAIN_RC (1 = a step failed, 124 = cut at the timeout)"
else
    say "skipping gpu_train_step.py: ${LEFT}s left before the ${DECODE_RESERVE}s kept for gpu_decode.py"
fi

# --- 6. unit tests, only if time is left before the decode benchmark's reserve ---------------------------------------
LEFT=$((TOTAL_BUDGET - DECODE_RESERVE - (SECONDS - START)))
if [ "$LEFT" -gt 30 ]; then
    LIMIT=$((LEFT < 150 ? LEFT : 150))
    say "unit tests (timeout ${LIMIT}s)"
    timeout "$LIMIT" python3 -m pytest -q -x tests/unit -k "not smollm2" -p no:cacheprovider 2>&1 \
        | tee "$OUT/unit.log" || true
else
    say "skipping unit tests: ${LEFT}s left before the ${DECODE_RESERVE}s kept for gpu_decode.py"
fi

# --- 7. decode speed: our engine vs transformers, bf16 / int8 / int4, against the bandwidth ceiling ------------------
# gpu_decode.py stops starting rows when its --budget-s is spent (a row takes up to ~30 s) and rewrites its JSON
# after every row, so the hard timeout below, should it strike, still leaves the rows measured so far.
LEFT=$((TOTAL_BUDGET - (SECONDS - START)))
DECODE_RC=0
if [ "$LEFT" -gt 60 ]; then
    say "gpu_decode.py (budget $((LEFT - 35))s, timeout $((LEFT - 5))s)"
    timeout "$((LEFT - 5))" python3 scripts/gpu_decode.py --budget-s "$((LEFT - 35))" --json "$OUT/gpu_decode.json" \
        2>&1 | tee "$OUT/gpu_decode.log" || DECODE_RC=$?
    say "gpu_decode.py exit status $DECODE_RC (1 = a section failed, 124 = cut at the timeout)"
else
    say "skipping gpu_decode.py: ${LEFT}s left of ${TOTAL_BUDGET}s"
    DECODE_RC=6
fi
say "done; pipeline exit status $PIPE_RC, gpu_decode exit status $DECODE_RC"
if [ "$PIPE_RC" -ne 0 ]; then exit "$PIPE_RC"; fi
exit "$DECODE_RC"
