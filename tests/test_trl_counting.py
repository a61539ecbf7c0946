"""TRL's counting on fastgrpo's trainer: ``max_steps`` counts optimizer steps (and ``-1`` trains ``num_train_epochs``
epochs), ``steps_per_generation`` / ``generation_batch_size`` buffer one generation for several optimizer steps and
compose with ``num_iterations``; TRL 1.16's own trainer runs beside fastgrpo's on the same tiny model, rows and
options, and both make as many generations of as many completions, train as many completions per optimizer step,
take as many optimizer steps and log the same learning rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import save_tiny_llama

from fastgrpo.grpo.generation import windows

pytest.importorskip("trl")
from trl_side_by_side import run_fastgrpo, run_trl  # noqa: E402  (TRL's trainer: after the skip)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


CASES = {  # (num_iterations and steps_per_generation alone: test_trl_recipes, and the logged values below)
    "generation_batch_size 16, accumulation 2": dict(
        generation_batch_size=16, gradient_accumulation_steps=2, num_iterations=2, max_steps=3
    ),
    "max_steps -1, one epoch": dict(max_steps=-1, num_train_epochs=1, steps_per_generation=2),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_generations_steps_and_learning_rates_are_counted_as_trl_counts_them(
    tiny_model_dir: Path, tmp_path: Path, options: dict[str, Any]
) -> None:
    theirs = run_trl(tiny_model_dir, tmp_path / "trl", options)
    ours = run_fastgrpo(tiny_model_dir, tmp_path / "own", options)
    (their_reward, their_trained, their_log), (our_reward, our_trained, our_log) = theirs, ours
    assert our_reward.calls == their_reward.calls  # as many generations, of as many completions
    assert our_trained == their_trained  # completions per optimizer step, and as many steps
    steps = [entry for entry in their_log if "learning_rate" in entry]
    mine = [entry for entry in our_log if "learning_rate" in entry]
    assert [e["step"] for e in mine] == [e["step"] for e in steps]
    assert [e["learning_rate"] for e in mine] == pytest.approx([e["learning_rate"] for e in steps], rel=1e-12)
    assert [e["epoch"] for e in mine] == pytest.approx([e["epoch"] for e in steps], rel=1e-12)
    # the generation's metrics in the record of the step that made it, as TRL logs them
    assert ["reward" in e for e in mine] == ["reward" in e for e in steps]


LOGGED = {
    "a reused generation": dict(num_iterations=2, max_steps=2, entropy_coef=0.1),
    "a reused generation, logging_steps 2": dict(num_iterations=2, max_steps=4, entropy_coef=0.1, logging_steps=2),
    "adaptive entropy": dict(
        max_steps=3, entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=11.0, entropy_coef_delta=0.05
    ),
}


@pytest.mark.parametrize("options", LOGGED.values(), ids=LOGGED.keys())
def test_every_value_trl_logs_is_logged(tiny_model_dir: Path, tmp_path: Path, options: dict[str, Any]) -> None:
    """``num_iterations: 2``: the second optimizer step trains the first's completions again, its record without the
    generation's metrics; with ``logging_steps: 2`` a record holds the mean of the steps' figures (the last step's
    counters, rate and gradient norm); adaptive entropy control moves the coefficient after each step and applies it
    after a step at or below the target (the random model's entropy, near 10.8, is below 11). Every value TRL logs
    is fastgrpo's (times aside; the entropy and the rewards' stds to float32's rounding, as TRL computes them in
    float32; the gradient, which the entropy bonus makes, to 5e-2: near its maximum the entropy's gradient is float32
    rounding of nearly cancelling terms). The top token's completions of a group agree, so the policy loss, and
    without the bonus the gradient, are 0 up to rounding."""
    their_log = run_trl(tiny_model_dir, tmp_path / "trl", options)[2]
    our_log = run_fastgrpo(tiny_model_dir, tmp_path / "own", options)[2]
    times = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
    assert len(our_log) == len(their_log) == options["max_steps"] // options.get("logging_steps", 1) + 1
    for entry, mine in zip(their_log, our_log, strict=True):
        assert not set(entry) - set(mine), set(entry) - set(mine)
        for key in set(entry) - times:
            rel = 1e-6 if key == "entropy" or "loss" in key or key.endswith("std") else 1e-10
            rel = 5e-2 if key == "grad_norm" else rel  # a gradient near 0 (the entropy near its maximum), in float32
            noise = 1e-7 if "loss" in key else 1e-6 if key == "grad_norm" else 1e-12  # a 0 gradient's rounding
            assert mine[key] == pytest.approx(entry[key], rel=rel, abs=noise), key
    coefs = [m["entropy_coef"] for m in our_log[:-1]]
    if options.get("use_adaptive_entropy"):
        assert coefs == pytest.approx([0.15, 0.2, 0.25]) and our_log[0]["loss"] == pytest.approx(0.0, abs=1e-7)


def test_a_generations_windows_are_disjoint_seeded_and_cover_it() -> None:
    parts = windows(12, 3, seed=5, generation=2, rank=0)
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(torch.cat(parts).tolist()) == list(range(12))
    assert all(torch.equal(a, b) for a, b in zip(parts, windows(12, 3, seed=5, generation=2, rank=0), strict=True))
    assert not torch.equal(torch.cat(parts), torch.cat(windows(12, 3, seed=5, generation=3, rank=0)))
    (whole,) = windows(12, 1, seed=5, generation=2, rank=0)  # one window: all rows, shuffled as TRL's
    assert sorted(whole.tolist()) == list(range(12)) and not torch.equal(whole, torch.arange(12))


def test_a_run_resumed_inside_a_generation_samples_its_prompts_anew(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``num_iterations: 2`` saved after the first of a generation's two optimizer steps: the resumed run holds no
    generation, so it samples that generation's prompts again (as TRL's trainer, whose buffer a resume empties), then
    goes on with the next generation."""
    from fastgrpo import GRPOConfig, GRPOTrainer
    from fastgrpo.data import DataConfig

    seen: list[list[str]] = []

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        seen.append(sorted({str(p) for p in prompts}))
        return [float(i % 4) for i in range(len(completions))]

    def config(max_steps: int) -> GRPOConfig:
        return GRPOConfig(
            model=str(tiny_model_dir),
            dataset=DataConfig(num_examples=8),
            reward_funcs=[reward],
            num_generations=4,
            per_device_train_batch_size=4,
            max_completion_length=4,
            num_iterations=2,
            max_steps=max_steps,
            save_steps=1,
            output_dir=str(tmp_path / "run"),
            progress_bar=False,
            log_completions=False,
        )

    GRPOTrainer(config(1)).train()
    resumed = GRPOTrainer(config(3), resume=True).train()
    assert [m["step"] for m in resumed] == [2, 3] and all("reward" in m for m in resumed)
    assert len(seen) == 3 and seen[1] == seen[0] and seen[2] != seen[0]


def test_batches_of_several_generations_are_padded_to_the_widest() -> None:
    """Generations trained in one step: prompts left-padded, completions right-padded, and a field one of them lacks
    (no row of it was scored without gradient) NaN in its rows' completion columns."""
    from fastgrpo.grpo.batch import build_batch, concat_batches

    a = build_batch([[5, 6], [7]], [[1, 2, 3], [4]], 0, torch.tensor([1.0, -1.0]))
    b = build_batch([[8, 9, 10]], [[11]], 0, torch.tensor([0.5]))
    a.start_entropies = torch.ones(2, 3)
    both = concat_batches([a, b], pad_id=0)
    assert both.input_ids.tolist() == [[0, 5, 6, 1, 2, 3], [0, 0, 7, 4, 0, 0], [8, 9, 10, 11, 0, 0]]
    assert both.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert both.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert both.advantages.tolist() == [1.0, -1.0, 0.5] and both.old_logps is None
    assert both.start_entropies[:2].tolist() == [[1.0] * 3] * 2
    assert both.start_entropies[2, 0].isnan() and both.start_entropies[2, 1:].tolist() == [0.0, 0.0]  # padding: 0
