"""The sampler's log-probs against the trainer's: the gap logged under TRL's names, and TRL's importance-sampling
correction of it (`sampling_correction`), per token or per completion, truncated or masked."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_model, save_tiny_llama
from test_trainer import make_config, make_trainer

from fastgrpo.grpo.batch import build_batch
from fastgrpo.grpo.logprobs import completion_logprobs
from fastgrpo.grpo.losses import grpo_loss, sampling_correction
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.suffix.drafter import SuffixDrafter
from fastgrpo.training_rollouts import step_uniforms

F64 = torch.float64
OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]
GAP = [[0.1, -0.2, 0.3], [0.0, 2.0, 9.0]]  # old - sampling; the last token is padding
MASK = [[1, 1, 1], [1, 1, 0]]


def corrected(mode: str, **clip) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    old = torch.tensor(OLD, dtype=F64)
    return sampling_correction(old, old - torch.tensor(GAP, dtype=F64), torch.tensor(MASK), mode, **clip)


def test_the_four_modes_and_their_metrics() -> None:
    """Per token, exp(gap) (e^2 > 3 clamped to 3, or zeroed); per completion, exp of the gaps' sum (row 0: e^0.2,
    row 1: e^2, clamped or zeroed); the gap's mean and max over the 5 real tokens whatever the mode."""
    e = math.exp
    ratio, metrics = corrected("token_truncate", clip_max=3.0)
    torch.testing.assert_close(ratio, torch.tensor([[e(0.1), e(-0.2), e(0.3)], [1.0, 3.0, 1.0]], dtype=F64))
    assert metrics["sampling/sampling_logp_difference/mean"].item() == pytest.approx(2.6 / 5)
    assert metrics["sampling/sampling_logp_difference/max"].item() == pytest.approx(2.0)
    assert metrics["sampling/importance_sampling_ratio/max"].item() == pytest.approx(3.0)  # padding not counted
    ratio, metrics = corrected("token_mask", clip_max=3.0)
    assert ratio[1, 1].item() == 0.0 and metrics["sampling/importance_sampling_ratio/min"].item() == 0.0
    ratio, _ = corrected("sequence_truncate", clip_max=3.0)
    torch.testing.assert_close(ratio, torch.tensor([[e(0.2)], [3.0]], dtype=F64))
    ratio, metrics = corrected("sequence_mask", clip_max=3.0)
    torch.testing.assert_close(ratio, torch.tensor([[e(0.2)], [0.0]], dtype=F64))
    assert metrics["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(e(0.2) / 2)
    ratio, _ = corrected("sequence_mask", clip_min=1.5, clip_max=None)
    torch.testing.assert_close(ratio, torch.tensor([[0.0], [e(2.0)]], dtype=F64))
    with pytest.raises(ValueError, match="importance_sampling_mode"):
        corrected("sequence")


def test_the_correction_brings_a_perturbed_samplers_gradient_back_to_the_policys() -> None:
    """A policy over 4 tokens, p = softmax(theta), and a sampler that draws from a perturbed q. The policy gradient
    GRPO's loss estimates is grad E_p[A] = sum_x p(x) A(x) grad log p(x); its expectation over the sampler's draws
    (each token x weighted by q(x), exactly) is sum_x q(x) A(x) grad log p(x) uncorrected, and with the per-token
    correction (weight p(x) / q(x)) the policy's own."""
    theta = torch.tensor([0.3, -0.5, 1.2, 0.0], dtype=F64, requires_grad=True)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0], dtype=F64)
    q = torch.softmax(theta.detach() + torch.tensor([0.8, 0.0, -0.6, 0.3], dtype=F64), dim=0)
    (truth,) = torch.autograd.grad((torch.softmax(theta, dim=0) * advantages).sum(), theta)

    def expected_gradient(correct: bool) -> torch.Tensor:
        total = torch.zeros(4, dtype=F64)
        for x in range(4):
            logp = torch.log_softmax(theta, dim=0)[x].reshape(1, 1)
            weights, _ = sampling_correction(
                logp, q[x].log().reshape(1, 1), torch.ones(1, 1), "token_truncate", None, 1e9
            )
            loss, _ = grpo_loss(
                logp,
                logp.detach(),
                advantages[x : x + 1],
                torch.ones(1, 1),
                loss_type="bnpo",
                sampling_weights=weights if correct else None,
            )
            (grad,) = torch.autograd.grad(loss, theta)
            total -= q[x] * grad  # the loss is the negated objective
        return total

    torch.testing.assert_close(expected_gradient(correct=True), truth, rtol=0, atol=1e-12)
    assert (expected_gradient(correct=False) - truth).abs().max() > 0.05


def rollout_gap(model: torch.nn.Module, params: SamplingParams, speculative: bool) -> dict[str, torch.Tensor]:
    """The correction's metrics between an engine's rollout of 2 prompts x 4 and a training forward over it."""
    prompts = [[5, 9, 14, 3, 22], [7, 7, 30]]
    kwargs = {"drafter": SuffixDrafter(), "tree": TreeShape(4, 2, 3)} if speculative else {}
    engine = RolloutEngine(model, [0], **kwargs)
    out = engine.generate(prompts, params, 4, uniforms=step_uniforms(0, 0, 8, params.max_new_tokens))
    rows = [p for p in prompts for _ in range(4)]
    batch = build_batch(rows, out.completion_ids, 0, torch.zeros(8), out.logprobs)
    width = batch.completion_mask.shape[1]
    with torch.no_grad():
        old = completion_logprobs(model, batch.input_ids, batch.attention_mask, width, params.temperature)
    _, metrics = sampling_correction(old, batch.sampling_logps, batch.completion_mask, "sequence_mask")
    return metrics


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "suffix-trees"])
def test_sampler_and_trainer_agree_to_rounding_under_top_p(speculative: bool) -> None:
    """Sampled at T=0.9 with top_p 0.8, the sampler scores tokens under the unfiltered distribution as the trainer
    does: in float64 the gap is rounding (1e-12) and every completion's ratio is 1; in float32 the mean ratio is
    within 1 % of 1; in bfloat16 the gap is small but not zero."""
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.8)
    model = make_tiny_model("llama").eval()
    exact = rollout_gap(model.to(F64), params, speculative)
    assert exact["sampling/sampling_logp_difference/max"].item() < 1e-12
    assert exact["sampling/importance_sampling_ratio/min"].item() == pytest.approx(1.0, abs=1e-10)
    single = rollout_gap(model.to(torch.float32), params, speculative)
    assert single["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(1.0, abs=0.01)
    low = rollout_gap(model.to(torch.bfloat16), params, speculative)
    assert 0 < low["sampling/sampling_logp_difference/mean"].item() < 0.5


def test_a_training_step_logs_the_gap_and_trains_with_the_correction(tmp_path) -> None:
    """Every step logs TRL's sampling/sampling_logp_difference/*; the ratio (sampling/importance_sampling_ratio/*) only
    where the correction applies it, and then a float32 run's ratios are 1 to rounding."""
    model_dir = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)
    gap = {f"sampling/sampling_logp_difference/{s}" for s in ("mean", "max")}
    ratio = {f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")}
    for correction in (False, True):
        config = make_config(
            model_dir, tmp_path / str(correction), max_steps=1, save_steps=1, importance_sampling_correction=correction
        )
        (metrics,) = make_trainer(config).train()
        assert gap <= set(metrics) and (ratio & set(metrics)) == (ratio if correction else set())
        assert metrics["sampling/sampling_logp_difference/max"] < 1e-4
        if correction:
            assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
