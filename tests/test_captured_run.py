"""A compiled training run meets its shapes in its first steps and then compiles nothing more: the KV caches are made
once per run at its configured maximum and stay at the same addresses through every policy update, and every compiled
function (the target's steps and the EAGLE expansion) sees only bucketed row counts and extents.

Compiled with the ``eager`` backend, Dynamo's capture run as captured: the same graphs, guards and shapes as under
inductor, without generating code or AOT's second trace; on a GPU each of these graphs is a CUDA graph whose recording
follows the same shapes and addresses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_tiny_llama
from test_trainer import length_reward, make_config

from fastgrpo.config import SpeculationConfig
from fastgrpo.data import DataConfig, make_arithmetic
from fastgrpo.grpo.trainer import GRPOTrainer


def buffer_addresses(trainer: GRPOTrainer) -> tuple[int, ...]:
    """The data pointers of every KV buffer of the run: the target's and the EAGLE draft's."""
    caches = [trainer.rollouts.engine.cache]
    caches += [d.cache for d in trainer.rollouts.drafters if d.name == "eagle"]
    return tuple(buf.data_ptr() for cache in caches for layer in cache.layers for buf in (layer.keys, layer.values))


def test_a_compiled_run_compiles_in_its_first_steps_only_and_keeps_its_caches_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five GRPO steps with compiled decoding steps and static EAGLE trees, prompts of other lengths every step: the
    steps after the second compile no graph, and the KV buffers have the same addresses after every step."""
    monkeypatch.setattr("fastgrpo.grpo.trainer.compile_backend", lambda choice, device: "eager")
    model_dir = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)
    config = make_config(
        model_dir,
        tmp_path / "run",
        dataset=DataConfig(num_examples=40),
        max_completion_length=10,
        temperature=1.0,
        max_steps=5,
        save_steps=100,
        compile="on",
        speculation=SpeculationConfig(mode="static", drafter="eagle", nodes=4, k_max=2, depth=2),
    )
    dataset = make_arithmetic(config.dataset)
    for i, row in enumerate(dataset):  # prompts of other lengths
        row["prompt"][0]["content"] += " Think it through." * (i % 5)
    trainer = GRPOTrainer(config, dataset=dataset)
    trainer.reward_funcs = [length_reward]
    addresses, prompt_lengths = [], []
    generate = trainer.rollouts.generate

    def recorded(prompt_ids, *args, **kwargs):
        out = generate(prompt_ids, *args, **kwargs)
        addresses.append(buffer_addresses(trainer))
        prompt_lengths.append(max(map(len, prompt_ids)))
        return out

    monkeypatch.setattr(trainer.rollouts, "generate", recorded)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "compile/graphs" in m]
    assert len(steps) == 5 and len(set(prompt_lengths)) > 1, "five compiled rollouts, prompts of several lengths"
    assert steps[0]["compile/graphs"] > 0
    assert [m["compile/graphs"] for m in steps[2:]] == [0, 0, 0], "nothing compiled after the second step"
    assert len(set(addresses)) == 1, "every KV buffer stays where the first rollout made it"
    trainer.rollouts.release()  # what the trainer gives back before an update on a GPU
    assert buffer_addresses(trainer) == addresses[0]
