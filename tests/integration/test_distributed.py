"""Two CPU processes (gloo) run the training stages as one process does: same losses, same weights on every rank,
one artifact written by rank 0; `posttrain run pipeline.launcher=ddp` launches a stage under `accelerate launch`
with the parent's config hash, and a crashed rank fails its stage cleanly.

    .venv/bin/python -m pytest -q tests/integration/test_distributed.py    # about 4 minutes on 2 cores

One tiny base is pretrained per module. SFT, reward model, DPO and GRPO then run as one pipeline (4 steps each)
twice: in one process with a batch of 2B, and under `torchrun --nproc_per_node 2` with B per process (the same
global batch). DPO comes before GRPO so that its parent is the SFT model in both runs: GRPO's samples differ
between the runs (below), so a GRPO parent would make the DPO comparison meaningless.

DPO runs with the plain sigmoid loss here. The recipe adds an NLL term on the chosen reply (loss_type [sigmoid, sft]),
which TRL averages over each process's own tokens: two processes then weight tokens differently from one (as SFT
would without transformers' average_tokens_across_devices), and the losses differed by up to 3e-3 (relative) over
the 4 steps we measured. That is TRL's normalisation, not a wiring fault, so the exact comparison leaves it out.

Tolerances, measured on this machine (torch 2.13 CPU, fp32): the losses differed by at most 7e-8 (relative) for
SFT, 4e-7 for the reward model and 7e-7 for DPO; we allow 1e-5. The final weights differ by float rounding (the
allreduce sums in another order, and Adam enlarges it where a gradient is near zero): |w_two - w_one| was at most
4e-5 of |w_one - w_parent|, the distance training moved the weights (L2 over every tensor); we allow 1e-3. A run
whose ranks trained on the wrong rows would be off by a sizeable fraction of that distance.

GRPO is not compared loss for loss: TRL seeds each process differently (`set_seed(seed, device_specific=True)`) so
that the ranks do not draw the same completions, and sampling a batch of 8 rows draws other random numbers than a
batch of 16, so the two runs score different completions and their losses differ by tens of percent. What must
hold instead: both runs train on the same prompts in the same order; the completions table holds the whole global
batch (both ranks' rows, gathered in rank order, groups whole), and its mean reward per step is the reward TRL
logged for that step; the ranks end with identical weights.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path

import pytest

from posttrain.artifacts import verify_artifact
from tests.helpers import REPO, posttrain
from tests.integration.launching import (B, DIRS, LOSS_RTOL, STAGES, STEPS, WEIGHT_RTOL, free_port, losses,
                                         pipeline_args, torchrun, weight_distance, weights)

pytestmark = pytest.mark.slow


def digests(folder: Path, stage: str) -> dict[int, str]:
    return {int(p.name.rsplit(".rank", 1)[1].split(".")[0]): p.read_text() for p in folder.glob(f"{stage}.rank*.sha256")}


@pytest.fixture(scope="module")
def runs(one_process, tmp_path_factory) -> dict[str, Path]:
    """The same four stages in one process (batch 2B, shared with the launcher tests) and in two (B each); each
    rank's weight digest per stage."""
    root = tmp_path_factory.mktemp("runs")
    base = one_process["base"]
    two = torchrun(*pipeline_args(root, "two", base, B), f"debug.weight_digest_dir={root / 'digest-two'}",
                   timeout=600)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    return {"one": one_process["run"], "two": root / "two", "digest-two": root / "digest-two",
            "log-two": two.stderr, "base": base}


@pytest.mark.parametrize("stage", STAGES)
def test_stage_finishes_once_with_the_same_weights_on_both_ranks(runs, stage):
    stage_dir = runs["two"] / DIRS[stage]
    manifest = verify_artifact(stage_dir)  # weights on disk match the manifest rank 0 wrote
    assert manifest["processes"] == 2 and manifest["metrics"]["global_step"] == STEPS
    assert len(list(stage_dir.rglob("manifest.json"))) == 1 and not list(stage_dir.glob("*.tmp"))
    assert not (stage_dir / "checkpoints").exists()  # dropped once, by rank 0, after every rank finished
    ranks = digests(runs["digest-two"], stage)
    assert set(ranks) == {0, 1} and ranks[0] == ranks[1], ranks
    # rank 1 stays quiet: every stage's progress line is logged once
    assert runs["log-two"].count(f"{stage}: running ->") == 1


@pytest.mark.parametrize("stage", ["sft", "reward_model", "dpo"])
def test_loss_trajectory_and_weights_match_one_process_with_the_same_global_batch(runs, stage):
    one, two = losses(runs["one"] / DIRS[stage]), losses(runs["two"] / DIRS[stage])
    assert len(one) == len(two) == STEPS
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{stage} step {step}: one process {a}, two processes {b}"
    w_one, w_two = weights(runs["one"] / DIRS[stage]), weights(runs["two"] / DIRS[stage])
    parent = weights(runs["base"] if stage == "sft" else runs["one"] / DIRS["sft"])
    assert w_one.keys() == w_two.keys()
    apart, moved = weight_distance(w_one, w_two), weight_distance(w_one, parent)
    assert apart <= WEIGHT_RTOL * moved, f"{stage}: the runs' weights are {apart:.3g} apart; training moved {moved:.3g}"


def test_grpo_table_holds_the_global_batch_of_both_ranks(runs):
    def table(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / DIRS["grpo"] / "completions.jsonl").read_text().splitlines()]

    rows, reference = table(runs["two"]), table(runs["one"])
    assert len(rows) == len(reference) == STEPS * 4 * B  # written once, by rank 0, with rank 1's rows gathered
    curve = json.loads((runs["two"] / DIRS["grpo"] / "manifest.json").read_text())["metrics"]["reward_curve"]
    for step in range(STEPS):
        batch = [r for r in rows if r["step"] == step]
        assert len(batch) == 4 * B
        assert all(len({r["prompt"] for r in batch[i:i + 4]}) == 1 for i in range(0, len(batch), 4))  # whole groups
        assert [r["prompt"] for r in batch] == [r["prompt"] for r in reference if r["step"] == step]
        mean = sum(r["reward"] for r in batch) / len(batch)
        assert abs(mean - curve[step]["reward"]) < 1e-6, (step, mean, curve[step])


def test_posttrain_run_launches_each_stage_under_accelerate_and_a_crashed_rank_fails_it(runs, tmp_path):
    """pipeline.launcher=ddp: for each training stage the parent writes launch.json and runs `accelerate launch`
    (2 CPU processes, torchrun underneath). SFT: the child composes the same config (the same hash as the torchrun
    run's SFT, whose overrides it shares) and trains the same steps. The reward model: rank 1 raises at step 2
    (debug.fault); rank 0 does not hang in its next collective, the stage ends within a minute or so
    with no manifest, and the parent stops with exit code 2 naming the stage, the command, the child's log and
    rank 1's error."""
    port = free_port()
    result = posttrain(*pipeline_args(tmp_path, "l", runs["base"], B, stages=["sft", "reward_model"]), "pipeline.launcher=ddp",
                       f"pipeline.launcher_args=[--num_processes,2,--mixed_precision,no,--main_process_port,{port}]",
                       "debug.fault.rank=1", "debug.fault.step=2", "debug.fault.stage=reward_model", timeout=300)
    assert result.returncode == 2, result.stderr[-4000:]
    sft_dir, rm_dir = tmp_path / "l" / "00-sft", tmp_path / "l" / "01-reward_model"
    manifest = verify_artifact(sft_dir)
    spec = json.loads((sft_dir / "launch.json").read_text())
    torchrun_manifest = json.loads((runs["two"] / DIRS["sft"] / "manifest.json").read_text())
    assert manifest["processes"] == 2 and spec["config_hash"] == manifest["config_hash"]
    assert manifest["config_hash"] == torchrun_manifest["config_hash"]
    assert losses(sft_dir) == pytest.approx(losses(runs["two"] / DIRS["sft"]), rel=LOSS_RTOL)

    error = result.stderr[result.stderr.index("posttrain: error:"):]
    assert "reward_model: the stage failed under accelerate launch" in error
    assert f"--config_file {REPO / 'recipes' / 'accelerate' / 'ddp.yaml'}" in error
    assert str(rm_dir / "launch.log") in error
    assert "[rank1]: RuntimeError: debug.fault: injected failure in rank 1 at step 2 of reward_model" in error
    assert not (rm_dir / "manifest.json").exists()
    # from the parent's "running" line to the failed child's last line: no hang on the dead peer
    started = re.search(r"\[posttrain (\d\d:\d\d:\d\d)\] reward_model: running", result.stderr).group(1)
    ended = time.strftime("%H:%M:%S", time.localtime(rm_dir.joinpath("launch.log").stat().st_mtime))
    seconds = (datetime.strptime(ended, "%H:%M:%S") - datetime.strptime(started, "%H:%M:%S")).seconds
    assert seconds < 150, f"the failing reward_model stage took {seconds} s to end"
