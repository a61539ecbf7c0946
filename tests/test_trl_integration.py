"""fastgrpo inside TRL's GRPOTrainer: the rollout_func runs the fastgrpo engine, the callback trains the draft after
each step, saves it into TRL's checkpoints and restores it when TRL resumes."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, torchrun_two
from safetensors.torch import load_file

from fastgrpo.config import SpeculationConfig

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl_run import length_reward, tiny_grpo_trainer  # noqa: E402

from fastgrpo.integrations.trl import DraftCallback, SpeculativeRollout  # noqa: E402


class Recorder:
    """Wraps the rollout_func: keeps what it returned and the draft's weights when the run's first rollout began."""

    def __init__(self, rollout: SpeculativeRollout):
        self.rollout, self.returned, self.draft_at_start = rollout, [], None

    def __call__(self, prompts: list, trainer: trl.GRPOTrainer) -> dict:
        out = self.rollout(prompts, trainer)
        if self.draft_at_start is None:
            self.draft_at_start = {k: v.clone() for k, v in self.rollout.drafter("eagle").draft.state_dict().items()}
        self.returned.append(out)
        return out


def grpo_trainer(model_dir: Path, out: Path, recorder: Recorder, seen: list, max_steps: int) -> trl.GRPOTrainer:
    def reward(completions: list, completion_ids: list, **kwargs) -> list[float]:
        seen.append(completion_ids)
        return length_reward(completions)

    callbacks = [DraftCallback(recorder.rollout)]
    return tiny_grpo_trainer(model_dir, out, recorder, callbacks, reward, max_steps=max_steps, save_steps=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3, tie_word_embeddings=False, head_scale=150.0)


def test_trl_trains_with_fastgrpo_rollouts_and_online_draft_learning(model_dir: Path, tmp_path: Path) -> None:
    rollout = SpeculativeRollout(speculation=SpeculationConfig(mode="static", nodes=4, top_k=2, depth=3))
    recorder, seen = Recorder(rollout), []
    trainer = grpo_trainer(model_dir, tmp_path / "run", recorder, seen, max_steps=2)
    trainer.train()

    # Every completion TRL scored and trained on came from the fastgrpo engine, with its speculative steps.
    assert len(recorder.returned) == 2 and rollout.engine is not None
    assert seen == [r["completion_ids"] for r in recorder.returned]
    for r in recorder.returned:
        assert [len(ids) for ids in r["completion_ids"]] == [len(lps) for lps in r["logprobs"]]
    assert all(e["spec/n_verify_mean"] == 4 for e in trainer.state.log_history if "spec/n_verify_mean" in e)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"spec/accept_length", "draft/loss", "draft/time", "rollout/tokens_per_second"} <= logged

    # The draft was updated, and saved with TRL's checkpoint.
    now = rollout.drafter("eagle").draft.state_dict()
    assert any(not torch.equal(now[k], v) for k, v in recorder.draft_at_start.items())
    saved = tmp_path / "run" / "checkpoint-2" / "draft"
    assert (saved / "draft.safetensors").is_file() and (saved / "learners.pt").is_file()

    # Resuming TRL from that checkpoint resumes the draft too (here with the default adaptive controller, whose
    # first rollout calibrates it on the model without taking it out of training mode).
    resumed = Recorder(SpeculativeRollout())
    trainer = grpo_trainer(model_dir, tmp_path / "run", resumed, [], max_steps=3)
    trainer.train(resume_from_checkpoint=True)
    assert len(resumed.returned) == 1
    assert all(torch.equal(resumed.draft_at_start[k], v) for k, v in now.items())
    last = trainer.state.log_history[-2]
    assert last["step"] == 3 and "reward" in last and not any(k.startswith("eval_") for k in last)


def test_a_fresh_trl_draft_with_a_reduced_vocabulary_takes_it_from_the_first_rollout(
    model_dir: Path, tmp_path: Path
) -> None:
    """``speculation.draft_vocab_size`` in TRL: the first rollout drafts with the suffix drafter alone, the draft is
    made over its most frequent completion tokens and trained on it, and the next rollout drafts merged trees."""
    from fastgrpo.models import eos_token_ids
    from fastgrpo.speculative.eagle.offline import frequent_tokens

    spec = SpeculationConfig(mode="static", nodes=4, top_k=2, depth=3, draft_vocab_size=6)
    rollout = SpeculativeRollout(speculation=spec)
    recorder = Recorder(rollout)
    trainer = grpo_trainer(model_dir, tmp_path / "run", recorder, [], max_steps=2)
    trainer.train()

    eos = eos_token_ids(rollout.engine.model, trainer.processing_class)
    expected = frequent_tokens(recorder.returned[0]["completion_ids"], 6, eos)
    assert torch.equal(rollout.drafter("eagle").draft.draft_vocab, expected) and len(expected) <= 6 + len(eos)
    logs = [e for e in trainer.state.log_history if "spec/n_verify_mean" in e]
    assert [e["spec/n_verify_mean"] for e in logs] == [4.0, 4.0]
    assert "spec/drafter/suffix/share" in logs[0] and "spec/drafter/eagle+suffix/share" in logs[1]
    assert "draft/loss" in logs[0], "the draft trains on the first rollout"
    now = rollout.drafter("eagle").draft.state_dict()
    assert any(not torch.equal(now[k], v) for k, v in recorder.draft_at_start.items())

    with pytest.raises(ValueError, match="draft_vocab_size applies to a fresh draft"):
        SpeculativeRollout(draft=tmp_path, speculation=SpeculationConfig(draft_vocab_size=6))


def test_unsupported_trl_options_are_refused_before_generating(model_dir: Path, tmp_path: Path) -> None:
    recorder = Recorder(SpeculativeRollout())
    trainer = grpo_trainer(model_dir, tmp_path / "run", recorder, [], max_steps=1)
    trainer.args.repetition_penalty = 1.1
    with pytest.raises(ValueError, match="repetition_penalty"):
        trainer.train()
    trainer.args.repetition_penalty = 1.0
    trainer.tools = [len]
    with pytest.raises(ValueError, match="TRL runs its own tool loop after rollout_func"):
        trainer.train()
    assert recorder.returned == []


def test_two_trl_processes_keep_identical_drafts(model_dir: Path, tmp_path: Path) -> None:
    """TRL in 2 processes (torchrun, gloo): each rank rolls out with its own engine and the draft updates average
    their gradients, so both ranks end with the same draft."""
    script = Path(__file__).parent / "trl_run.py"
    result = torchrun_two([str(script), str(model_dir), str(tmp_path)], {"TRL_EXPERIMENTAL_SILENCE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rank0 = load_file(str(tmp_path / "rank0" / "draft.safetensors"))
    rank1 = load_file(str(tmp_path / "rank1" / "draft.safetensors"))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)


def test_an_untested_trl_version_is_refused_with_the_range_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastgrpo.integrations.trl import check_trl_version

    check_trl_version()  # the installed one is in the range
    monkeypatch.setattr(trl, "__version__", "1.13.0")
    with pytest.raises(ImportError, match=r"tested with trl>=1\.14\.0,<1\.17\.0.*found trl 1\.13\.0"):
        check_trl_version()


def drafters_state(rollouts) -> dict:
    """The drafters' state of a `TrainingRollouts`: the EAGLE head's weights and every learner's state."""
    return {
        "draft": {k: v.clone() for k, v in rollouts.drafter("eagle").draft.state_dict().items()},
        "learners": {d.name: copy.deepcopy(d.learner.state_dict()) for d in rollouts.drafters if d.learner},
    }


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


class SnapshotRollout(SpeculativeRollout):
    """Keeps the drafters' state as it was when they were built and restored (before the first rollout)."""

    snapshot: dict | None = None

    def _rollouts(self, trainer: trl.GRPOTrainer):
        first = self.rollouts is None
        rollouts = super()._rollouts(trainer)
        if first:
            self.snapshot = drafters_state(rollouts)
        return rollouts


def test_drafters_resume_across_trainers(model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint's drafters (the EAGLE head, its optimizer, the suffix drafter's memory) written by fastgrpo's
    trainer resume in the TRL integration, and the reverse, through ``speculation.draft``."""
    from test_trainer import make_config, make_trainer

    spec = SpeculationConfig(mode="static", nodes=4, top_k=2, depth=3, drafter="eagle+suffix")
    ours = make_trainer(make_config(model_dir, tmp_path / "ours", speculation=spec, max_steps=1, save_steps=1))
    ours.train()
    saved = drafters_state(ours.rollouts)
    assert saved["learners"]["suffix"]["prompts"] and saved["learners"]["eagle"]["state"]

    rollout = SnapshotRollout(speculation=replace(spec, draft=str(tmp_path / "ours" / "checkpoint-1" / "draft")))
    trainer = grpo_trainer(model_dir, tmp_path / "trl", Recorder(rollout), [], max_steps=2)
    trainer.train()
    assert_same(rollout.snapshot, saved)
    theirs = drafters_state(rollout.rollouts)
    assert len(theirs["learners"]["suffix"]["prompts"]) > len(saved["learners"]["suffix"]["prompts"])

    back = replace(spec, draft=str(tmp_path / "trl" / "checkpoint-2" / "draft"))
    resumed = make_trainer(make_config(model_dir, tmp_path / "back", speculation=back, max_steps=1))
    assert_same(drafters_state(resumed.rollouts), theirs)
