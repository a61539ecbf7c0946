"""Data-parallel GRPO on torch.distributed (gloo, CPU): two processes train exactly like one with the same global
batch, keep their drafts identical, resume from their checkpoints, and a failing rank ends the job with its error.

Rollouts are sampled at temperature 1 rather than greedy: greedy completions of a prompt are all equal, so every
advantage would be zero and no weight would move. Sampling does not depend on how many processes share a step (each
rank takes its rows' share of the job's uniforms), so the completions of both runs are the same.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import fork_ranks, free_port, save_tiny_llama, torchrun_two
from safetensors.torch import load_file

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig, load_config
from fastgrpo.grpo.trainer import GRPOTrainer

TESTS = Path(__file__).parent


def run_config(model_dir: Path, out: Path, per_device: int, **overrides) -> GRPOConfig:
    """Two steps of 2 prompts x 4 generations in total: ``per_device`` rows per process and micro-batch."""
    values = dict(
        model=str(model_dir),
        dataset={"num_examples": 32},
        reward_funcs=["distributed_rewards:length_reward"],
        num_generations=4,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=1,
        max_completion_length=12,
        learning_rate=1e-3,
        max_steps=2,
        save_steps=2,
        output_dir=str(out),
        progress_bar=False,
        log_completions=False,
        logging_steps=1,
        gradient_checkpointing=False,
        device="cpu",
        ddp_timeout=60,
        speculation={"mode": "adaptive", "c_peak": 8},
    )
    values.update(overrides)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return load_config(path, [])


def _worker(rank: int, world: int, port: int, config: str, draft_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        trainer = GRPOTrainer(load_config(config))
        trainer.train()
        trainer.rollouts.drafter("eagle").draft.save(Path(draft_dir) / f"rank{rank}")
        # Freed while the group is up: freed after `shutdown`, its DDP reducer would hold the group's last reference,
        # whose gloo destructor, run with the GIL held, can wait for ever on a worker thread that waits for the GIL.
        del trainer
    finally:
        distributed.shutdown()


def torchrun(config: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``fastgrpo train`` in 2 processes under torchrun (the reward module importable from the tests)."""
    train = ["-m", "fastgrpo", "train", "--config", str(config), *args]
    return torchrun_two(train, {"PYTHONPATH": str(TESTS)}, timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def spawn_run(model_dir: Path, root: Path, **overrides) -> Path:
    """A 2-process run of 2 steps, launched with torch.multiprocessing: 1 prompt per process, its 4 completions
    trained in 2 micro-batches of 2 (gradients are synchronised at the second only)."""
    run_config(model_dir, root / "run", per_device=2, gradient_accumulation_steps=2, **overrides)
    fork_ranks(_worker, (2, free_port(), str(root / "run.yaml"), str(root / "drafts")))
    return root


@pytest.fixture(scope="module")
def single_process_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    GRPOTrainer(run_config(model_dir, out, per_device=8)).train()
    return out


@pytest.fixture(scope="module")
def two_process_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spawn_run(model_dir, tmp_path_factory.mktemp("ddp"))


def assert_same_training(model_dir: Path, single: Path, run: Path) -> None:
    initial = load_file(str(model_dir / "model.safetensors"))
    one = load_file(str(single / "checkpoint-2" / "model.safetensors"))
    two = load_file(str(run / "checkpoint-2" / "model.safetensors"))
    assert any(not torch.equal(one[k], initial[k]) for k in one), "the updates should move the weights"
    # Adam moves every weight by about the learning rate (1e-3), however small its gradient: the summation order of
    # gradients differs between the runs, so weights agree to 1 % of one step.
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-5)
    logged = [yaml.safe_load(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2]  # logged once, by rank 0
    single_log = (single / "metrics.jsonl").read_text().splitlines()
    assert [yaml.safe_load(line)["reward"] for line in single_log] == [m["reward"] for m in logged]


def test_two_processes_train_like_one_with_the_same_global_batch(
    model_dir: Path, single_process_run: Path, two_process_run: Path
) -> None:
    assert_same_training(model_dir, single_process_run, two_process_run / "run")


def test_drafts_stay_identical_across_ranks(model_dir: Path, two_process_run: Path) -> None:
    rank0 = load_file(str(two_process_run / "drafts" / "rank0" / "draft.safetensors"))
    rank1 = load_file(str(two_process_run / "drafts" / "rank1" / "draft.safetensors"))
    saved = load_file(str(two_process_run / "run" / "checkpoint-2" / "draft" / "draft.safetensors"))
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) and torch.equal(rank0[k], saved[k]) for k in rank0)


def test_two_process_checkpoint_resumes_under_torchrun(model_dir: Path, two_process_run: Path) -> None:
    config = two_process_run / "run.yaml"
    result = torchrun(config, "--resume", "--max_steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    out = two_process_run / "run"
    assert (out / "checkpoint-3" / "model.safetensors").is_file()
    steps = [yaml.safe_load(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_failing_rank_ends_the_job_with_its_error(model_dir: Path, tmp_path: Path) -> None:
    run_config(model_dir, tmp_path / "fail", per_device=4, reward_funcs=["distributed_rewards:fail_on_rank_1"])
    result = torchrun(tmp_path / "fail.yaml", timeout=600)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "reward function failed on rank 1" in output
    assert "timed out" not in output.lower(), "rank 0 waited for the collective's timeout instead of ending at once"


def test_fsdp2_trains_like_one_process_and_resumes(model_dir: Path, single_process_run: Path, tmp_path: Path) -> None:
    """The policy sharded with FSDP2 (full parameters gathered for rollouts): the same weights as one process, and
    its checkpoint (weights and optimizer state gathered in full) resumes under torchrun."""
    root = spawn_run(model_dir, tmp_path, fsdp=True)
    assert_same_training(model_dir, single_process_run, root / "run")
    rank0 = load_file(str(root / "drafts" / "rank0" / "draft.safetensors"))
    rank1 = load_file(str(root / "drafts" / "rank1" / "draft.safetensors"))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    result = torchrun(root / "run.yaml", "--resume", "--max_steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (root / "run" / "checkpoint-3" / "model.safetensors").is_file()


def test_metrics_of_ranks_are_combined_by_kind(monkeypatch) -> None:
    """Times are the slowest rank's, throughput the sum, and a mean skips ranks that measured nothing (NaN)."""
    parts = [
        {"time/step": 2.0, "rollout/tokens_per_second": 10.0, "reward": 0.5, "spec/tree_accept_length": float("nan")},
        {"time/step": 3.0, "rollout/tokens_per_second": 30.0, "reward": 1.0, "spec/tree_accept_length": 1.8},
    ]
    monkeypatch.setattr(distributed, "gather", lambda value: parts)
    out = distributed.reduce_metrics(parts[0])
    assert out == {"time/step": 3.0, "rollout/tokens_per_second": 40.0, "reward": 0.75, "spec/tree_accept_length": 1.8}
    parts[1]["spec/tree_accept_length"] = float("nan")
    assert math.isnan(distributed.reduce_metrics(parts[0])["spec/tree_accept_length"])
