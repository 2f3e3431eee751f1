"""Every sharded launcher config trains here, on two CPU processes, as it would on GPUs: FSDP2, DeepSpeed ZeRO-2,
ZeRO-3, and ZeRO-3 with its optimizer states and weights offloaded (`posttrain run pipeline.launcher=<name>` with
the README's CPU overrides: two processes, no bf16 autocast).

    .venv/bin/python -m pytest -q tests/integration/test_sharded_launchers.py                   # CI's cells
    POSTTRAIN_LAUNCHER_MATRIX=full .venv/bin/python -m pytest -q tests/integration/test_sharded_launchers.py
                                                            # every stage x every launcher: make test-launchers

Each cell (stage x launcher) must: record in its manifest the strategy the trainer really ran (accelerate once
fell back to DDP for FSDP on CPU, silently), be written once, by rank 0, as a model directory that loads in one
process; and match the one-process run on the same global batch (conftest's `one_process`): losses within
LOSS_RTOL step for step, and final weights within WEIGHT_RTOL of the distance training moved them (the tolerances
of test_distributed.py, which says why they hold). GRPO is held to what test_distributed.py holds it to (each
process samples its own completions): the same prompts in the same order, and the weights changed.

Measured here (torch 2.13 CPU, fp32, 2 cores, `make test-launchers` on the commit that added this file; the table
is printed at the end of the run): the losses differed from one process by at most 5.5e-6 (relative; DPO under
zero3_offload), SFT by at most 5.3e-7; each cell's stage took 14-25 s, the whole file 8 min 53 s.
CI runs full-FT SFT under fsdp2 and zero2, LoRA SFT under fsdp2 and zero3, the fsdp2 resume and the two-machine
launch (SFT under ZeRO-3); the full matrix adds every other cell, zero3_offload, LoRA's loss comparison and the
zero3 resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.artifacts import verify_artifact
from tests.helpers import REPO, cli_env, posttrain
from tests.integration.launching import (B, DIRS, LORA, LOSS_RTOL, STAGES, STEPS, WEIGHT_RTOL, free_port,
                                         largest_loss_difference, launcher_args, losses, pipeline_args, stage_seconds,
                                         weight_distance, weights)

pytestmark = pytest.mark.slow
LAUNCHERS = ("fsdp2", "zero2", "zero3", "zero3_offload")
FULL = os.environ.get("POSTTRAIN_LAUNCHER_MATRIX") == "full"
# CI: full-FT SFT under fsdp2 and zero2 here; zero3 trains SFT in the LoRA and two-machine tests below
STAGES_RUN = {launcher: STAGES for launcher in LAUNCHERS} if FULL else {"fsdp2": ("sft",), "zero2": ("sft",)}
CELLS = [(launcher, stage) for launcher, stages in STAGES_RUN.items() for stage in stages]
LOGIT_ATOL = 1e-5
TABLE: dict[tuple[str, str], dict] = {}  # (launcher, stage) -> seconds, largest loss difference: printed at the end


@pytest.fixture(scope="module")
def launched(one_process, tmp_path_factory):
    """launcher -> its run directory, each launcher's stages trained once (on first use) as one pipeline."""
    done: dict[str, Path] = {}

    def run(launcher: str) -> Path:
        if launcher not in done:
            root = tmp_path_factory.mktemp(launcher)
            result = posttrain(*pipeline_args(root, launcher, one_process["base"], B, STAGES_RUN[launcher]),
                               *launcher_args(launcher), timeout=900)
            assert result.returncode == 0, result.stderr[-5000:]
            for stage, seconds in stage_seconds(result.stderr).items():
                TABLE.setdefault((launcher, stage), {})["seconds"] = seconds
            done[launcher] = root / launcher
        return done[launcher]

    yield run
    report(TABLE)


def report(table: dict) -> None:
    lines = ["", "launcher x stage on 2 CPU processes: seconds, largest loss difference from one process (relative)"]
    order = {name: i for i, name in enumerate((*LAUNCHERS, *STAGES))}
    for (launcher, stage), cell in sorted(table.items(), key=lambda item: (order[item[0][0]], order[item[0][1]])):
        difference = cell.get("loss_difference")
        shown = "not compared (sampling)" if difference is None else f"{difference:.1e}"
        lines.append(f"  {launcher:<14} {stage:<13} {cell.get('seconds', float('nan')):6.1f} s   {shown}")
    print("\n".join(lines))  # shown with -s or -rA; make test-launchers passes -s


@pytest.mark.parametrize("launcher,stage", CELLS, ids=[f"{l}-{s}" for l, s in CELLS])
def test_stage_trains_under_launcher_as_in_one_process(launched, one_process, launcher, stage):
    stage_dir = launched(launcher) / DIRS[stage]
    record = verify_artifact(stage_dir)  # the weights on disk are those rank 0's manifest names
    assert record["strategy"]["name"] == launcher and record["strategy"]["processes"] == 2, record["strategy"]
    assert record["processes"] == 2 and record["metrics"]["global_step"] == STEPS
    assert len(list(stage_dir.rglob("manifest.json"))) == 1 and not (stage_dir / "checkpoints").exists()
    load_in_one_process(stage_dir, stage)

    reference = one_process["run"] / DIRS[stage]
    parent = one_process["base"] if stage == "sft" else one_process["run"] / DIRS["sft"]
    w_one, w_two, w_parent = weights(reference), weights(stage_dir), weights(parent)
    assert w_one.keys() == w_two.keys()
    if stage == "grpo":  # sampled completions differ; the prompts, their order and a real update do not
        assert prompts_by_step(stage_dir) == prompts_by_step(reference)
        assert weight_distance(w_two, w_parent) > 0
        TABLE.setdefault((launcher, stage), {})["loss_difference"] = None
        return
    difference = largest_loss_difference(losses(reference), losses(stage_dir))
    TABLE.setdefault((launcher, stage), {})["loss_difference"] = difference
    assert difference <= LOSS_RTOL, f"{launcher} {stage}: {losses(stage_dir)} vs one process {losses(reference)}"
    apart, moved = weight_distance(w_one, w_two), weight_distance(w_one, w_parent)
    assert apart <= WEIGHT_RTOL * moved, f"{launcher} {stage}: {apart:.3g} from one process; training moved {moved:.3g}"


def load_in_one_process(stage_dir: Path, stage: str) -> None:
    """The saved model loads in this (single) process and gives finite outputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kind = AutoModelForSequenceClassification if stage == "reward_model" else AutoModelForCausalLM
    model = kind.from_pretrained(stage_dir / "model").eval()
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(out).all()


def prompts_by_step(stage_dir: Path) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in (stage_dir / "completions.jsonl").read_text().splitlines()]
    return [(r["step"], r["prompt"]) for r in rows]


# --- LoRA under sharding ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_one_process(one_process, tmp_path_factory) -> Path | None:
    """LoRA SFT in one process, the sharded LoRA runs' loss reference (full matrix only: CI compares logits)."""
    if not FULL:
        return None
    root = tmp_path_factory.mktemp("lora-one")
    result = posttrain(*pipeline_args(root, "one", one_process["base"], 2 * B, ("sft",)), LORA, timeout=600,
                       OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "one" / DIRS["sft"]


@pytest.mark.parametrize("launcher", ["fsdp2", "zero3"])
def test_lora_adapters_trained_sharded_merge_into_the_saved_model(one_process, lora_one_process, launcher,
                                                                   tmp_path):
    """LoRA SFT under a launcher that shards the weights: the adapter is saved, and the merged model/ gives the
    logits of the parent with that adapter applied (peft, one process) within LOGIT_ATOL; in the full matrix the
    losses are also those of one process."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = posttrain(*pipeline_args(tmp_path, "l", one_process["base"], B, ("sft",)), LORA,
                       *launcher_args(launcher), timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    stage_dir = tmp_path / "l" / DIRS["sft"]
    record = verify_artifact(stage_dir)
    assert record["strategy"]["name"] == launcher
    if lora_one_process is not None:
        assert largest_loss_difference(losses(lora_one_process), losses(stage_dir)) <= LOSS_RTOL

    merged = AutoModelForCausalLM.from_pretrained(stage_dir / "model").eval()
    parent = AutoModelForCausalLM.from_pretrained(one_process["base"] / "model").eval()
    applied = PeftModel.from_pretrained(parent, stage_dir / "adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = applied(ids).logits, merged(ids).logits
        base = applied.get_base_model()
        with applied.disable_adapter():
            untrained = base(ids).logits
    assert (got - want).abs().max().item() <= LOGIT_ATOL
    assert (got - untrained).abs().max().item() > 100 * LOGIT_ATOL  # the adapter did change the model


# --- resume from a sharded checkpoint --------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["fsdp2", "zero3"] if FULL else ["fsdp2"])
def test_a_killed_rank_resumes_from_the_sharded_checkpoint(launched, launcher, one_process, tmp_path):
    """SFT under the launcher with a checkpoint every 2 steps; rank 1 dies at step 3 (debug.fault). The stage
    fails with no manifest, leaving checkpoint-2 as each rank's shards; the rerun resumes from it under the same
    launcher and ends on the final loss of the uninterrupted run (the matrix's SFT cell)."""
    args = [*pipeline_args(tmp_path, "r", one_process["base"], B, ("sft",)), "sft.trainer.save_steps=2",
            "sft.trainer.ddp_timeout=30"]
    killed = posttrain(*args, *launcher_args(launcher), "debug.fault.rank=1", "debug.fault.step=3",
                       "debug.fault.stage=sft", timeout=600)
    stage_dir = tmp_path / "r" / DIRS["sft"]
    assert killed.returncode == 2 and not (stage_dir / "manifest.json").exists(), killed.stderr[-3000:]
    checkpoint = stage_dir / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists() and not (stage_dir / "checkpoints" / "checkpoint-4").exists()

    resumed = posttrain(*args, *launcher_args(launcher), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    record = verify_artifact(stage_dir)
    assert record["resumed_from"] == str(checkpoint) and record["strategy"]["name"] == launcher
    uninterrupted = losses(launched(launcher) / DIRS["sft"]) if launcher in STAGES_RUN else None
    final = losses(stage_dir)[-1]
    reference = uninterrupted[-1] if uninterrupted else losses(one_process["run"] / DIRS["sft"])[-1]
    assert abs(final - reference) <= LOSS_RTOL * abs(reference), (final, reference)


# --- two machines, simulated ------------------------------------------------------------------------------------------
def test_two_machines_of_one_process_each_train_sft_and_write_one_artifact(one_process, tmp_path):
    """The multi_node template as its header says to run it, once per "machine" (--machine_rank 0 and 1), here two
    launches of one process each on this host with main_process_ip 127.0.0.1 and the shared run directory: SFT
    trains under its ZeRO-3 config, machine 0 alone writes the artifact, and the losses and final weights are one
    process's (within the matrix's tolerances)."""
    stage_args = ["stage=sft", *pipeline_args(tmp_path, "m", one_process["base"], B, ("sft",))[1:]]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              "recipes/accelerate/multi_node.yaml", "--num_machines", "2", "--num_processes", "2",
              "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), "--mixed_precision", "no"]
    machines = [subprocess.Popen([*launch, "--machine_rank", str(rank), "-m", "posttrain", *stage_args], cwd=REPO,
                                 env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for rank in (0, 1)]
    outputs = [machine.communicate(timeout=600)[0] for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    [stage_dir] = (tmp_path / "m").glob("*-sft")
    record = verify_artifact(stage_dir)
    assert record["strategy"]["name"] == "zero3" and record["processes"] == 2
    assert len(list((tmp_path / "m").rglob("manifest.json"))) == 1
    assert outputs[0].count("sft: done in") == 1 and "sft: done in" not in outputs[1]  # machine 1 stays quiet
    reference = one_process["run"] / DIRS["sft"]
    assert largest_loss_difference(losses(reference), losses(stage_dir)) <= LOSS_RTOL
    load_in_one_process(stage_dir, "sft")
    w_one, w_two, w_parent = weights(reference), weights(stage_dir), weights(one_process["base"])
    assert weight_distance(w_one, w_two) <= WEIGHT_RTOL * weight_distance(w_one, w_parent)
