"""Tests for fastgrpo.grpo.losses: expected values are worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastgrpo.config import LOSS_TYPES
from fastgrpo.grpo.logprobs import completion_logprobs
from fastgrpo.grpo.losses import group_advantages, grpo_loss

F64 = torch.float64

# ---------------------------------------------------------------------------- advantages

# Two groups of G=3. Group 0: mean 3, deviations (-2, -1, 3), unbiased var (4+1+9)/2 = 7.
# Group 1: constant 4, deviations 0, std 0.
REWARDS = [1.0, 2.0, 6.0, 4.0, 4.0, 4.0]
DEVIATIONS = [-2.0, -1.0, 3.0, 0.0, 0.0, 0.0]
GROUP_STD = [math.sqrt(7)] * 3 + [0.0] * 3


def _rewards() -> torch.Tensor:
    return torch.tensor(REWARDS, dtype=F64)


def test_group_advantages_group_scaling() -> None:
    adv, std = group_advantages(_rewards(), 3, "group")
    expected = [d / (s + 1e-4) for d, s in zip(DEVIATIONS, GROUP_STD, strict=True)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64))
    torch.testing.assert_close(std, torch.tensor(GROUP_STD, dtype=F64))


def test_group_advantages_batch_scaling() -> None:
    # Batch mean 21/6 = 3.5; squared deviations 6.25 + 2.25 + 6.25 + 3 * 0.25 = 15.5; var 15.5 / 5.
    batch_std = math.sqrt(15.5 / 5)
    adv, std = group_advantages(_rewards(), 3, "batch")
    torch.testing.assert_close(adv, torch.tensor([d / (batch_std + 1e-4) for d in DEVIATIONS], dtype=F64))
    torch.testing.assert_close(std, torch.tensor(GROUP_STD, dtype=F64))


def test_group_advantages_no_scaling() -> None:
    adv, std = group_advantages(_rewards(), 3, "none")
    torch.testing.assert_close(adv, torch.tensor(DEVIATIONS, dtype=F64))
    torch.testing.assert_close(std, torch.tensor(GROUP_STD, dtype=F64))


@pytest.mark.parametrize(
    ("num_generations", "scale_rewards", "match"),
    [(3, "bogus", "scale_rewards"), (4, "group", "num_generations"), (1, "group", "num_generations")],
)
def test_group_advantages_errors(num_generations: int, scale_rewards: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(_rewards(), num_generations, scale_rewards)


# ---------------------------------------------------------------------------- grpo_loss

# B=2, C=3, epsilon=0.2 -> band [0.8, 1.2]; mask drops the last token of row 1.
# Row 0 (A=+1): ratios 1.5, 1.0, 0.5 -> clipped 1.2, 1.0, 0.8
#   min(r*A, c*A) = 1.2, 1.0, 0.5 -> per-token loss -1.2, -1.0, -0.5 (sum -2.7)
# Row 1 (A=-2): ratios 0.7, 1.1, [0.5 masked] -> clipped 0.8, 1.1
#   r*A = -1.4, -2.2; c*A = -1.6, -2.2; min = -1.6, -2.2 -> per-token loss 1.6, 2.2 (sum 3.8)
RATIOS = [[1.5, 1.0, 0.5], [0.7, 1.1, 0.5]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADVANTAGES = [1.0, -2.0]
OLD_LOGPS = [[-0.3, -1.2, -2.0], [-0.9, -0.1, -4.0]]
MASKED_SUM = -1.2 - 1.0 - 0.5 + 1.6 + 2.2


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor(OLD_LOGPS, dtype=F64)
    logps = (old + torch.tensor(RATIOS, dtype=F64).log()).requires_grad_()
    return logps, old, torch.tensor(ADVANTAGES, dtype=F64), torch.tensor(MASK)


def _assert_scalar(actual: torch.Tensor, expected: float) -> None:
    assert actual.dim() == 0
    assert actual.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        # Row means -2.7 / 3 = -0.9 and 3.8 / 2 = 1.9, averaged.
        ("grpo", {}, (-2.7 / 3 + 3.8 / 2) / 2),
        # Sum over the 5 real tokens.
        ("bnpo", {}, MASKED_SUM / 5),
        ("dr_grpo", {"max_completion_length": 4}, MASKED_SUM / (2 * 4)),
        ("dapo", {"num_items_in_batch": 10}, MASKED_SUM / 10),
        ("dapo", {}, MASKED_SUM / 5),
    ],
)
def test_grpo_loss_types(loss_type: str, kwargs: dict, expected: float) -> None:
    logps, old, adv, mask = _inputs()
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type=loss_type, epsilon=0.2, **kwargs)
    _assert_scalar(loss, expected)


def test_grpo_loss_epsilon_high() -> None:
    # Band [0.8, 1.6]: row 0 token 0 (ratio 1.5) is no longer clipped -> -1.5; row 1 unchanged.
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.6)
    _assert_scalar(loss, ((-1.5 - 1.0 - 0.5) / 3 + 3.8 / 2) / 2)
    _assert_scalar(metrics["clip_ratio/high_mean"], 0.0)


def test_grpo_loss_clip_metrics() -> None:
    # Low: ratio < 0.8 with A < 0 -> row 1 token 0 only (row 1 token 2 is masked; row 0 token 2 has A > 0).
    # High: ratio > 1.2 with A > 0 -> row 0 token 0 only. Out of 5 real tokens.
    logps, old, adv, mask = _inputs()
    _, metrics = grpo_loss(logps, old, adv, mask, loss_type="bnpo", epsilon=0.2)
    # The extremes over completions of each one's share: row 0 has no low-clipped token (0 of 3), row 1 one of 2;
    # row 0 one high-clipped token of 3, row 1 none.
    assert set(metrics) == {
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    }
    _assert_scalar(metrics["clip_ratio/low_mean"], 1 / 5)
    _assert_scalar(metrics["clip_ratio/high_mean"], 1 / 5)
    _assert_scalar(metrics["clip_ratio/region_mean"], 2 / 5)
    _assert_scalar(metrics["clip_ratio/low_min"], 0.0)
    _assert_scalar(metrics["clip_ratio/high_max"], 1 / 3)
    assert all(not value.requires_grad for value in metrics.values())


def test_grpo_loss_gradient_is_zero_where_clipped() -> None:
    # grpo: d loss / d logp = -A * ratio / (row tokens * B) on unclipped real tokens, 0 elsewhere.
    # Row 0: token 0 clipped; tokens 1, 2: -1 * 1.0 / 6 and -1 * 0.5 / 6.
    # Row 1: token 0 clipped (min picks c*A); token 1: 2 * 1.1 / 4; token 2 masked.
    logps, old, adv, mask = _inputs()
    loss, _ = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=0.2)
    loss.backward()
    expected = torch.tensor([[0.0, -1.0 / 6, -0.5 / 6], [0.0, 2 * 1.1 / 4, 0.0]], dtype=F64)
    torch.testing.assert_close(logps.grad, expected)


def test_grpo_loss_kl_term() -> None:
    # d = ref - logps; k3 = exp(d) - d - 1:
    #   d = 0 -> 0; d = ln 2 -> 2 - ln 2 - 1; d = -ln 2 -> 0.5 + ln 2 - 1; d = ln 3 -> 3 - ln 3 - 1.
    logps, old, adv, mask = _inputs()
    ln2, ln3 = math.log(2), math.log(3)
    delta = torch.tensor([[0.0, ln2, -ln2], [ln3, 0.0, 5.0]], dtype=F64)
    kl_sum = 0.0 + (2 - ln2 - 1) + (0.5 + ln2 - 1) + (3 - ln3 - 1) + 0.0
    options = {"loss_type": "bnpo", "epsilon": 0.2, "beta": 0.1, "ref_logps": logps.detach() + delta}
    loss, metrics = grpo_loss(logps, old, adv, mask, use_bias_correction_kl=False, **options)
    _assert_scalar(loss, (MASKED_SUM + 0.1 * kl_sum) / 5)
    _assert_scalar(metrics["kl"], kl_sum / 5)
    # TRL's default use_bias_correction_kl weighs each token's KL by its ratio (RATIOS): 1.0, 0.5 and 0.7 here.
    weighted = 1.0 * (2 - ln2 - 1) + 0.5 * (0.5 + ln2 - 1) + 0.7 * (3 - ln3 - 1)
    loss, metrics = grpo_loss(logps, old, adv, mask, **options)
    _assert_scalar(loss, (MASKED_SUM + 0.1 * weighted) / 5)
    _assert_scalar(metrics["kl"], weighted / 5)


def test_dapo_micro_batches_sum_to_global_token_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 6, generator=gen, dtype=F64)
    old = logps + 0.3 * torch.randn(4, 6, generator=gen, dtype=F64)
    adv = torch.randn(4, generator=gen, dtype=F64)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0], [1] * 3 + [0] * 3])
    total = int(mask.sum())
    whole, _ = grpo_loss(logps, old, adv, mask, num_items_in_batch=total)
    parts = [
        grpo_loss(logps[s], old[s], adv[s], mask[s], num_items_in_batch=total)[0] for s in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    torch.testing.assert_close(whole, grpo_loss(logps, old, adv, mask, loss_type="bnpo")[0])


def test_sequence_level_ratio_is_the_mean_of_the_rows_log_ratios() -> None:
    """GSPO: each row's tokens share exp(mean of its log-ratios), not exp of their sum; grpo aggregation.
    Row 0 (A=+1): exp((ln 1.5 + ln 1 + ln 0.5) / 3) = 0.75^(1/3), inside [0.8, 1.2] -> per-token loss -0.75^(1/3).
    Row 1 (A=-2, 2 real tokens): exp((ln 0.7 + ln 1.1) / 2) = 0.77^(1/2) -> per-token loss 2 * 0.77^(1/2)."""
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, adv, mask, loss_type="grpo", importance_sampling_level="sequence")
    _assert_scalar(loss, (-(0.75 ** (1 / 3)) + 2 * 0.77**0.5) / 2)
    # Three tokens of log-ratio ln 1.1 each weigh 1.1, not 1.1^3 (a band wide enough for both).
    old_row = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    row, _ = grpo_loss(
        old_row + math.log(1.1),
        old_row,
        torch.ones(1, dtype=F64),
        torch.ones(1, 3),
        loss_type="grpo",
        epsilon_high=1.0,
        importance_sampling_level="sequence",
    )
    _assert_scalar(row, -1.1)
    # As shares of sequences: with epsilon 0.05 row 1's 0.877 < 0.95 and A < 0 is clipped low, row 0 (A > 0) is not.
    _, metrics = grpo_loss(logps, old, adv, mask, loss_type="grpo", epsilon=0.05, importance_sampling_level="sequence")
    _assert_scalar(metrics["clip_ratio/low_mean"], 1 / 2)
    _assert_scalar(metrics["clip_ratio/high_mean"], 0.0)


def test_cispo_weights_the_log_prob_gradient_by_the_capped_ratio() -> None:
    """cispo: per token -min(r, epsilon_high).detach() * A * logp, summed over num_items_in_batch (dapo's). Weights
    row 0: 1.2 (capped), 1.0, 0.5; row 1: 0.7, 1.1; the gradient is -w A / 5, never cut by the cap."""
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, adv, mask, loss_type="cispo", epsilon_high=1.2, num_items_in_batch=5)
    lp = logps.detach()
    expected = -(1.2 * lp[0, 0] + 1.0 * lp[0, 1] + 0.5 * lp[0, 2]) + 2 * (0.7 * lp[1, 0] + 1.1 * lp[1, 1])
    _assert_scalar(loss, float(expected) / 5)
    loss.backward()
    weights = torch.tensor([[1.2 * 1, 1.0 * 1, 0.5 * 1], [0.7 * -2, 1.1 * -2, 0.0]], dtype=F64)
    torch.testing.assert_close(logps.grad, -weights / 5)
    _assert_scalar(metrics["cispo_clip_ratio"], 1 / 5)  # ratio > 1.2 with A > 0: row 0 token 0
    assert set(metrics) == {"cispo_clip_ratio"}


def test_sapo_gates_the_ratio_softly() -> None:
    """sapo: per token -sigmoid(tau (r - 1)) * 4 / tau * A with tau 1.0 where A > 0 and 1.05 elsewhere; grpo
    aggregation; no clip metrics."""
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, adv, mask, loss_type="sapo")

    def gate(r: float, tau: float) -> float:
        return 1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau

    row0 = -sum(gate(r, 1.0) for r in (1.5, 1.0, 0.5)) / 3
    row1 = 2 * sum(gate(r, 1.05) for r in (0.7, 1.1)) / 2
    _assert_scalar(loss, (row0 + row1) / 2)
    assert metrics == {}
    # At r = 1 the gate's slope is 1: the gradient of a token is the clipped loss's, -A / (tokens * B).
    loss.backward()
    assert logps.grad[0, 1].item() == pytest.approx(-1 / 6, abs=1e-12)


def test_delta_caps_the_ratio_where_the_advantage_is_negative() -> None:
    """Two-sided clipping: a token of ratio 2 and A = -1 costs min(2 * -1, 1.2 * -1) = -2 -> 2 unclipped; with delta
    1.5 it costs 1.5 and passes no gradient. A token of ratio 1 costs 1 either way (bnpo: the mean)."""
    old = torch.tensor([[-1.0, -2.0]], dtype=F64)
    logps = (old + torch.tensor([[2.0, 1.0]], dtype=F64).log()).requires_grad_()
    adv, mask = torch.tensor([-1.0], dtype=F64), torch.ones(1, 2)
    plain, _ = grpo_loss(logps, old, adv, mask, loss_type="bnpo")
    _assert_scalar(plain, (2.0 + 1.0) / 2)
    capped, _ = grpo_loss(logps, old, adv, mask, loss_type="bnpo", delta=1.5)
    _assert_scalar(capped, (1.5 + 1.0) / 2)
    capped.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.5]], dtype=F64))


def test_grpo_loss_errors() -> None:
    logps, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="loss_type") as info:
        grpo_loss(logps, old, adv, mask, loss_type="ppo")
    assert all(name in str(info.value) for name in LOSS_TYPES)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(logps, old, adv, mask, importance_sampling_level="row")


# ---------------------------------------------------------------------------- completion_logprobs

PAD = 0
# [prompt (left-padded to 5) | completion (right-padded to 4)]; prompt lengths 5, 2, 4 and
# completion lengths 4, 2, 3.
PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34]]
COMPLETIONS = [[41, 42, 43, 44], [51, 52], [61, 62, 63]]


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns input_ids [3, 9], attention_mask [3, 9] and completion_mask [3, 4]."""
    rows, masks, completion_masks = [], [], []
    for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
        left, right = 5 - len(prompt), 4 - len(completion)
        rows.append([PAD] * left + prompt + completion + [PAD] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        completion_masks.append([1] * len(completion) + [0] * right)
    return torch.tensor(rows), torch.tensor(masks), torch.tensor(completion_masks)


def _reference_logprobs(model, input_ids, attention_mask, logits_to_keep, temperature):
    """Full forward + full-vocabulary log-softmax, gathered at the completion tokens."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logps = torch.log_softmax(logits / temperature, dim=-1)[:, -logits_to_keep - 1 : -1]
    return logps.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_tokens", [3, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_matches_full_forward(chunk_tokens: int, temperature: float) -> None:
    model = _tiny_llama()
    input_ids, attention_mask, _ = _batch()
    with torch.no_grad():
        expected = _reference_logprobs(model, input_ids, attention_mask, 4, temperature)
        actual = completion_logprobs(model, input_ids, attention_mask, 4, temperature, chunk_tokens)
    assert actual.shape == (3, 4) and actual.dtype == F64
    torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0)


def test_completion_logprobs_left_padding_is_invisible() -> None:
    # Each row alone, without its left padding, must give the same completion log-probs.
    model = _tiny_llama()
    input_ids, attention_mask, completion_mask = _batch()
    with torch.no_grad():
        batched = completion_logprobs(model, input_ids, attention_mask, 4, chunk_tokens=3)
        for row, prompt in enumerate(PROMPTS):
            left = 5 - len(prompt)
            alone = completion_logprobs(model, input_ids[row : row + 1, left:], attention_mask[row : row + 1, left:], 4)
            valid = completion_mask[row].bool()
            torch.testing.assert_close(batched[row, valid], alone[0, valid], atol=1e-10, rtol=0)


def test_completion_logprobs_gradients_match_full_forward() -> None:
    model = _tiny_llama()
    input_ids, attention_mask, completion_mask = _batch()
    weights = torch.linspace(0.5, 1.5, 12, dtype=F64).view(3, 4) * completion_mask
    (_reference_logprobs(model, input_ids, attention_mask, 4, 0.7) * weights).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (completion_logprobs(model, input_ids, attention_mask, 4, 0.7, chunk_tokens=5) * weights).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        torch.testing.assert_close(param.grad, expected[name], atol=1e-10, rtol=0, msg=name)


def test_completion_logprobs_peft_wrapped_model() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _tiny_llama(),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False),
    )
    input_ids, attention_mask, _ = _batch()
    with torch.no_grad():
        expected = _reference_logprobs(model, input_ids, attention_mask, 4, 1.0)
        actual = completion_logprobs(model, input_ids, attention_mask, 4, chunk_tokens=3)
    torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logits_to_keep": 9}, "logits_to_keep"),
        ({"logits_to_keep": 0}, "logits_to_keep"),
        ({"logits_to_keep": 4, "chunk_tokens": 0}, "chunk_tokens"),
        ({"logits_to_keep": 4, "temperature": 0.0}, "temperature"),
    ],
)
def test_completion_logprobs_errors(kwargs: dict, match: str) -> None:
    input_ids, attention_mask, _ = _batch()
    with pytest.raises(ValueError, match=match):
        completion_logprobs(_tiny_llama(), input_ids, attention_mask, **kwargs)
