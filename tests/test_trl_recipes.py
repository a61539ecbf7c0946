"""TRL 1.16's documented GRPO recipes (its paper index), each with its options as TRL's documentation gives them and
sizes cut to a tiny model: as a Python script with only the import changed, fastgrpo's trainer makes as many
generations of as many completions, trains as many completions per optimizer step, takes as many optimizer steps and
logs the same learning rates and epochs as TRL's trainer on the same rows; the same options from YAML are the same
config; where TRL refuses a recipe, fastgrpo refuses it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import save_tiny_llama

from fastgrpo import GRPOConfig
from fastgrpo.config import config_to_dict, load_config

trl = pytest.importorskip("trl")
from trl_side_by_side import run_fastgrpo, run_trl  # noqa: E402  (TRL's trainer: after the skip)

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(16)]
DAPO = dict(mask_truncated_completions=True, loss_type="dapo", epsilon_high=0.28, epsilon=0.2, beta=0.0)
VLLM = dict(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_cap=2.0)
RECIPES: dict[str, dict[str, Any]] = {
    "quick start": {},
    "GSPO": dict(
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=0.0,
        epsilon=3e-4,
        epsilon_high=4e-4,
        gradient_accumulation_steps=1,
        steps_per_generation=4,
    ),
    "DAPO": DAPO,
    "80/20": {**DAPO, "top_entropy_quantile": 0.2},
    "Lite PPO": dict(  # a generation is a quarter of an optimizer step's completions, as in the recipe (8 of 32)
        scale_rewards="batch",
        loss_type="dapo",
        beta=0.0,
        top_p=0.99,
        top_k=100,
        temperature=0.99,
        num_iterations=1,
        gradient_accumulation_steps=8,
        steps_per_generation=2,
    ),
    "TIS": {**VLLM, "vllm_importance_sampling_mode": "sequence_truncate"},
    "MIS": {**VLLM, "vllm_importance_sampling_mode": "sequence_mask"},
    "SAPO": dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, scale_rewards="group"),
    "DeepSeek-V3.2": dict(beta=0.001, use_bias_correction_kl=True),
}
# TRL refuses these on one process: their generation batch (per_device_train_batch_size, TRL's default 8 for ScaleRL)
# is not a whole number of groups of num_generations.
REFUSED: dict[str, dict[str, Any]] = {
    "Dr. GRPO": dict(loss_type="dr_grpo", per_device_train_batch_size=1, num_generations=8, beta=0.0),
    "ScaleRL": dict(
        loss_type="cispo", epsilon_high=5.0, num_generations=16, scale_rewards="batch", cast_lm_head_to_fp32=True
    ),
}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def for_trl(options: dict[str, Any]) -> dict[str, Any]:
    """The recipe without its vLLM options: TRL's trainer cannot start vLLM on a CPU, and they change neither what is
    counted nor the schedule."""
    return {k: v for k, v in options.items() if not k.startswith(("vllm_", "use_vllm"))}


TRL_RUNS: dict[str, Any] = {}  # TRL's counts by its options: TIS and MIS without vLLM are the quick start


def trl_counts(model_dir: Path, out: Path, options: dict[str, Any]) -> Any:
    key = repr(sorted(options.items()))
    if key not in TRL_RUNS:
        TRL_RUNS[key] = run_trl(model_dir, out, options, ROWS)
    return TRL_RUNS[key]


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_a_trl_recipe_trains_as_trl_counts_it(tiny_model_dir: Path, tmp_path: Path, recipe: dict[str, Any]) -> None:
    options = {"max_steps": 2, "lr_scheduler_type": "linear", **recipe}
    theirs = trl_counts(tiny_model_dir, tmp_path / "trl", for_trl(options))
    ours = run_fastgrpo(tiny_model_dir, tmp_path / "own", options, ROWS)
    assert ours[0].calls == theirs[0].calls  # generations, and the completions of each
    assert ours[1] == theirs[1]  # the completions of each optimizer step, and as many steps
    their_steps = [e for e in theirs[2] if "learning_rate" in e]
    our_steps = [e for e in ours[2] if "learning_rate" in e]
    for key in ("step", "learning_rate", "epoch"):
        assert [e[key] for e in our_steps] == pytest.approx([e[key] for e in their_steps], rel=1e-12), key


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_a_trl_recipe_in_yaml_is_the_same_config(tmp_path: Path, recipe: dict[str, Any]) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert config_to_dict(load_config(path, [])) == config_to_dict(GRPOConfig(**recipe))


@pytest.mark.parametrize("recipe", REFUSED.values(), ids=REFUSED.keys())
def test_a_recipe_trl_refuses_is_refused(tmp_path: Path, recipe: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="num_generations"):
        trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **recipe)
    with pytest.raises(ValueError, match=r"must be a multiple of num_generations"):
        GRPOConfig(**recipe).validate()
