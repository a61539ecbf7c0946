"""GRPO trainer: a short run updates weights and writes loadable checkpoints; resume continues exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama
from transformers import AutoModelForCausalLM

from fastgrpo.config import GRPOConfig, SpeculationConfig
from fastgrpo.data import DataConfig, make_arithmetic
from fastgrpo.grpo.batch import build_batch
from fastgrpo.grpo.trainer import GRPOTrainer


def length_reward(completions: list[str], **kwargs) -> list[float]:
    """A reward that varies across random completions, so advantages are non-zero."""
    return [float(len(c) % 7) for c in completions]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its LM head is scaled up, so that it emits a few likely tokens per context: a draft can learn it, while a
    near-uniform random model over 49k tokens leaves nothing to learn."""
    return save_tiny_llama(tmp_path_factory.mktemp("peaked"), seed=1, tie_word_embeddings=False, head_scale=150.0)


def make_config(model_dir: Path, out: Path, **overrides) -> GRPOConfig:
    values = dict(
        model=str(model_dir),
        dataset=DataConfig(num_examples=32),
        reward_funcs=["accuracy"],
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_completion_length=12,
        learning_rate=1e-3,
        lr_scheduler_type="constant",  # runs cut and resumed with another max_steps train as the whole run did
        max_steps=2,
        save_steps=2,
        output_dir=str(out),
        progress_bar=False,
        log_completions=False,
        logging_steps=1,
        gradient_checkpointing=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def make_trainer(config: GRPOConfig, resume: bool = False) -> GRPOTrainer:
    trainer = GRPOTrainer(config, dataset=make_arithmetic(config.dataset), resume=resume)
    trainer.reward_funcs = [length_reward]
    return trainer


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_device_without_bf16_units_warns_naming_the_option(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    native: bool,
) -> None:
    from fastgrpo.config import DraftTrainConfig

    monkeypatch.setattr("fastgrpo.models.native_bf16", lambda device: native)
    draft_training = DraftTrainConfig(online=True, bf16=True)  # the draft trainer warns for its own option
    config = make_config(tiny_model_dir, tmp_path, bf16=True, draft_training=draft_training)
    with caplog.at_level("WARNING", logger="fastgrpo.models"):
        make_trainer(config)
    warned = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    if native:
        assert warned == []
    else:
        assert [m.split(":")[0] for m in warned] == ["bf16", "draft_training.bf16"]
        assert all("set " in m and ": false" in m for m in warned)


def test_two_steps_change_weights_and_write_loadable_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(make_config(tiny_model_dir, tmp_path))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    history = trainer.train()
    assert len(history) == 2
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "training did not change any weight"

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for name in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "clip_ratio/region_mean"):
        assert name in lines[0]
    assert lines[0]["time/rollout"] > 0 and lines[0]["memory/peak_mb"] > 0
    for m in lines:  # where a step's time went: the parts of the update add up to it, drafting is inside the rollout
        assert m["time/logprobs"] > 0 and m["time/update"] > 0 and m["time/draft_learning"] >= 0
        assert m["time/logprobs"] + m["time/update"] <= m["time/train"] + 1e-6 and m["time/train"] < m["time/step"]
        assert 0 <= m["time/drafting"] <= m["time/rollout"]

    checkpoint = tmp_path / "checkpoint-2"
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, trainer.model.state_dict()[k])
    assert not list(tmp_path.glob(".checkpoint-*")), "a temporary checkpoint directory was left behind"


def test_cpu_threads_hold_while_training_and_are_restored_after(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer(make_config(tiny_model_dir, tmp_path, cpu_threads=1, max_steps=1, save_steps=1))
    seen = []
    rollout = trainer.rollout
    monkeypatch.setattr(trainer, "rollout", lambda *a: seen.append(torch.get_num_threads()) or rollout(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (metrics,) = trainer.train()
        assert seen == [1] and torch.get_num_threads() == 2
        assert metrics["cpu/threads"] == 1.0
        assert trainer.rollouts.engine.threads is trainer.threads and trainer.update.threads is trainer.threads
    finally:
        torch.set_num_threads(before)


class Interrupt(Exception):
    pass


def test_resume_gives_the_same_next_step_as_an_uninterrupted_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    full = make_trainer(make_config(tiny_model_dir, tmp_path / "full", max_steps=4, save_steps=2)).train()

    interrupted = make_trainer(make_config(tiny_model_dir, tmp_path / "cut", max_steps=4, save_steps=2))
    step_fn = interrupted.train_step

    def crash_on_fourth(step: int) -> dict[str, float]:
        if step == 3:  # after step 3 was logged, past the checkpoint of step 2
            raise Interrupt
        return step_fn(step)

    interrupted.train_step = crash_on_fourth
    with pytest.raises(Interrupt):
        interrupted.train()
    resumed = make_trainer(make_config(tiny_model_dir, tmp_path / "cut", max_steps=4, save_steps=2), resume=True)
    assert resumed.start_step == 2
    third, fourth = resumed.train()
    for again, uninterrupted in ((third, full[2]), (fourth, full[3])):
        assert again["step"] == uninterrupted["step"]
        assert again["reward"] == uninterrupted["reward"]
        assert again["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-6, abs=1e-9)
        assert again["num_tokens"] == uninterrupted["num_tokens"], "TRL's count of the run's tokens goes on"
    assert full[0]["num_tokens"] < full[1]["num_tokens"] and all(s["step_time"] > 0 for s in full)
    assert all(0 <= s["completions/min_terminated_length"] <= s["completions/max_terminated_length"] for s in full)
    logged = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4]


def test_same_seed_runs_are_bit_identical_at_a_fixed_thread_count(tiny_model_dir: Path, tmp_path: Path) -> None:
    """What the README states: two same-seed runs at the same fixed thread count (``cpu_threads: N``) whose rollouts'
    shapes do not follow measured times (``speculation.mode: off``) end with the same policy bit for bit (the
    importance-sampling correction on, as in the issue's report); at another thread count torch's CPU kernels sum in
    another order and the policy agrees only to rounding (why ``cpu_threads: 0``, whose count follows the machine's
    load, is not bit for bit)."""
    from safetensors.torch import load_file

    def policy(name: str, threads: int) -> dict[str, torch.Tensor]:
        config = make_config(
            tiny_model_dir,
            tmp_path / name,
            cpu_threads=threads,
            importance_sampling_correction=True,
            speculation=SpeculationConfig(mode="off"),
        )
        make_trainer(config).train()
        return load_file(tmp_path / name / "checkpoint-2" / "model.safetensors")

    first, again, other = policy("a", 1), policy("b", 1), policy("c", 2)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(torch.allclose(first[k], other[k], rtol=1e-3, atol=1e-5) for k in first)


def test_save_only_model_writes_the_policy_without_optimizer_state(tiny_model_dir: Path, tmp_path: Path) -> None:
    """As TRL's option: the checkpoint loads as a model, holds no optimizer state, and --resume says why it cannot
    continue from it; a callable reward is written to config.yaml by name."""
    config = make_config(tiny_model_dir, tmp_path, save_only_model=True, reward_funcs=[length_reward])
    make_trainer(config).train()
    checkpoint = tmp_path / "checkpoint-2"
    AutoModelForCausalLM.from_pretrained(checkpoint)
    assert set(torch.load(checkpoint / "trainer_state.pt", weights_only=False)) == {
        "step",
        "rng",
        "layout",
        "config",
        "num_tokens",
    }
    assert "test_trainer:length_reward" in (tmp_path / "config.yaml").read_text()
    with pytest.raises(ValueError, match="save_only_model"):
        make_trainer(config, resume=True)


def test_resume_without_checkpoint_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        make_trainer(make_config(tiny_model_dir, tmp_path), resume=True)


@pytest.mark.parametrize("layout", [None, 2, 4])
def test_a_checkpoint_of_another_layout_is_refused_before_any_weight_is_read(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: int | None
) -> None:
    """A checkpoint whose state holds no layout (written by a fastgrpo that saved none) or another one than
    `LAYOUT` is refused by --resume with one line naming it, before a model loads."""
    from fastgrpo.grpo import trainer as trainer_module
    from fastgrpo.grpo.checkpoint import LAYOUT, STATE_FILE, save_checkpoint
    from fastgrpo.grpo.run_dir import claim_output_dir

    assert LAYOUT == 3  # the parameters are an older layout, none, and a newer one
    run_id = claim_output_dir(tmp_path, resume=False, overwrite=False)
    checkpoint = save_checkpoint(tmp_path, 2, lambda directory: None, {"optimizer": {}, "scheduler": {}}, run_id)
    state = torch.load(checkpoint / STATE_FILE, weights_only=False)
    assert state.pop("layout") == LAYOUT
    torch.save(state if layout is None else {**state, "layout": layout}, checkpoint / STATE_FILE)

    def load_model(*args, **kwargs):
        pytest.fail("a model was loaded for a checkpoint that cannot be resumed")

    monkeypatch.setattr(trainer_module, "load_model", load_model)
    with pytest.raises(ValueError) as refused:
        make_trainer(make_config(tiny_model_dir, tmp_path), resume=True)
    age = "a newer" if layout == 4 else "an older"
    assert str(refused.value) == (
        f"--resume: {checkpoint} was written by {age} fastgrpo (checkpoint layout {layout or 1}, this one reads 3) "
        "and cannot be resumed; start a new run from its weights with --model"
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_skipping_zero_advantage_rows_leaves_the_update_unchanged(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    """Rows with advantage 0 are skipped and rows regrouped by length; the optimizer step must not change."""
    torch.manual_seed(1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]] * 2
    completions = [[11 + i] * (1 + (3 * i) % 5) for i in range(8)]
    advantages = torch.tensor([0.5, 0.0, -1.0, 0.0, 0.0, 2.0, -0.3, 0.0])
    results = []
    for regroup in (True, False):
        high = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
        trainer = make_trainer(make_config(tiny_model_dir, tmp_path / str(regroup), loss_type=loss_type, **high))
        if not regroup:
            size = trainer.config.per_device_train_batch_size
            trainer.update.micro_batches = lambda b, size=size: list(torch.arange(b.input_ids.shape[0]).split(size))
        batch = build_batch(prompts, completions, trainer.tokenizer.pad_token_id, advantages)
        metrics = trainer.update.optimize(batch)
        results.append((metrics["loss"], [p.detach().clone() for p in trainer.model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lora_trains_only_adapters_and_kl_uses_the_base_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = make_config(tiny_model_dir, tmp_path, use_peft=True, lora_r=4, beta=0.1, max_steps=1, save_steps=1)
    trainer = make_trainer(config)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    (metrics,) = trainer.train()
    changed = {k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference


def test_lora_resume_continues_the_same_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    def config(out: Path, steps: int) -> GRPOConfig:
        return make_config(tiny_model_dir, out, use_peft=True, lora_r=4, max_steps=steps, save_steps=1)

    full = make_trainer(config(tmp_path / "full", 2))
    full.train()
    make_trainer(config(tmp_path / "cut", 1)).train()
    resumed = make_trainer(config(tmp_path / "cut", 2), resume=True)
    names = [n for n, _ in resumed.model.named_parameters()]
    assert not any(n.count("base_model") > 1 for n in names), "the adapter is loaded once, not wrapped twice"
    assert sum(p.requires_grad for p in resumed.model.parameters()) == sum(
        p.requires_grad for p in full.model.parameters()
    )
    resumed.train()
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), full.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_kl_penalty_with_a_reference_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(make_config(tiny_model_dir, tmp_path, beta=0.1, max_steps=2, learning_rate=1e-2))
    history = trainer.train()
    assert trainer.ref_model is not None
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert history[1]["kl"] > 0.0  # the policy moved away from the reference after one update


def test_speculative_rollouts_in_training_save_the_draft(tiny_model_dir: Path, tmp_path: Path) -> None:
    from fastgrpo.config import SpeculationConfig

    spec = SpeculationConfig(mode="static", nodes=4, top_k=2, depth=2)
    trainer = make_trainer(make_config(tiny_model_dir, tmp_path, speculation=spec))
    (first, second) = trainer.train()
    assert first["spec/n_verify_mean"] == 4.0 and first["spec/draft_time"] > 0
    assert (tmp_path / "checkpoint-2" / "draft" / "draft.safetensors").is_file()
    resumed = make_trainer(make_config(tiny_model_dir, tmp_path, speculation=spec, max_steps=3), resume=True)
    for a, b in zip(
        resumed.rollouts.drafter("eagle").draft.parameters(),
        trainer.rollouts.drafter("eagle").draft.parameters(),
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["paper", "adaptive"])
def test_speculation_with_online_draft_learning_changes_nothing_in_training(
    tiny_model_dir: Path, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every position is sampled with its own uniform, so a speculative run trains on the very completions a plain
    run samples: the rewards and the updated weights are those of ``mode: off``."""
    from fastgrpo.config import SpeculationConfig
    from fastgrpo.speculative.profiler import LatencyProfile, profile_path

    # A saved flat profile (trees look cheap), so that the adaptive controller's first choice is a tree whatever this
    # machine's timings are.
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    tokens = [1, 4, 16, 64, 256]
    flat = LatencyProfile(str(tiny_model_dir), "cpu", "float32", 64, tokens, [0.01] * 5, 256, {"eagle": [0.0001] * 5})
    flat.save(profile_path(str(tiny_model_dir), torch.device("cpu"), torch.float32))

    runs = {}
    for name, spec in {"off": SpeculationConfig(mode="off"), mode: SpeculationConfig(mode=mode, c_peak=32)}.items():
        trainer = make_trainer(make_config(tiny_model_dir, tmp_path / name, speculation=spec, save_steps=10))
        runs[name] = (trainer.train(), trainer.model)
    (plain, plain_model), (spec_history, spec_model) = runs["off"], runs[mode]
    assert [m["reward"] for m in spec_history] == [m["reward"] for m in plain]
    assert all(m["spec/concurrency_mean"] > 0 for m in spec_history)
    assert spec_history[0]["spec/n_verify_mean"] > 1.0, "the first rollout drafts trees"
    for a, b in zip(spec_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def online_config(model_dir: Path, out: Path, **overrides) -> GRPOConfig:
    """Static trees (acceptance comparable across steps) and a draft trained fast on every rollout."""
    from fastgrpo.config import DraftTrainConfig, SpeculationConfig

    spec = SpeculationConfig(mode="static", nodes=4, top_k=2, depth=3)
    draft_training = DraftTrainConfig(learning_rate=1e-2, epochs=4, token_loss_weight=1.0)
    return make_config(model_dir, out, speculation=spec, draft_training=draft_training, **overrides)


def test_lora_with_speculation_resumes_the_adapter_and_the_draft(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Speculative rollouts on a LoRA-wrapped policy sample what plain rollouts sample, and a run cut after one step
    and resumed ends with the adapter and the draft of the uninterrupted run."""

    def config(out: Path, steps: int) -> GRPOConfig:
        return online_config(tiny_model_dir, out, use_peft=True, lora_r=4, max_steps=steps, save_steps=1)

    full = make_trainer(config(tmp_path / "full", 2))
    history = full.train()
    assert all(m["spec/n_verify_mean"] == 4.0 for m in history)
    plain = make_config(tiny_model_dir, tmp_path / "plain", use_peft=True, lora_r=4, max_steps=2, save_steps=10)
    assert [m["reward"] for m in make_trainer(plain).train()] == [m["reward"] for m in history]

    make_trainer(config(tmp_path / "cut", 1)).train()
    resumed = make_trainer(config(tmp_path / "cut", 2), resume=True)
    assert resumed.start_step == 1
    resumed.train()
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), full.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    full_draft = full.rollouts.drafter("eagle").draft.state_dict()
    for name, value in resumed.rollouts.drafter("eagle").draft.state_dict().items():
        torch.testing.assert_close(value, full_draft[name], msg=name)


def test_online_learning_raises_the_acceptance_of_a_random_draft(peaked_model_dir: Path, tmp_path: Path) -> None:
    config = online_config(peaked_model_dir, tmp_path, max_steps=10, save_steps=100, learning_rate=1e-5)
    history = make_trainer(config).train()
    accept = [m["spec/accept_length"] for m in history]
    assert sum(accept[-4:]) / 4 > sum(accept[:2]) / 2 + 0.2, accept  # measured: 1.06 -> 1.34
    assert history[-1]["draft/loss"] < history[0]["draft/loss"]
    assert history[-1]["draft/accuracy"] > history[0]["draft/accuracy"] + 0.2, [m["draft/accuracy"] for m in history]
    assert all(m["draft/time"] > 0 for m in history)


def test_a_draft_update_moves_the_draft_and_not_the_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(online_config(tiny_model_dir, tmp_path))
    trainer.rollout(0, trainer.prompts.rows(0))
    policy = [p.detach().clone() for p in trainer.model.parameters()]
    draft = [p.detach().clone() for p in trainer.rollouts.drafter("eagle").draft.parameters()]
    metrics = trainer.rollouts.learn()
    assert metrics["draft/loss"] > 0
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), policy, strict=True))
    assert all(p.grad is None for p in trainer.model.parameters()), "no gradient reaches the policy"
    assert not all(
        torch.equal(a, b) for a, b in zip(trainer.rollouts.drafter("eagle").draft.parameters(), draft, strict=True)
    )


def test_a_policy_update_moves_the_policy_and_not_the_draft(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(online_config(tiny_model_dir, tmp_path))
    optimize, seen = trainer.update.optimize, []

    def checked(batch, *args):
        draft = [p.detach().clone() for p in trainer.rollouts.drafter("eagle").draft.parameters()]
        policy = [p.detach().clone() for p in trainer.model.parameters()]
        out = optimize(batch, *args)
        assert all(
            torch.equal(a, b) for a, b in zip(trainer.rollouts.drafter("eagle").draft.parameters(), draft, strict=True)
        )
        assert not all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), policy, strict=True))
        seen.append(True)
        return out

    trainer.update.optimize = checked
    trainer.train_step(0)
    assert seen


def test_online_draft_state_survives_checkpoint_and_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    full = make_trainer(online_config(tiny_model_dir, tmp_path / "full", max_steps=4, save_steps=4))
    full.train()
    make_trainer(online_config(tiny_model_dir, tmp_path / "cut", max_steps=2, save_steps=2)).train()
    resumed = make_trainer(online_config(tiny_model_dir, tmp_path / "cut", max_steps=4, save_steps=4), resume=True)
    assert resumed.start_step == 2
    resumed.train()
    for a, b in zip(
        resumed.rollouts.drafter("eagle").draft.parameters(),
        full.rollouts.drafter("eagle").draft.parameters(),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    eagle = next(d for d in resumed.rollouts.drafters if d.name == "eagle")
    state = eagle.learner.trainer.optimizer.state_dict()["state"]
    assert state and all(s["step"] == 16 for s in state.values()), "4 steps x 4 epochs of one batch each"


def test_a_fresh_draft_with_a_reduced_vocabulary_takes_it_from_the_first_rollout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``speculation.draft_vocab_size``: the first rollout drafts with the suffix drafter alone, the draft is made
    with that rollout's most frequent completion tokens and trained on it, the next rollouts draft merged trees,
    training is that of a plain run (lossless), and a resumed run restores the draft with its vocabulary."""
    from dataclasses import replace

    from fastgrpo.speculative.eagle.offline import frequent_tokens

    config = online_config(tiny_model_dir, tmp_path / "vocab", max_steps=3, save_steps=2)
    config = replace(config, speculation=replace(config.speculation, draft_vocab_size=6))
    first = make_trainer(config)
    assert first.rollouts.drafter("eagle") is None and [p.name for p in first.rollouts.waiting] == ["eagle"]
    _, out, _ = first.rollout(0, first.prompts.rows(0))
    expected = frequent_tokens(out.completion_ids, 6, first.eos)
    first.close()

    trainer = make_trainer(config)
    history = trainer.train()
    assert torch.equal(trainer.rollouts.drafter("eagle").draft.draft_vocab, expected) and len(expected) <= 6 + len(
        trainer.eos
    )
    assert history[0]["spec/drafter/suffix/share"] == 1.0 and "draft/loss" in history[0]
    assert all(m["spec/drafter/eagle+suffix/share"] == 1.0 for m in history[1:])
    assert all(m["spec/n_verify_mean"] == 4.0 for m in history)
    plain = make_trainer(make_config(tiny_model_dir, tmp_path / "plain", max_steps=3, save_steps=10)).train()
    assert [m["reward"] for m in history] == [m["reward"] for m in plain]

    resumed = make_trainer(replace(config, max_steps=4), resume=True)
    assert resumed.start_step == 3 and torch.equal(resumed.rollouts.drafter("eagle").draft.draft_vocab, expected)
    resumed.train()


def test_draft_vocab_size_is_for_a_fresh_draft_only(tmp_path: Path) -> None:
    from fastgrpo.config import SpeculationConfig

    with pytest.raises(ValueError, match="speculation.draft_vocab_size applies to a fresh draft"):
        SpeculationConfig(draft=str(tmp_path), draft_vocab_size=64).validate()
    with pytest.raises(ValueError, match="speculation.draft_vocab_size must be >= 2"):
        SpeculationConfig(draft_vocab_size=1).validate()


def test_budget_samples_follow_how_often_the_rollout_ran_trees() -> None:
    from fastgrpo.speculative.eagle.training import budget_samples

    samples = list(range(16))
    assert budget_samples(samples, 0.0, 0.25) == ([0, 5, 10, 15], 0.25)  # evenly spaced: every group keeps some
    assert budget_samples(samples, 0.5, 0.25)[1] == 0.5
    assert budget_samples(samples, 1.0, 0.25) == (samples, 1.0)
    assert budget_samples(samples, 0.0, 1.0) == (samples, 1.0)
    assert budget_samples([7], 0.0, 0.25) == ([7], 1.0)


@pytest.mark.parametrize(("nodes", "trained"), [(1, 0.25), (4, 1.0)])
def test_online_draft_learning_trains_on_less_while_the_rollouts_run_no_tree(
    tiny_model_dir: Path, tmp_path: Path, nodes: int, trained: float
) -> None:
    """Plain steps only (a one-node static tree): the draft trains on a quarter of the completions and the metrics
    say why; a tree at every step: on all of them."""
    from fastgrpo.config import SpeculationConfig

    config = make_config(tiny_model_dir, tmp_path, speculation=SpeculationConfig(mode="static", nodes=nodes, depth=2))
    (metrics,) = make_trainer(config).train()[:1]
    assert metrics["draft/tree_share"] == (0.0 if nodes == 1 else 1.0)
    assert metrics["draft/trained_share"] == trained and metrics["draft/time"] > 0


def test_a_gpu_run_that_would_not_fit_is_refused_before_any_weight_is_read(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a (pretended) GPU with 2 GiB free the trainer refuses at once, naming options that fit; with
    ``check_memory: false`` it goes on to load the model."""
    from fastgrpo import distributed
    from fastgrpo.grpo import trainer as trainer_module

    gpu = distributed.DistInfo(0, 1, torch.device("cuda", 0))
    monkeypatch.setattr(distributed, "init", lambda *a, **k: gpu)
    monkeypatch.setattr("fastgrpo.memory_plan.fitting.available_bytes", lambda device: 2 * 2**30)

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(trainer_module, "load_model", load_model)
    big = dict(max_completion_length=1500)
    with pytest.raises(ValueError, match="more than the 2.0 GiB available on cuda") as refused:
        make_trainer(make_config(tiny_model_dir, tmp_path / "a", **big))
    assert "each of these changes alone fits: max_completion_length: " in str(refused.value)
    with pytest.raises(Loaded):
        make_trainer(make_config(tiny_model_dir, tmp_path / "b", check_memory=False, **big))


def test_gradient_checkpointing_trains_as_without_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Recomputing the layers' activations in the backward pass gives the same update; rollouts (eval mode) run the
    layers as usual."""
    runs = {}
    for checkpointing in (False, True):
        config = make_config(tiny_model_dir, tmp_path / str(checkpointing), gradient_checkpointing=checkpointing)
        trainer = make_trainer(config)
        assert trainer.model.is_activation_checkpointing == checkpointing
        runs[checkpointing] = (trainer.train(), dict(trainer.model.named_parameters()))
    (plain, plain_weights), (recomputed, recomputed_weights) = runs[False], runs[True]
    for a, b in zip(plain, recomputed, strict=True):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(recomputed_weights[name], weight, rtol=1e-4, atol=1e-6, msg=name)


def test_on_a_gpu_the_step_frees_the_rollout_before_the_update_and_reports_each_phase(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA branch of a step, run on CPU with the device's memory counters stood in for: the captured states are
    freed after the draft's update and before the policy's, the KV caches stay where they are for the next rollout,
    and each phase's peaks, allocated and reserved, are its own."""
    from fastgrpo.config import SpeculationConfig
    from fastgrpo.grpo import generation as generation_module
    from fastgrpo.grpo import trainer as trainer_module

    spec = SpeculationConfig(mode="static", nodes=4, top_k=2, depth=2)
    trainer = make_trainer(make_config(tiny_model_dir, tmp_path, speculation=spec))
    events: list[str] = []
    peaks, reserved = iter([300.0, 200.0]), iter([400.0, 350.0])
    for module in (trainer_module, generation_module):
        monkeypatch.setattr(module, "reset_peak_memory", lambda device: events.append("reset"))
        monkeypatch.setattr(module, "peak_memory_mb", lambda device: events.append("peak") or next(peaks))
        monkeypatch.setattr(module, "peak_reserved_mb", lambda device: next(reserved))
    stream = type("Stream", (), {"synchronize": lambda self: events.append("sync")})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    release, optimize = trainer.rollouts.release, trainer.update.optimize
    monkeypatch.setattr(trainer.rollouts, "release", lambda: events.append("release") or release())
    monkeypatch.setattr(trainer.update, "optimize", lambda *args: events.append("update") or optimize(*args))
    trainer.device = torch.device("cuda", 0)
    caches = (trainer.rollouts.engine, trainer.rollouts.engine.drafters["eagle"])
    metrics = trainer.train_step(0)
    # each timed phase ends once its queued work has (the draft's update, the log-probs, the update); a step's peaks
    # are counted from its start (not the last step's evaluation or checkpoint)
    assert events == ["reset", "reset", "sync", "peak", "release", "reset", "sync", "update", "sync", "peak"]
    assert all(owner.cache is not None for owner in caches)
    assert metrics["memory/rollout_peak_mb"] == 300.0 and metrics["memory/update_peak_mb"] == 200.0
    assert metrics["memory/rollout_peak_reserved_mb"] == 400.0 and metrics["memory/update_peak_reserved_mb"] == 350.0
    assert metrics["memory/peak_mb"] == 300.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"temperature": 0.0}, "temperature: 0 samples greedily, so every completion of a group is the same"),
        ({"max_completion_length": 4096}, "exceed the model's context of 2048 tokens (max_position_embeddings)"),
    ],
)
def test_settings_that_cannot_train_are_refused_before_any_weight_is_read(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict, message: str
) -> None:
    from fastgrpo.grpo import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_trainer(make_config(tiny_model_dir, tmp_path, **overrides))


def test_in_training_evaluation_logs_eval_metrics_and_leaves_the_training_as_it_was(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """eval_strategy steps: eval/ metrics after every eval_steps steps and after the last, in metrics.jsonl beside
    the step's; the eval rollouts draw their own noise and draft nothing, so the training's metrics (the drafters'
    included) and weights are those of a run without evaluation."""
    evaluation = dict(
        eval_strategy="steps",
        eval_steps=2,
        eval_dataset=DataConfig(split="test", limit=3),
        num_generations_eval=2,
        per_device_eval_batch_size=4,
    )
    runs = {}
    for name, extra in {"plain": {}, "eval": evaluation}.items():
        # static trees of both drafters and fixed threads: the two runs draft and round alike whatever the timings
        config = online_config(tiny_model_dir, tmp_path / name, max_steps=3, save_steps=10, cpu_threads=1, **extra)
        config.speculation.drafter = "eagle+suffix"
        trainer = make_trainer(config)
        runs[name] = (trainer.train(), trainer.model)
    (plain, plain_model), (history, model) = runs["plain"], runs["eval"]
    lines = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval/reward" in line] == [2, 3]
    logged = next(line for line in lines if line["step"] == 2)
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/length_reward/mean",
        "completions/mean_length",
    ):
        assert math.isfinite(logged[f"eval/{key}"]), key
    assert logged["eval/completions/max_length"] <= 12
    assert logged["eval/runtime"] > 0

    def training(metrics: dict[str, float]) -> dict[str, float]:
        timed = ("time/", "eval/", "memory/", "cpu/")
        return {k: v for k, v in metrics.items() if not k.startswith(timed) and "second" not in k and "time" not in k}

    assert [training(m) for m in history] == [training(m) for m in plain]
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_logged_learning_rate_is_the_one_each_step_used(tiny_model_dir: Path, tmp_path: Path) -> None:
    """As TRL logs it: a linear schedule over two steps from 1e-3 trains the first step at 1e-3 and the second at
    5e-4, and logs those (not the rate the scheduler moved to after the step)."""
    trainer = make_trainer(make_config(tiny_model_dir, tmp_path, lr_scheduler_type="linear"))
    history = trainer.train()
    assert [m["learning_rate"] for m in history] == pytest.approx([1e-3, 5e-4])
